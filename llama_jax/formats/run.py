"""A training run's workdir (see `llama_jax.formats.workdir`): the parameters of its latest complete
checkpoint, with the model section of its config.yaml."""

from __future__ import annotations

from pathlib import Path

from llama_jax.formats import workdir
from llama_jax.config import ModelConfig, TrainConfig, load_model_config
from llama_jax.errors import CheckpointError, ConfigError
from llama_jax.formats.layout import Placement, placed_target, with_dtype
from llama_jax.formats.legacy import from_legacy, is_legacy, legacy_target
from llama_jax.model.params import Params


def is_run(path: Path) -> bool:
    return workdir.is_workdir(path)


def load(path: Path, dtype: str | None,
         placement: Placement | None = None) -> tuple[ModelConfig, Params]:
    try:
        config = load_model_config(path / workdir.CONFIG)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    checkpoints = workdir.Checkpoints(path, TrainConfig(), create=False)
    step = checkpoints.latest_step()
    if step is None:
        raise CheckpointError(f"{path}: a training run without a complete checkpoint yet")
    config = with_dtype(config, dtype or config.param_dtype)
    target = placed_target(config, placement)
    try:  # onto the placement, whatever mesh the run was saved from
        if is_legacy(checkpoints.stored_params(step)):  # the layout before the component tree
            params = from_legacy(config, checkpoints.restore_params(step, legacy_target(target)))
        else:
            params = checkpoints.restore_params(step, target)
    except (ValueError, KeyError) as e:  # orbax: stored tree or shapes differ from the config
        raise CheckpointError(f"{path}: checkpoint {step} does not match its config.yaml: "
                              f"{e}") from None
    finally:
        checkpoints.close()
    return config, params
