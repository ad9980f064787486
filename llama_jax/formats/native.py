"""llama_jax's own checkpoint: `config.yaml` (the model section) + `params/` (an orbax
checkpoint of the Params pytree). Orbax restores straight into the requested dtype (and, with
target shardings, onto any mesh)."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
import yaml

from llama_jax.config import ConfigError, ModelConfig, load_model_config
from llama_jax.costs import abstract_params
from llama_jax.formats import CheckpointError
from llama_jax.formats.layout import Placement, placed_target, with_dtype
from llama_jax.params import Params

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
    config = with_dtype(config, dtype or str(stored["embed"].dtype))
    target = abstract_params(config)
    expected = jax.tree.map(lambda a: tuple(a.shape), target)
    found = jax.tree.map(lambda m: tuple(m.shape), Params(**_as_params_tree(stored)))
    if jax.tree.structure(expected) != jax.tree.structure(found) or expected != found:
        raise CheckpointError(f"{params_dir}: stored shapes {found} do not match "
                              f"{path / CONFIG} {expected}")
    return config, checkpointer.restore(params_dir, placed_target(config, placement))


def _as_params_tree(stored: dict) -> dict:
    from llama_jax.params import LayerParams

    return {**stored, "layers": LayerParams(**stored["layers"]), "lm_head": stored.get("lm_head")}
