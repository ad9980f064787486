"""llama_jax's own checkpoint: `config.yaml` (the model section) + `params/` (an orbax
checkpoint of the parameter tree). Orbax restores straight into the requested dtype (and, with
target shardings, onto any mesh). Checkpoints in the layout before the component tree load
through formats/legacy.py."""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp
import yaml

from llama_jax.config import ModelConfig, load_model_config
from llama_jax.errors import CheckpointError, ConfigError
from llama_jax.formats.layout import Placement, placed_target, with_dtype
from llama_jax.formats.legacy import from_legacy, is_legacy, legacy_target
from llama_jax.model.params import Params, flat_paths

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


def load(path: Path, dtype: str | None,
         placement: Placement | None = None) -> tuple[ModelConfig, Params]:
    try:
        config = load_model_config(path / CONFIG)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    checkpointer = ocp.StandardCheckpointer()
    params_dir = (path / PARAMS).absolute()
    try:
        stored = checkpointer.metadata(params_dir).item_metadata.tree
    except Exception as e:  # orbax raises several types for missing or corrupt metadata
        raise CheckpointError(f"{params_dir}: not a readable orbax checkpoint: {e}") from None
    old = is_legacy(stored)
    first = flat_paths(stored)["embed" if old else "embed/table"]
    config = with_dtype(config, dtype or str(first.dtype))
    target = placed_target(config, placement)
    if old:  # written before the component tree: restore, then move leaves to their paths
        target = legacy_target(target)
    expected = {k: tuple(a.shape) for k, a in flat_paths(target).items()}
    found = {k: tuple(m.shape) for k, m in flat_paths(stored).items()}
    if expected != found:
        raise CheckpointError(f"{params_dir}: stored tensors {found} do not match the model of "
                              f"{path / CONFIG}: {expected}")
    restored = checkpointer.restore(params_dir, target)
    return config, from_legacy(config, restored) if old else restored
