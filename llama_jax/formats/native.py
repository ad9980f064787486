"""llama_jax's own checkpoint: `config.yaml` (the model section) + `params/` (an orbax
checkpoint of the parameter tree). Orbax restores straight into the requested dtype (and, with
target shardings, onto any mesh). Checkpoints in the layout before the component tree load
through formats/legacy.py."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml

from llama_jax.config import ModelConfig, load_model_config
from llama_jax.errors import CheckpointError, ConfigError
from llama_jax.formats.loading import (Loading, Placement, build_leaf, placed_target, put,
                                       unflatten)
from llama_jax.formats.legacy import from_legacy, is_legacy, legacy_target
from llama_jax.model.params import Params, flat_paths, param_specs, quantize_params
from llama_jax.quant import Int8

CONFIG = "config.yaml"
PARAMS = "params"


def is_native(path: Path) -> bool:
    return (path / CONFIG).is_file() and (path / PARAMS).is_dir()


def save(config: ModelConfig, params: Params, path: Path) -> None:
    """Writes into the existing empty directory `path`."""
    (path / CONFIG).write_text(yaml.safe_dump({"model": config.to_dict()}, sort_keys=False))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((path / PARAMS).absolute(), params)
    checkpointer.wait_until_finished()


def read_config(path: Path) -> ModelConfig:
    """The model section of `path`'s config.yaml (a training run's workdir keeps one too)."""
    try:
        return load_model_config(path / CONFIG)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def load(path: Path, loading: Loading,
         placement: Placement | None = None) -> tuple[ModelConfig, Params]:
    config = read_config(path)
    params_dir = (path / PARAMS).absolute()
    try:
        stored = ocp.StandardCheckpointer().metadata(params_dir).item_metadata.tree
    except Exception as e:  # orbax raises several types for missing or corrupt metadata
        raise CheckpointError(f"{params_dir}: not a readable orbax checkpoint: {e}") from None
    return restore(params_dir, stored, config, loading, placement, path / CONFIG)


def restore(params_dir: Path, stored, config: ModelConfig, loading: Loading,
            placement: Placement | None, config_file: Path) -> tuple[ModelConfig, Params]:
    """The model of `config` (the checkpoint's, read from `config_file`) from the orbax
    directory `params_dir`, whose metadata tree is `stored`, loaded as `loading` asks. Weights
    to quantize that the checkpoint holds in float are restored one at a time to the host and
    quantized there, so the float model is never held whole."""
    old = is_legacy(stored)
    as_stored = loading.in_dtype(config, _float_dtype(config, stored, old))
    target = placed_target(as_stored, placement)
    if old:  # written before the component tree: restore, then move leaves to their paths
        target = legacy_target(target)
    expected = {k: tuple(a.shape) for k, a in flat_paths(target).items()}
    found = {k: tuple(m.shape) for k, m in flat_paths(stored).items()}
    if expected != found:
        raise CheckpointError(f"{params_dir}: stored tensors {found} do not match the model of "
                              f"{config_file}: {expected}")
    loaded = loading.config(config, as_stored.param_dtype, config_file)
    if old:
        params = from_legacy(as_stored, ocp.StandardCheckpointer().restore(params_dir, target))
        return loaded, quantize_params(as_stored, params, loaded.quantize,
                                       loaded.quantize_head)[1] if loaded.quantize else params
    return loaded, _restore_quantizing(params_dir, as_stored, loaded, placement)


def _float_dtype(config: ModelConfig, stored, old: bool) -> str:
    """The dtype of the checkpoint's float parameters (the first one not stored as int8)."""
    if old:
        return str(stored["embed"].dtype)
    found = flat_paths(stored)
    return next(str(found[path].dtype) for path, spec in flat_paths(param_specs(config)).items()
                if spec.dtype is None)


def _restore_quantizing(params_dir: Path, as_stored: ModelConfig, loaded: ModelConfig,
                        placement: Placement | None) -> Params:
    """Restores every tensor stored as `loaded` keeps it in one call; each one `loaded`
    quantizes in a call of its own (the others skipped: orbax's PLACEHOLDER) to the host,
    where it is quantized (`loading.build_leaf`) and moved into its shardings."""
    abstract = placed_target(as_stored, placement)
    stored_target, treedef = flat_paths(abstract), jax.tree.structure(abstract)
    specs = flat_paths(param_specs(loaded))
    to_quantize = [path for path, spec in specs.items()
                   if spec.dtype == "int8" and path in stored_target]

    def restored(on_device, on_host=()) -> dict:
        def args(path, a):
            if path in on_host:
                return ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype)
            if path in on_device:
                return ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape,
                                            dtype=a.dtype)
            return ocp.PLACEHOLDER
        item = {path: a if path in on_device or path in on_host else ocp.PLACEHOLDER
                for path, a in stored_target.items()}
        tree = ocp.PyTreeCheckpointer().restore(params_dir, args=ocp.args.PyTreeRestore(
            item=jax.tree.unflatten(treedef, list(item.values())),
            restore_args=jax.tree.unflatten(treedef, [args(p, a) for p, a in item.items()])))
        return flat_paths(tree)

    leaves = restored([path for path in stored_target if path not in to_quantize])
    target = flat_paths(placed_target(loaded, placement))
    dtype = np.dtype(as_stored.param_dtype)
    for path in to_quantize:
        whole = specs[path].shape  # the leaf is its only piece
        q = put(build_leaf(specs[path], whole, [restored((), [path])[path]], dtype),
                Int8(target[path + "/values"].sharding, target[path + "/scale"].sharding))
        leaves[path + "/values"], leaves[path + "/scale"] = q.values, q.scale
    return unflatten(loaded, {path: Int8(leaves[path + "/values"], leaves[path + "/scale"])
                              if spec.dtype == "int8" else leaves[path]
                              for path, spec in specs.items()})
