"""A training run's directory, and its checkpoints.

    WORKDIR/config.yaml        the resolved run config (model, train, data, mesh)
    WORKDIR/tokenizer.model    the run's tokenizer (trained or copied there)
    WORKDIR/checkpoints/STEP/  orbax CheckpointManager steps: params/, opt_state/,
                               data_state/ (the data position: the next batch's index)
    WORKDIR/metrics.jsonl      one JSON object per step
    WORKDIR/tensorboard/       event files

A workdir belongs to one run: rerunning with the same config resumes from the latest
checkpoint, and a different config (other than the bookkeeping fields of
`TrainConfig.RESUMABLE_CHANGES`) is refused before anything is written. Orbax writes each step
into a temporary directory and renames it when complete, so a crash while saving leaves the
previous checkpoints as they were; `latest_step` only sees complete ones.

`load_checkpoint(WORKDIR)` reads the latest step's parameters (`load`), with the model section
of config.yaml, so `sample.py --checkpoint WORKDIR` samples from a run directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml

from llama_jax.config import ModelConfig, RunConfig, TrainConfig
from llama_jax.config.loading import read_yaml_mapping
from llama_jax.errors import CheckpointError, ConfigError
from llama_jax.files import write_atomically
from llama_jax.formats import native
from llama_jax.formats.loading import Loading, Placement
from llama_jax.model.params import Params

CONFIG = "config.yaml"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"


def is_workdir(path: Path) -> bool:
    return (path / CONFIG).is_file() and (path / CHECKPOINTS).is_dir()


def claim(workdir: Path, run: RunConfig) -> None:
    """Makes `workdir` this run's (`check_claim`, then config.yaml written)."""
    check_claim(workdir, run)
    workdir.mkdir(parents=True, exist_ok=True)
    write_atomically(workdir / CONFIG, yaml.safe_dump(run.to_dict(), sort_keys=False))


def check_claim(workdir: Path, run: RunConfig) -> None:
    """Refuses a workdir whose checkpoints belong to another run, writing nothing (a run
    checks this before reading its data, and claims the workdir once the data is read). A
    config.yaml without checkpoints is from a run that never got going: it is replaced."""
    stored_path = workdir / CONFIG
    checkpoints = workdir / CHECKPOINTS
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        if not stored_path.is_file():
            raise ConfigError(f"{workdir} has checkpoints but no {CONFIG}: not a llama_jax run "
                              "directory; use another --workdir")
        try:
            stored = run_config(workdir)
        except ConfigError as e:
            raise ConfigError(f"{workdir} holds an unreadable run config: {e}") from None
        differences = config_differences(stored, run)
        if differences:
            raise ConfigError(
                f"{workdir} holds checkpoints of a run with a different config "
                f"({'; '.join(differences)}); they would not continue this run. Resume with "
                "the same config or use another --workdir")


def config_differences(stored: RunConfig, new: RunConfig) -> list[str]:
    """`section.field: stored -> new` for every field that changes the run's trajectory. The
    mesh and the model's execution settings (dtypes, remat, scan) may change: checkpoints
    restore onto any mesh and into any dtype; so may init-only model fields (`init_std`)."""
    out = []
    old_tree, new_tree = stored.to_dict(), new.to_dict()
    old_tree["model"], new_tree["model"] = stored.model.architecture(), new.model.architecture()
    for section in dict.fromkeys([*old_tree, *new_tree]):
        old, new_value = old_tree.get(section), new_tree.get(section)
        if section == "mesh" or old == new_value:
            continue
        if not isinstance(old, dict) or not isinstance(new_value, dict):  # init_from, task
            out.append(f"{section}: {old!r} -> {new_value!r}")
            continue
        for name in dict.fromkeys([*old, *new_value]):
            before, value = old.get(name), new_value.get(name)
            if before != value and not (section == "train"
                                        and name in TrainConfig.RESUMABLE_CHANGES):
                out.append(f"{section}.{name}: {before!r} -> {value!r}")
    return out


class Checkpoints:
    """Asynchronous orbax checkpoints of (params, optimizer state, data position). The step is
    the checkpoint's own number; the non-finite counters live in the optimizer state.

    The data position is the batch iterator's state (`data/batches.py`: the next global
    batch's index), the same in every process and for any process count, so it is saved once
    (`data_state`, JSON) and a run resumes with any number of processes. Checkpoints written
    before this kept it per process (`data/process_I-of-N.json`, grain's own handler); they
    are read too, whatever the process count now."""

    def __init__(self, workdir: Path, train: TrainConfig, create: bool = True):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=train.keep_checkpoints, create=create, enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager((workdir / CHECKPOINTS).absolute(), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: Any, opt_state: Any,
             iterator: grain.DatasetIterator) -> None:
        """Starts writing step `step`; returns once the arrays are copied off the device."""
        self.manager.save(step, force=True, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
            data_state=ocp.args.JsonSave(iterator.get_state())))

    def restore(self, step: int, abstract_params: Any, abstract_opt_state: Any,
                iterator: grain.DatasetIterator) -> tuple[Any, Any]:
        """(params, opt_state) of `step`; `iterator` is moved to its saved position."""
        items = dict(params=ocp.args.StandardRestore(abstract_params),
                     opt_state=ocp.args.StandardRestore(abstract_opt_state))
        legacy = self._legacy_data_state(step)
        if legacy is None:
            items["data_state"] = ocp.args.JsonRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        iterator.set_state(restored.data_state if legacy is None else legacy)
        return restored.params, restored.opt_state

    def _legacy_data_state(self, step: int) -> dict | None:
        """The data position of a checkpoint written by grain's per-process handler, if this
        is one: any process's file (they all hold the same position)."""
        files = sorted((Path(self.manager.directory) / str(step) / "data").glob(
            "process_*-of-*.json"))
        return json.loads(files[0].read_text()) if files else None
    def params_dir(self, step: int) -> Path:
        """The orbax directory of the parameters saved at `step`."""
        return Path(self.manager.directory) / str(step) / "params"

    def stored_params(self, step: int) -> Any:
        """The metadata tree (shapes and dtypes) of the parameters saved at `step`."""
        # The handler reads the item's own metadata (a Checkpointer would look for a
        # step-level file that CheckpointManager keeps one level up, and warn).
        return ocp.StandardCheckpointHandler().metadata(self.params_dir(step)).tree

    def close(self) -> None:
        """Waits for the write in flight, then releases the manager."""
        self.manager.wait_until_finished()
        self.manager.close()


def run_config(workdir: Path) -> RunConfig:
    path = workdir / CONFIG
    return RunConfig.from_tree(read_yaml_mapping(path, "run config"), str(path))


def is_lora_run(path: Path) -> bool:
    """Whether the run in `path` trains LoRA adapters: its checkpoints hold them, not a model
    (`load_checkpoint` merges them into their base)."""
    return read_yaml_mapping(path / CONFIG, "run config").get("lora") is not None


def latest_checkpoint(path: Path) -> tuple[int, Path, Any]:
    """(step, params directory, the stored tree's metadata) of the run's latest complete
    checkpoint."""
    checkpoints = Checkpoints(path, TrainConfig(), create=False)
    try:
        step = checkpoints.latest_step()
        if step is None:
            raise CheckpointError(f"{path}: a training run without a complete checkpoint yet")
        return step, checkpoints.params_dir(step), checkpoints.stored_params(step)
    finally:
        checkpoints.close()


def load(path: Path, loading: Loading,
         placement: Placement | None = None) -> tuple[ModelConfig, Params]:
    """The parameters of the run's latest complete checkpoint, with the model section of its
    config.yaml."""
    config = native.read_config(path)
    step, params_dir, stored = latest_checkpoint(path)
    try:  # onto the placement, whatever mesh the run was saved from
        return native.restore(params_dir, stored, config, loading, placement, path / CONFIG)
    except (ValueError, KeyError) as e:  # orbax: stored tree or shapes differ from the config
        raise CheckpointError(f"{path}: checkpoint {step} does not match its config.yaml: "
                              f"{e}") from None


def load_adapters(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """A LoRA run's adapters (`{path: {"a", "b"}}`, nn/lora.py) from its latest complete
    checkpoint, on the host."""
    _, params_dir, stored = latest_checkpoint(path)
    as_host = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray, dtype=m.dtype),
                           stored)
    return ocp.PyTreeCheckpointer().restore(params_dir, args=ocp.args.PyTreeRestore(
        item=stored, restore_args=as_host))
