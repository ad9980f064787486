"""Fine-tuning runs: a run config with a `task:` section (the head and the data, tasks.py) and
`init_from: CHECKPOINT` (ours, a training run, Hugging Face or Meta).

    init_from: runs/demo
    task: {kind: sequence_classification, train: docs.jsonl, labels: [a, b, c]}
    train: {freeze: backbone, ...}

The model is the checkpoint's: its `model:` section may only change how it runs (dtypes,
remat, attention implementation), the pad id and the new head's `init_std`, and the task puts
its head in place of the checkpoint's. A checkpoint that already has this task's head (the
same kind and output count) continues with it; one with another task head is refused. The
tokenizer is `data.tokenizer` or the checkpoint's `tokenizer.model`; the pad id defaults to its
first end-of-sequence id, which encoding text never produces.

`train.freeze: backbone` trains the head alone: the optimizer zeroes every other update
(`optim.make_optimizer`), so the backbone stays bit-identical, and the loss stops gradients at
the final hidden states, so the backbone's backward pass is not computed at all.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Sequence

import jax

from llama_jax.formats import peft
from llama_jax.formats.checkpoint import (checkpoint_config, detect_format, load_checkpoint,
                                          lora_base)
from llama_jax.config import ModelConfig, RunConfig, load_run_tree
from llama_jax.config.run import CHAT
from llama_jax.errors import CheckpointError, ConfigError
from llama_jax.nn.heads import head_specs, is_task_head
from llama_jax.model.params import Params, init_tensors
from llama_jax.data.tokenizer import TOKENIZER_FILE, Tokenizer, has_tokenizer, load_tokenizer

HEAD_FIELDS = ("head", "n_labels", "pooling", "label_names")
# what a fine-tuning run's `model:` section may change of its checkpoint's model, beside the
# execution settings and init-only fields (init_std: the new head's)
CHANGEABLE = ("pad_id", "eos_ids")


def load_run_config(name_or_path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """A run config file or preset with `SECTION.KEY=VALUE` overrides (`config.load_run_tree`),
    its model taken from its `init_from` checkpoint when it has one, and a task's pad id
    defaulted from the run's tokenizer (a task head's: chat trains the LM head)."""
    tree, path = load_run_tree(name_or_path, overrides)
    where = str(path)
    if isinstance(tree.get("init_from"), str):  # "~/..." is the user's home, as in a shell
        tree = {**tree, "init_from": os.path.expanduser(tree["init_from"])}
    if tree.get("init_from") is not None:
        tree = {**tree, "model": _checkpoint_model(tree, where)}
    task = tree.get("task") or {}
    if task and task.get("kind") != CHAT and (tree.get("model") or {}).get("pad_id") is None:
        tokenizer = run_tokenizer(tree.get("data") or {}, tree.get("init_from"), where)
        tree = {**tree, "model": {**(tree.get("model") or {}), "pad_id": tokenizer.eos_ids[0]}}
    return RunConfig.from_tree(tree, where)


def _checkpoint_model(tree: dict[str, Any], where: str) -> dict[str, Any]:
    """The model section of a run with `init_from`: the checkpoint's model, with the run's
    execution settings; its head must be the LM head or the task's."""
    source = tree["init_from"]
    try:
        base = checkpoint_config(source)
    except CheckpointError as e:
        raise ConfigError(f"{where}: init_from {source!r}: {e}") from None
    given = dict(tree.get("model") or {})
    roles = {f.name: f.metadata.get("role") for f in dataclasses.fields(ModelConfig)}
    known = base.to_dict()
    for name, value in given.items():
        if roles.get(name) in ("execution", "init") or name in CHANGEABLE:
            continue
        if name in HEAD_FIELDS:
            raise ConfigError(f"{where}: model.{name}: the task section sets the head; remove it")
        if name not in roles:
            raise ConfigError(f"{where}: model: unknown key {name!r}")
        if known.get(name) != value:
            raise ConfigError(f"{where}: model.{name}={value!r}, but the init_from checkpoint "
                              f"{source} has {known.get(name)!r}: a fine-tuned model keeps its "
                              "checkpoint's architecture (only execution settings and pad_id "
                              "may change)")
    task = tree.get("task") or {}
    if is_task_head(base) and isinstance(task, dict):
        _check_head(base, task, source, where)
    return {**{k: v for k, v in known.items() if k not in HEAD_FIELDS}, **given}


def _check_head(base: ModelConfig, task: dict[str, Any], source: str, where: str) -> None:
    """A checkpoint with a task head continues with it: the task must be of the same kind and
    output count."""
    labels = task.get("labels", 1)
    n_labels = len(labels) if isinstance(labels, (list, tuple)) else labels
    if (task.get("kind"), n_labels) != (base.head, base.n_labels):
        raise ConfigError(
            f"{where}: task {task.get('kind')!r} with {n_labels} output(s) does not match the "
            f"head of init_from {source} ({base.head!r} with {base.n_labels} output(s)); "
            "start from a checkpoint with the LM head, or give the task that head's kind and "
            "labels")


def model_files(init_from: str | None) -> list[str]:
    """Where a fine-tuning run looks for its checkpoint's tokenizer and chat template, in
    order: init_from, then (a PEFT adapter's) its base."""
    if init_from is None:
        return []
    return list(dict.fromkeys([init_from, lora_base(init_from)]))


def run_tokenizer(data: dict[str, Any], init_from: str | None, where: str) -> Tokenizer:
    """A task run's tokenizer: `data.tokenizer`, else the init_from checkpoint's (a tokenizer
    file in its directory, or a GGUF file's vocabulary)."""
    source = data.get("tokenizer") or next(
        (p for p in model_files(init_from) if has_tokenizer(p)), None)
    if source is None:
        raise ConfigError(f"{where}: a task run needs a tokenizer: set data.tokenizer (or "
                          f"init_from a checkpoint that has {TOKENIZER_FILE} or "
                          "tokenizer.json)")
    try:
        return load_tokenizer(source)
    except CheckpointError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_base(run: RunConfig, mesh: jax.sharding.Mesh) -> Params:
    """A LoRA run's frozen base: its init_from checkpoint in `model.param_dtype`, int8 where
    `model.quantize` says (quantized as it is read: QLoRA's base), placed on `mesh`."""
    _, loaded = load_checkpoint(lora_base(run.init_from), run.model.param_dtype,
                                quantize=run.model.quantize, mesh=mesh, mesh_config=run.mesh)
    return loaded


def initial_adapters(run: RunConfig) -> dict | None:
    """The adapters a LoRA run starts from when its init_from is a PEFT adapter (`{path:
    {"a", "b"}}` on the host), else None (fresh ones). The adapter's rank, alpha and targets
    must be the `lora:` section's."""
    if detect_format(run.init_from) != "peft":
        return None
    try:
        settings, adapters = peft.load(Path(run.init_from), run.model)
    except CheckpointError as e:
        raise ConfigError(f"init_from {run.init_from}: {e}") from None
    for name, theirs, ours in (("rank", settings.rank, run.lora.rank),
                               ("alpha", settings.alpha, run.lora.alpha),
                               ("targets", sorted(settings.targets), sorted(run.lora.targets))):
        if theirs != ours:
            raise ConfigError(f"lora.{name}={ours!r}, but the init_from PEFT adapter "
                              f"{run.init_from} has {theirs!r}: a run continues an adapter "
                              "with its shape (set the lora section to match)")
    return adapters


def initial_params(run: RunConfig, key: jax.Array, shardings: Params,
                   mesh: jax.sharding.Mesh) -> Params:
    """The parameters a fine-tuning run starts from, placed on `shardings`: the init_from
    checkpoint's backbone (and its head, when it is already this task's) and a freshly
    initialised head otherwise. Only what is not loaded is initialised: no second copy of the
    model exists at any time."""
    _, loaded = load_checkpoint(run.init_from, run.model.param_dtype, mesh=mesh,
                                mesh_config=run.mesh)
    params = {name: loaded[name] for name in shardings if name in loaded}
    if "head" in shardings and "head" not in params:  # a tied LM head has none of its own
        init_head = jax.jit(lambda k: init_tensors(run.model, head_specs(run.model)["head"], k),
                            out_shardings=shardings["head"])
        params["head"] = init_head(key)
    return params
