"""The training loop: data, state, checkpoints, metrics and signals around `training.train_step`.

Order of work, so that every mistake in the input surfaces before anything is compiled: check
the config against the devices and the workdir (refusing one that holds another run's
checkpoints), find and tokenize the corpus, claim the workdir (write its config.yaml: bad data
leaves none), then compile the step ahead of time (its compile time is reported on its own),
restore the latest checkpoint if there is one, and train.

Everything runs on the mesh of the config's `mesh:` section (`parallel/sharding.py`): the state is
created already sharded by the weight rules (optimizer moments like their parameters), the step
is compiled with explicit in/out shardings and the state donated, and each batch is laid out
over the batch rule's mesh axes (data x fsdp by default).

Stopping: at `train.steps`, at `stop_at`, or on SIGTERM / SIGINT, the loop finishes the step in
flight, writes a checkpoint and returns. Non-finite steps are skipped by the optimizer; after
`train.max_nonfinite` of them in a row the run stops with `TrainingError`, without saving
(the last checkpoint holds finite parameters from before the trouble).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from tqdm import tqdm

from llama_jax.plan import costs, hardware
from llama_jax.data import batches, chat_rows, conversations, tasks as task_data
from llama_jax.data.chat_template import CHAT_TEMPLATE_FILE
from llama_jax.data.corpus import corpus_tokenizer, corpus_tokens, unigram_entropy
from llama_jax.data.tokenizer import save_tokenizer
from llama_jax.training import finetune, tasks
from llama_jax.parallel import sharding, target
from llama_jax.formats import workdir as run_dir
from llama_jax.config import RunConfig, TaskConfig
from llama_jax.config.run import CHAT
from llama_jax.files import write_atomically
from llama_jax.errors import ConfigError, TrainingError
from llama_jax.formats.legacy import is_legacy
from llama_jax.model.params import abstract_params, param_specs
from llama_jax.nn.lora import init_from_specs
from llama_jax.spec import map_specs
from llama_jax.training.metrics import MetricsLog
from llama_jax.nn.attention.dot_product import chosen_attention, describe_attention
from llama_jax.nn.heads import is_task_head, task_metrics
from llama_jax.training.optim import learning_rate_schedule, make_optimizer
from llama_jax.model.transformer import aux_metrics
from llama_jax.training.step import TrainState, eval_sums, init_state, objective, train_step

# The validation tokens whose unigram entropy is reported (the first ones): enough for a
# baseline, and a start-up that does not read a large dataset's whole split.
UNIGRAM_TOKENS = 1 << 24


@dataclasses.dataclass
class Outcome:
    step: int  # the last step taken (and checkpointed)
    stopped_by: str | None = None  # "SIGTERM", "SIGINT", "stop_at"; None when the run finished
    val_loss: float | None = None  # the last evaluation
    val_unigram_entropy: float = 0.0  # nats/token: the validation loss of a context-free model
    compile_s: float = 0.0
    tokens_per_s: float = 0.0  # over the whole run, compile excluded
    peak_memory_bytes: int | None = None  # per device: see `_peak_memory`
    val_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the last eval
    # a fine-tuning run that starts (not resumes): its checkpoint's validation metrics
    val_metrics_before: dict[str, float] = dataclasses.field(default_factory=dict)


def check_run(run: RunConfig, mesh: jax.sharding.Mesh) -> None:
    """Config errors that only show against the mesh, its platform or across sections."""
    model, train = run.model, run.train
    if run.task is None and is_task_head(model):
        raise ConfigError(f"model.head={model.head!r} needs a `task:` section (language "
                          "modelling trains the LM head)")
    if run.task is None and train.freeze != "none":
        raise ConfigError(f"train.freeze={train.freeze!r} needs a `task:` section (it trains "
                          "a task head alone)")
    chosen_attention(model, target.platform_name(mesh.devices.flat[0]))
    if model.quantize is not None and run.lora is None:
        raise ConfigError(f"model.quantize={model.quantize!r} is for inference, or for a LoRA "
                          "run's frozen base: training updates float weights (train or "
                          "fine-tune from the float checkpoint, and quantize when loading it "
                          "to decode)")
    if run.lora is not None:  # the targets (and a PEFT start's) are named before any writing
        costs.run_adapter_specs(run)
        finetune.initial_adapters(run)
    if train.seq_len > model.max_seq_len:
        raise ConfigError(f"train.seq_len={train.seq_len} exceeds the model's context "
                          f"(model.max_seq_len={model.max_seq_len})")
    micro = train.batch_size // train.micro_batches
    batch_ways = sharding.batch_shards(run.mesh, mesh.shape)
    if micro % batch_ways:
        raise ConfigError(f"train.batch_size={train.batch_size} / train.micro_batches="
                          f"{train.micro_batches} = {micro} sequences per micro-batch do not "
                          f"split across the {batch_ways} batch shards of mesh "
                          f"{dict(mesh.shape)}")


def train(run: RunConfig, workdir: Path, *, stop_at: int | None = None,
          log: Callable[[str], None] = print, progress: bool = True) -> Outcome:
    """Trains (or resumes) the run in `workdir` up to `train.steps` (or `stop_at`)."""
    model, train_cfg = run.model, run.train
    devices = jax.devices()
    local = jax.local_devices()[0]  # memory statistics: another process's device has none here
    mesh = sharding.make_mesh(run.mesh, devices)
    check_run(run, mesh)
    run_dir.check_claim(workdir, run)
    log(describe_attention(model, train_cfg.seq_len, target.platform_name(devices[0])))

    source = (_corpus_data if run.task is None else
              _chat_data if run.task.kind == CHAT else _task_data)(run, workdir, log)
    run_dir.claim(workdir, run)  # once the data is read: bad data leaves no config behind
    iterator, val = source.train, source.val

    checkpoints = run_dir.Checkpoints(workdir, train_cfg)
    start = checkpoints.latest_step() or 0
    end = min(train_cfg.steps, stop_at or train_cfg.steps)
    if start >= end:
        checkpoints.close()
        log(f"nothing to do: the latest checkpoint is at step {start}, the run ends at {end}")
        return Outcome(step=start)
    if start:
        _check_resumable(checkpoints, start, workdir)

    programs = compile_programs(run, source.bos_id, mesh)
    batch_sharding, compile_s = programs.batch_sharding, programs.compile_s
    # a LoRA run's frozen base: read from init_from whether the run starts or resumes
    frozen = () if run.lora is None else (finetune.load_base(run, mesh),)
    state = _first_state(run, programs, checkpoints, start, iterator, workdir, log)

    metrics = MetricsLog(workdir / run_dir.METRICS, workdir / run_dir.TENSORBOARD, start)
    outcome = Outcome(step=start, compile_s=compile_s,
                      val_unigram_entropy=source.val_unigram_entropy)
    validate = functools.partial(_validation, groups=val, sharding=batch_sharding,
                                 task=run.task, frozen=frozen)
    if run.init_from is not None and not start:  # what fine-tuning starts from
        outcome.val_metrics_before = validate(functools.partial(programs.evaluate,
                                                                state.params))
        log("before training: " + _described(outcome.val_metrics_before, run.task))
    log(f"step compiled in {compile_s:.1f} s ({_mib(programs.step_bytes)} per device); "
        f"training steps {start + 1}..{end} of "
        f"{train_cfg.steps} on {len(devices)} {devices[0].platform} device(s), mesh "
        f"{dict(mesh.shape)}")

    bar = tqdm(total=train_cfg.steps, initial=start, disable=not progress or
               jax.process_index() != 0, dynamic_ncols=True, unit="step")
    say = bar.write if not bar.disable else log
    window = _Window.of(run, len(devices), functools.partial(_peak_memory, local,
                                                              programs.step_bytes))
    run_start = window.start
    try:
        with _stop_signals() as received:
            for step in range(start + 1, end + 1):
                batch = _on_devices(batch_sharding, next(iterator))
                state, step_metrics = programs.step(state, batch, *frozen)
                values = jax.device_get(step_metrics)
                window.steps += 1
                record = {"loss": values["loss"]}
                _check_nonfinite(step, values, train_cfg.max_nonfinite, checkpoints)
                if step % train_cfg.log_every == 0 or step == end:
                    record.update(window.close(step, values))
                    bar.set_postfix(loss=f"{values['loss']:.3f}",
                                    tok_s=f"{record['tokens_per_s']:.0f}",
                                    mfu=f"{record['mfu']:.0%}", refresh=False)
                with window.paused():
                    if step % train_cfg.eval_every == 0 or step == train_cfg.steps:
                        val_metrics = validate(functools.partial(programs.evaluate,
                                                                 state.params))
                        outcome.val_loss = val_metrics["val_loss"]
                        outcome.val_metrics = val_metrics
                        record.update(val_metrics)
                        say(f"step {step}: " + _described(val_metrics, run.task))
                    metrics.write(step, record)
                    bar.update(1)
                    outcome.step = step
                    stopping = received or (["stop_at"] if step == end < train_cfg.steps else [])
                    if stopping or step % train_cfg.checkpoint_every == 0 or step == end:
                        _save(checkpoints, step, state, iterator)
                if stopping:
                    outcome.stopped_by = stopping[0]
                    log(f"stopped by {stopping[0]} after step {step}; checkpoint saved, "
                        "rerun the same command to resume")
                    break
        outcome.tokens_per_s = (outcome.step - start) * window.tokens_per_step / (
            time.perf_counter() - run_start)
        outcome.peak_memory_bytes = _peak_memory(local, programs.step_bytes)
    finally:
        bar.close()
        checkpoints.close()
        metrics.close()
    return outcome


def _first_state(run: RunConfig, programs: Programs, checkpoints: run_dir.Checkpoints,
                 start: int, iterator: Iterator, workdir: Path,
                 log: Callable[[str], None]) -> TrainState:
    """The state step `start + 1` trains: the checkpoint of step `start` (the data iterator
    moved to its position), or at step 0 a fresh or init_from state."""
    if start:
        abstract = programs.abstract
        params, opt_state = checkpoints.restore(start, abstract.params, abstract.opt_state,
                                                iterator)
        log(f"resumed from {workdir / run_dir.CHECKPOINTS / str(start)}")
        return TrainState(step=jnp.asarray(start, jnp.int32), params=params,
                          opt_state=opt_state)
    state = programs.init(jax.random.key(run.train.seed))
    if run.init_from is not None:
        log(f"initialised from {run.init_from}")
    return state


@dataclasses.dataclass
class _Window:
    """The steps since the last logged one, timed without the evaluation and saving between
    them, and the rates and statistics that a logged step adds to its record."""

    tokens_per_step: int
    flops_per_step: float
    peak: float  # FLOP/s of all the devices together
    schedule: Callable[[int], float]  # the learning rate by optimizer step
    memory: Callable[[], int | None]  # the peak memory so far (`_peak_memory`)
    start: float = dataclasses.field(default_factory=time.perf_counter)
    steps: int = 0
    paused_s: float = 0.0

    @classmethod
    def of(cls, run: RunConfig, n_devices: int, memory: Callable[[], int | None]) -> _Window:
        """The first window of `run` on `n_devices`, starting now."""
        train_cfg = run.train
        peak = train_cfg.peak_flops or hardware.peak_flops_per_device(run.model.compute_dtype)
        return cls(train_cfg.batch_size * train_cfg.seq_len, costs.train_flops_per_step(run),
                   peak * n_devices, learning_rate_schedule(train_cfg), memory)

    def close(self, step: int, values: dict) -> dict:
        """What `step` logs over the window (`values`: the step's metrics); the next window
        starts now."""
        elapsed = time.perf_counter() - self.start - self.paused_s
        record = dict(
            lr=self.schedule(step - 1 - int(values["nonfinite_total"])),
            grad_norm=values["grad_norm"],
            tokens_per_s=self.steps * self.tokens_per_step / elapsed,
            mfu=self.steps * self.flops_per_step / elapsed / self.peak,
            nonfinite_total=values["nonfinite_total"],
            **_memory_record(self.memory()),
            **{k: v for k, v in values.items() if k.startswith("moe_")})
        self.start, self.steps, self.paused_s = time.perf_counter(), 0, 0.0
        return record

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A block (evaluation, saving) whose time does not count as training time."""
        since = time.perf_counter()
        yield
        self.paused_s += time.perf_counter() - since


def _save(checkpoints: run_dir.Checkpoints, step: int, state: TrainState,
          iterator: Iterator) -> None:
    if not bool(_all_finite(state.params)):
        raise TrainingError(f"parameters are not finite at step {step}; not saving over "
                            "the last good checkpoint")
    checkpoints.save(step, state.params, state.opt_state, iterator)


def _check_nonfinite(step: int, values: dict, max_nonfinite: int,
                     checkpoints: run_dir.Checkpoints) -> None:
    if values["nonfinite_in_row"] >= max_nonfinite:
        raise TrainingError(
            f"step {step}: the loss or gradients were non-finite for "
            f"{values['nonfinite_in_row']} steps in a row (train.max_nonfinite="
            f"{max_nonfinite}); stopped without saving. Lower train.learning_rate or check "
            f"the data; the last checkpoint ({checkpoints.latest_step()}) is intact")


def _check_resumable(checkpoints: run_dir.Checkpoints, start: int, workdir: Path) -> None:
    """Refuses (closing `checkpoints`) to resume from a checkpoint of the flat layout."""
    if is_legacy(checkpoints.stored_params(start)):
        checkpoints.close()
        raise TrainingError(
            f"{workdir / run_dir.CHECKPOINTS / str(start)} was written by llama_jax 0.1 (flat "
            "`layers` parameter tree): its weights load (load_checkpoint, sample.py), but its "
            "optimizer state cannot resume training in this version. Convert the weights with "
            f"`python -m llama_jax.formats.convert {workdir} NEW_DIR` and start a new run, or "
            "resume with llama_jax 0.1")


@dataclasses.dataclass(frozen=True)
class Programs:
    """A run's compiled programs (`compile_programs`)."""

    init: Callable  # seed key -> TrainState, created sharded
    abstract: TrainState  # shapes, dtypes and shardings of the state
    # (state, batch[, base]) -> (state, metrics), compiled ahead of time, state donated; a LoRA
    # run's frozen base is the third argument
    step: Callable
    evaluate: Callable | None  # (params, batch[, base]) -> (sums: loss_sum, count, ...; aux)
    compile_s: float
    batch_sharding: NamedSharding
    step_bytes: int | None  # XLA's footprint of the step per device; None if not reported


def _footprint(compiled) -> int | None:
    """Bytes a compiled program holds at once per device: its arguments, the outputs that do
    not reuse an argument's buffer (the state is donated), and its temporaries."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes
            - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


def _peak_memory(device, step_bytes: int | None) -> int | None:
    """The allocator's peak so far where the backend counts it (GPU, TPU: everything the
    process holds on the device), else (CPU) the compiled step's footprint."""
    stats = device.memory_stats() or {}
    return stats.get("peak_bytes_in_use", step_bytes)


def _memory_record(peak: int | None) -> dict[str, int]:
    return {} if peak is None else {"peak_memory_bytes": peak}


def _mib(size: int | None) -> str:
    return "size not reported" if size is None else f"{size / 2**20:,.1f} MiB"


@dataclasses.dataclass(frozen=True)
class Initializer:
    """A run's first state, before anything compiles."""

    init: Callable  # seed key -> TrainState, created sharded
    abstract: TrainState  # shapes, dtypes and shardings of the state
    optimizer: optax.GradientTransformation
    params_sharding: Any  # the trained tensors' shardings (a tree like them)
    state_sharding: TrainState
    base: Any = None  # a LoRA run's frozen base: its abstract tensors, sharded; else None


def initializer(run: RunConfig, mesh: jax.sharding.Mesh) -> Initializer:
    """How `run` creates its state on `mesh`: every leaf laid out by the sharding rules. A LoRA
    run's state holds the adapters, placed as their weights are (`lora.adapter_specs`)."""
    specs = param_specs(run.model)
    trained = specs if run.lora is None else costs.run_adapter_specs(run)
    optimizer = make_optimizer(run.model, run.train, trained)
    params_sharding = sharding.param_shardings(trained, mesh, run.mesh)
    abstract_trained = abstract_params(run.model) if run.lora is None else map_specs(
        lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), trained)  # fp32 adapters
    state_sharding = TrainState(
        step=sharding.replicated(mesh), params=params_sharding,
        opt_state=sharding.optimizer_state_shardings(optimizer, abstract_trained,
                                                     params_sharding, mesh))
    if run.lora is None:
        init = jax.jit(functools.partial(init_state, run.model, optimizer),
                       out_shardings=state_sharding)
        base = None
    else:
        init = jax.jit(lambda key: _fresh_state(optimizer, init_from_specs(trained, key)),
                       out_shardings=state_sharding)
        base = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract_params(run.model),
                            sharding.param_shardings(specs, mesh, run.mesh))
    abstract = jax.eval_shape(init, jax.random.key(0))
    if run.init_from is not None:
        init = functools.partial(_init_from_checkpoint, run, optimizer, params_sharding,
                                 state_sharding, mesh) if run.lora is None else \
            functools.partial(_init_adapters, run, init, optimizer, state_sharding)
    return Initializer(init, abstract, optimizer, params_sharding, state_sharding, base)


@dataclasses.dataclass(frozen=True)
class Jitted:
    """A run's programs before they compile (`jitted_programs`): each jitted function with the
    abstract arguments it lowers for."""

    start: Initializer
    step: Callable  # jitted (state, batch[, base]) -> (state, metrics), state donated
    evaluate: Callable  # jitted (params, batch[, base]) -> (sums, aux)
    batch: Any  # the abstract batch (a task's dict of them), sharded
    batch_sharding: NamedSharding

    def lower_step(self) -> jax.stages.Lowered:
        return self.step.lower(self.start.abstract, self.batch, *self.frozen)

    def lower_evaluate(self) -> jax.stages.Lowered:
        return self.evaluate.lower(self.start.abstract.params, self.batch, *self.frozen)

    @property
    def frozen(self) -> tuple:
        """The programs' arguments beyond (state or params, batch): a LoRA run's base."""
        return () if self.start.base is None else (self.start.base,)


def jitted_programs(run: RunConfig, bos_id: int, mesh: jax.sharding.Mesh) -> Jitted:
    """The run's jitted functions with explicit in/out shardings on `mesh` (lower them inside
    `sharding.use_mesh` and `target.compiling_for`, as `compile_programs` does)."""
    start_state = initializer(run, mesh)
    replicated = sharding.replicated(mesh)
    batch_sharding = sharding.batch_sharding(mesh, run.mesh, ndim=1)  # rows of every leaf
    B, T = run.train.batch_size, run.train.seq_len
    if run.task is None:
        batch = jax.ShapeDtypeStruct((B, T + 1), jnp.int32)
    elif run.task.kind == CHAT:
        batch = {name: jax.ShapeDtypeStruct((B, T), dtype)
                 for name, dtype in chat_rows.ROW_FIELDS.items()}
    else:
        batch = tasks.abstract_batch(run)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                        sharding=batch_sharding), batch)
    loss_fn = objective(run, bos_id)
    frozen = () if start_state.base is None else (
        jax.tree.map(lambda a: a.sharding, start_state.base),)
    step = jax.jit(functools.partial(train_step, run.model, run.train, start_state.optimizer,
                                     loss_fn, lora=run.lora),
                   in_shardings=(start_state.state_sharding, batch_sharding, *frozen),
                   out_shardings=(start_state.state_sharding, replicated), donate_argnums=0)
    evaluate = jax.jit(functools.partial(eval_sums, loss_fn, lora=run.lora),
                       in_shardings=(start_state.params_sharding, batch_sharding, *frozen),
                       out_shardings=replicated)
    return Jitted(start_state, step, evaluate, batch, batch_sharding)


@functools.lru_cache(maxsize=4)
def compile_programs(run: RunConfig, bos_id: int, mesh: jax.sharding.Mesh,
                     evaluate: bool = True) -> Programs:
    """The run's jitted functions with explicit in/out shardings, compiled now for the mesh's
    devices (cached per process, so a resumed run in the same process does not compile again).
    Without `evaluate`, the evaluation program is left out (None): what reads only the step
    (its memory, its FLOPs) compiles less."""
    with target.compiling_for(mesh), sharding.use_mesh(mesh, run.mesh):
        # activation constraints are traced in under the mesh
        jitted = jitted_programs(run, bos_id, mesh)
        options = target.compiler_options()
        start = time.perf_counter()
        compiled = jitted.lower_step().compile(options)
        compile_s = time.perf_counter() - start
        evaluator = jitted.lower_evaluate().compile(options) if evaluate else None
    return Programs(init=jitted.start.init, abstract=jitted.start.abstract, step=compiled,
                    evaluate=evaluator, compile_s=compile_s,
                    batch_sharding=jitted.batch_sharding, step_bytes=_footprint(compiled))


def _init_from_checkpoint(run: RunConfig, optimizer, params_sharding, state_sharding,
                          mesh: jax.sharding.Mesh, key: jax.Array) -> TrainState:
    """A fine-tuning run's first state: its init_from checkpoint's parameters with a fresh
    head (finetune.py), and the optimizer's state for them."""
    params = finetune.initial_params(run, key, params_sharding, mesh)
    start = jax.jit(functools.partial(_fresh_state, optimizer), out_shardings=state_sharding)
    return start(params)


def _init_adapters(run: RunConfig, fresh: Callable, optimizer, state_sharding,
                   key: jax.Array) -> TrainState:
    """A LoRA run's first state: the adapters of its init_from PEFT adapter, else `fresh(key)`
    (new ones)."""
    adapters = finetune.initial_adapters(run)
    if adapters is None:
        return fresh(key)
    start = jax.jit(functools.partial(_fresh_state, optimizer), out_shardings=state_sharding)
    return start(adapters)


def _fresh_state(optimizer: optax.GradientTransformation, params) -> TrainState:
    """Step 0 of training `params` (a model's, or a LoRA run's adapters)."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params))


@jax.jit
def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _on_devices(batch_sharding: NamedSharding, batch):
    """A batch (an array, or a task's dict of arrays) from this process's rows, sharded."""
    return jax.tree.map(lambda rows: jax.make_array_from_process_local_data(batch_sharding,
                                                                           rows), batch)


def _validation(evaluate, groups: dict[str, list], sharding: NamedSharding,
                task: TaskConfig | None, frozen: tuple = ()) -> dict[str, float]:
    """Validation metrics (`val_` names) from the loss's sums over the batches of every group
    (a mixture's sources; one group otherwise): the mean loss and perplexity over all of them
    (language modelling: with the blocks' statistics, `model.aux_metrics`, the MoE's drops,
    loads and router entropy) and, for a mixture, each source's `val_loss_NAME` and
    `val_ppl_NAME`; or a task head's metrics (nn/heads.py). `evaluate(batch, *frozen)` gives
    one batch's sums (`frozen`: a LoRA run's base)."""
    sums = aux = None
    per_group = {}
    for name, group_batches in groups.items():
        group = None
        for batch in group_batches:
            batch_sums, batch_aux = jax.device_get(evaluate(_on_devices(sharding, batch),
                                                            *frozen))
            group = batch_sums if group is None else jax.tree.map(np.add, group, batch_sums)
            aux = batch_aux if aux is None else jax.tree.map(np.add, aux, batch_aux)
        per_group[name] = group
        sums = group if sums is None else jax.tree.map(np.add, sums, group)
    if _task_head(task):
        return {f"val_{k}": v for k, v in task_metrics(task.kind, sums).items()}
    out = _loss_metrics(sums, "")
    for name, group in per_group.items() if len(per_group) > 1 else ():
        out.update(_loss_metrics(group, f"_{name}"))
    return out | {f"val_{k}": float(v) for k, v in aux_metrics(aux or ()).items()}


def _described(val_metrics: dict[str, float], task: TaskConfig | None) -> str:
    """The validation metrics a log line shows: a task head's, or the losses and perplexity."""
    return " ".join(f"{k} {v:.4f}" for k, v in val_metrics.items()
                    if _task_head(task) or k == "val_ppl" or k.startswith("val_loss"))


def _loss_metrics(sums: dict, suffix: str) -> dict[str, float]:
    loss = float(sums["loss_sum"]) / max(float(sums["count"]), 1.0)
    return {f"val_loss{suffix}": loss, f"val_ppl{suffix}": math.exp(min(loss, 700))}


@dataclasses.dataclass
class _Source:
    """What a run reads: endless training batches (checkpointed with the run), the
    validation batches by group (a mixture's sources; one group otherwise), and the
    tokenizer's BOS id."""

    train: Iterator
    val: dict[str, list]
    bos_id: int
    val_unigram_entropy: float = 0.0  # language modelling: see `Outcome`


def _corpus_data(run: RunConfig, workdir: Path, log: Callable[[str], None]) -> _Source:
    """Language modelling: the corpus's tokens (a prepared dataset, or a raw corpus prepared
    once: data/corpus.py), or a weighted mixture of several, in packed windows
    (data/batches.py)."""
    train_cfg, data = run.train, run.data
    tokenizer = corpus_tokenizer(data, run.model.vocab_size, workdir, log)
    opened = []
    for source in data.corpora:
        tokens = corpus_tokens(source.path, data.val_fraction, tokenizer, log)
        meta = tokens.meta
        log(f"corpus {source.path} ({tokens.dataset}): {meta['train']['documents']:,} "
            f"training documents ({len(tokens.train):,} tokens), {meta['val']['documents']:,} "
            f"validation ({len(tokens.val):,})" + (f"; weight {source.weight:g}"
                                                  if data.sources else ""))
        opened.append((source, tokens))
    processes = dict(process_index=jax.process_index(), process_count=jax.process_count())
    shape = dict(seq_len=train_cfg.seq_len, batch_size=train_cfg.batch_size,
                 seed=train_cfg.seed, **processes)
    train = (batches.train_batches(opened[0][1].train, **shape) if data.sources is None else
             batches.mixed_batches([(t.train, s.weight) for s, t in opened], **shape))
    val = {s.name: batches.val_batches(t.val, train_cfg.seq_len, train_cfg.batch_size,
                                       train_cfg.eval_batches, **processes) for s, t in opened}
    val_tokens = np.concatenate([t.val[:UNIGRAM_TOKENS // len(opened)] for _, t in opened])
    return _Source(train=train, val=val, bos_id=tokenizer.bos_id,
                   val_unigram_entropy=unigram_entropy(val_tokens, tokenizer.bos_id))


def _task_data(run: RunConfig, workdir: Path, log: Callable[[str], None]) -> _Source:
    """A downstream task: its JSONL files, tokenized with the run's tokenizer (kept in the
    workdir), padded (data/tasks.py). Validation covers every held-out example."""
    task, train_cfg, model = run.task, run.train, run.model
    tokenizer = finetune.run_tokenizer(dataclasses.asdict(run.data), run.init_from, "task run")
    save_tokenizer(tokenizer, workdir)
    read = functools.partial(task_data.read_examples, task=task, model=model,
                             tokenizer=tokenizer, seq_len=train_cfg.seq_len)
    examples = read(task.train)
    if task.val is None:
        train_examples, val_examples = task_data.split(examples, task.val_fraction)
    else:
        train_examples, val_examples = examples, read(task.val)
    truncated = sum(e["truncated"] for e in train_examples + val_examples)
    log(f"task {task.kind}: {len(train_examples)} training examples, {len(val_examples)} "
        f"validation ({task.val or f'held out of {task.train}'}); {truncated} cut to "
        f"train.seq_len={train_cfg.seq_len} tokens")
    processes = dict(process_index=jax.process_index(), process_count=jax.process_count())
    shape = dict(kind=task.kind, seq_len=train_cfg.seq_len, pad_id=model.pad_id,
                 batch_size=train_cfg.batch_size, **processes)
    return _Source(train=task_data.train_batches(train_examples, seed=train_cfg.seed, **shape),
                   val={"task": task_data.val_batches(val_examples, **shape)},
                   bos_id=tokenizer.bos_id)


def _chat_data(run: RunConfig, workdir: Path, log: Callable[[str], None]) -> _Source:
    """Chat fine-tuning: conversations rendered by the init_from checkpoint's chat template
    (else ChatML) from JSONL or a prepared chat dataset, the template and tokenizer kept in the
    workdir (a checkpoint of the run chats as it was trained), in rows built as they are read
    (data/chat_rows.py)."""
    task, train_cfg = run.task, run.train
    tokenizer = finetune.run_tokenizer(dataclasses.asdict(run.data), run.init_from, "chat run")
    template = conversations.chat_template_for(finetune.model_files(run.init_from))
    found = chat_rows.chat_splits(task.train, task.val, task.val_fraction, template, tokenizer,
                                  train_cfg.seq_len, task.truncate)
    # a row's padding is unscored and unseen by the rest: any token does; an end of sequence
    rows = {name: chat_rows.Rows(s, train_cfg.seq_len, task.packing, tokenizer.eos_ids[0])
            for name, s in (("train", found.train), ("val", found.val))}
    processes = dict(process_index=jax.process_index(), process_count=jax.process_count())
    batches = chat_rows.train_batches(rows["train"], train_cfg.batch_size, train_cfg.seed,
                                      **processes)
    save_tokenizer(tokenizer, workdir)  # once the data is read: bad data writes nothing
    write_atomically(workdir / CHAT_TEMPLATE_FILE, template.text)
    log(f"task chat ({template.source}): {len(found.train):,} training conversations in "
        f"{len(rows['train']):,} rows of {train_cfg.seq_len}, {len(found.val):,} validation "
        f"({found.val_source}); {found.truncated(train_cfg.seq_len)} cut to "
        f"train.seq_len + 1 = {train_cfg.seq_len + 1} tokens")
    return _Source(train=batches,
                   val={"chat": chat_rows.ValBatches(rows["val"], train_cfg.batch_size,
                                                     **processes)},
                   bos_id=tokenizer.bos_id)


def _task_head(task: TaskConfig | None) -> bool:
    """Whether the run trains a task head (its metrics), not a language model."""
    return task is not None and task.kind != CHAT


@contextlib.contextmanager
def _stop_signals() -> Iterator[list[str]]:
    """Yields a list that receives the name of each SIGTERM / SIGINT until the block exits."""
    received: list[str] = []
    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, lambda signum, _: received.append(signal.Signals(signum).name))
                for s in handled}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
