"""A training run's workdir (see `llama_jax.formats.workdir`): the parameters of its latest complete
checkpoint, with the model section of its config.yaml."""

from __future__ import annotations

from pathlib import Path

from llama_jax.formats import workdir
from llama_jax.config import ModelConfig, TrainConfig, load_model_config
from llama_jax.errors import CheckpointError, ConfigError
from llama_jax.formats import native
from llama_jax.formats.layout import Loading, Placement
from llama_jax.model.params import Params


def is_run(path: Path) -> bool:
    return workdir.is_workdir(path)


def load(path: Path, loading: Loading,
         placement: Placement | None = None) -> tuple[ModelConfig, Params]:
    try:
        config = load_model_config(path / workdir.CONFIG)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    checkpoints = workdir.Checkpoints(path, TrainConfig(), create=False)
    try:
        step = checkpoints.latest_step()
        if step is None:
            raise CheckpointError(f"{path}: a training run without a complete checkpoint yet")
        params_dir = checkpoints.params_dir(step)
        stored = checkpoints.stored_params(step)
    finally:
        checkpoints.close()
    try:  # onto the placement, whatever mesh the run was saved from
        return native.restore(params_dir, stored, config, loading, placement,
                              path / workdir.CONFIG)
    except (ValueError, KeyError) as e:  # orbax: stored tree or shapes differ from the config
        raise CheckpointError(f"{path}: checkpoint {step} does not match its config.yaml: "
                              f"{e}") from None
