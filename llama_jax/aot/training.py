"""A training run compiled for a TPU slice or GPU node this host does not have, and what it
would hold per device there, beside the planner's figure.

`compile_training(run, "v5p-256")` builds the run's mesh over the target's compile-only devices
(`parallel/topology.py`), compiles the training step and the evaluation exactly as a run on that
hardware would (every execution choice follows the mesh's platform: `parallel/target.py`),
without touching data, weights or the host's memory, and reports per device: parameters and
optimizer state (the state's shards), temporaries, XLA's peak against the memory XLA allows,
the planner's figure (`plan/memory.py`) and the compile time. A program that does not fit is
reported with what it needed. `train.py --compile-only --topology NAME` prints the report.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import jax

from llama_jax.aot.compiled import ProgramMemory, compile_program
from llama_jax.config import MeshConfig, ModelConfig, RunConfig
from llama_jax.config.run import CHAT
from llama_jax.nn.attention.dot_product import describe_attention
from llama_jax.parallel import sharding, target, topology as topologies
from llama_jax.parallel.sharding import MESH_AXES
from llama_jax.plan import costs, hardware
from llama_jax.plan.costs import format_bytes
from llama_jax.plan.memory import MemoryPlan, plan_memory
from llama_jax.training.cross_entropy import SCORED_PIECE
from llama_jax.training.finetune import load_run_config
from llama_jax.training.trainer import check_run, jitted_programs

# The step's language-modelling loss splits documents at this token; any id compiles the same
# program (no tokenizer is read).
_ANY_BOS_ID = 1


@dataclasses.dataclass(frozen=True)
class TrainingReport:
    """`compile_training`'s findings (bytes are per device)."""

    target: str  # the topology, described
    platform: str
    n_devices: int
    mesh: dict[str, int]
    compute: str  # the compute dtype, "(auto)" where the target chose it
    model_flops: float  # per device per step: 6·P_mm + causal attention per token
    attention: str  # the run's attention line (implementation and why)
    versions: dict[str, str]  # jax, jaxlib, libtpu / the CUDA plugin
    xla_flags: str  # the process's XLA_FLAGS
    compiler_options: dict[str, str]  # what the compile added to them
    limit: int | None  # the memory XLA allows per device (the planner's table for the target)
    parameters: int
    optimizer: int
    plan: MemoryPlan
    programs: tuple[ProgramMemory, ...]  # the train step, then the evaluation

    @property
    def fits(self) -> bool:
        return all(p.fits and (self.limit is None or p.total <= self.limit)
                   for p in self.programs)

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["plan"]["training"] = self.plan.training
        out["fits"] = self.fits
        out["programs"] = [memory.as_dict() for memory in self.programs]
        return out


def compile_training(run: RunConfig, topology: str | None = None, slices: int = 1,
                     evaluate: bool = True, log: Callable[[str], None] = lambda _: None,
                     gpu_target: str | None = None) -> TrainingReport:
    """Compiles `run`'s training step (and, with `evaluate`, its evaluation) for `topology`
    (`parallel.topology` names; None: this host's devices) and reports their memory.
    `gpu_target`: a GPU target description instead of the repository's (`topology.devices`)."""
    if topology is None:
        devices, described, entry = jax.devices(), "this host", None
    else:
        named = topologies.parse(topology, slices)
        devices, described = topologies.devices(named, gpu_target), named.describe()
        entry = hardware.HARDWARE[named.hardware]
    mesh = sharding.make_mesh(run.mesh, devices)
    platform = target.platform_name(devices[0])
    programs = []
    with target.compiling_for(mesh), sharding.use_mesh(mesh, run.mesh):
        run = dataclasses.replace(run, model=run.model.for_platform())  # auto: the target's
        check_run(run, mesh)
        adapters = None if run.lora is None else costs.run_adapter_specs(run)
        plan = plan_memory(_as_trained(run), run.mesh, len(devices), batch=run.train.batch_size,
                           seq=run.train.seq_len, remat=run.model.remat,
                           micro_batches=run.train.micro_batches, backend=platform,
                           mu_dtype=run.train.mu_dtype, adapters=adapters)
        log(f"compiling for {described}, mesh {dict(mesh.shape)}")
        jitted = jitted_programs(run, _ANY_BOS_ID, mesh)
        options = target.compiler_options()
        lowerings = [("train step", jitted.lower_step)]
        if evaluate:
            lowerings.append(("evaluation", jitted.lower_evaluate))
        for name, lower in lowerings:
            memory, _ = compile_program(name, lower, options, platform, entry)
            log(f"{name}: compiled in {memory.compile_s:.1f} s")
            programs.append(memory)
    state = jitted.start.abstract
    return TrainingReport(
        target=described, platform=platform, n_devices=len(devices), mesh=dict(mesh.shape),
        compute=run.model.compute_dtype + (" (auto)" if run.model.compute_dtype_auto else ""),
        model_flops=costs.train_flops_per_step(run) / len(devices),
        attention=describe_attention(run.model, run.train.seq_len, platform),
        versions=topologies.compiler_versions(platform) if topology else {},
        xla_flags=os.environ.get("XLA_FLAGS", ""), compiler_options=options,
        limit=entry.memory_bytes if entry else None,
        parameters=sharding.bytes_per_device((state.params, *jitted.frozen)),
        optimizer=sharding.bytes_per_device(state.opt_state), plan=plan,
        programs=tuple(programs))


def compile_planned(config: str, topology: str, slices: int = 1, *, batch: int, seq: int,
                    mesh: MeshConfig, remat: str, compute_dtype: str,
                    attention_impl: str = "auto", loss_chunk: int | None = None,
                    mu_dtype: str | None = None) -> tuple[TrainingReport, str]:
    """The planner's training plan (`python -m llama_jax.plan.info ... --topology T --compile`)
    as a run, its step compiled for `topology`: the report and its text."""
    settings = {"model.remat": remat, "model.compute_dtype": compute_dtype,
                "model.param_dtype": "float32", "model.attention_impl": attention_impl,
                "model.loss_chunk": loss_chunk, "train.mu_dtype": mu_dtype,
                "train.batch_size": batch, "train.seq_len": seq,
                **{f"mesh.{axis}": ways for axis, ways in zip(MESH_AXES, mesh.sizes)}}
    run = load_run_config(config, [f"{k}={'null' if v is None else v}"
                                   for k, v in settings.items()])
    report = compile_training(run, topology, slices, evaluate=False)
    return report, render(report, run)


def _gib(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def render(report: TrainingReport, run: RunConfig) -> str:
    """The report as text: the target and the compiler, then per device XLA's figures beside
    the planner's, then each program's verdict."""
    plan, step = report.plan, report.programs[0]
    train = run.train
    versions = ", ".join(f"{k} {v}" for k, v in report.versions.items()) or "the host's jax"
    flags = report.xla_flags or "(none)"
    if report.compiler_options:
        flags += "; added for the target: " + " ".join(
            f"--{k}={v}" for k, v in report.compiler_options.items())
    ratio = f"  (XLA / planner {step.total / plan.training:.2f}x)" if plan.training else ""
    lines = [
        f"target     {report.target}",
        f"compiler   {versions}; XLA_FLAGS {flags}",
        f"run        mesh {', '.join(f'{k}={v}' for k, v in report.mesh.items())}; batch "
        f"{train.batch_size} x {train.seq_len} tokens ({train.micro_batches} micro-batch"
        f"{'es' if train.micro_batches > 1 else ''})",
        f"           remat {run.model.remat}; {report.compute} compute, "
        f"{run.model.param_dtype} parameters; {report.attention}",
        "per device           XLA            planner",
        f"  parameters         {_gib(report.parameters):>12}   {_gib(plan.weights):>12}",
        f"  optimizer state    {_gib(report.optimizer):>12}   {_gib(plan.optimizer):>12}",
        f"  gradients          {'':>12}   {_gib(plan.gradients):>12}",
        f"  temporaries        {_gib(step.temporaries if step.fits else None):>12}",
        f"  activations        {'':>12}   {_gib(plan.activations):>12}",
        f"  train step total   {_gib(step.total):>12}   {_gib(plan.training):>12}{ratio}",
        f"  memory XLA allows  {_gib(report.limit):>12}",
    ]
    for program in report.programs:
        lines += program.report_lines(
            report.limit, report.model_flops if program is step else None)
    return "\n".join(lines)


def _as_trained(run: RunConfig) -> ModelConfig:
    """The model as the run's loss computes it: a chat run's LM head in rematerialised pieces
    (training/cross_entropy.py, scored positions only), as `loss_chunk` pieces are planned."""
    if run.task is None or run.task.kind != CHAT:
        return run.model
    return dataclasses.replace(run.model, loss_chunk=run.model.loss_chunk or SCORED_PIECE)
