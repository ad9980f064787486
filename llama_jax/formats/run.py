"""A training run's workdir (see `llama_jax.workdir`): the parameters of its latest complete
checkpoint, with the model section of its config.yaml."""

from __future__ import annotations

from pathlib import Path

from llama_jax import workdir
from llama_jax.config import ConfigError, ModelConfig, TrainConfig, load_model_config
from llama_jax.formats import CheckpointError
from llama_jax.formats.layout import Placement, placed_target, with_dtype
from llama_jax.params import Params


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
    try:  # onto the placement, whatever mesh the run was saved from
        params = checkpoints.restore_params(step, placed_target(config, placement))
    except (ValueError, KeyError) as e:  # orbax: stored tree or shapes differ from the config
        raise CheckpointError(f"{path}: checkpoint {step} does not match its config.yaml: "
                              f"{e}") from None
    finally:
        checkpoints.close()
    return config, params
