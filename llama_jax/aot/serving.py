"""A server's start-up check for a TPU slice or GPU node this host does not have: its largest
programs compiled for the target, and whether the weights, the rows' KV cache, the prefix
cache and a prefill chunk fit each device.

    python -m llama_jax.aot.serving MODEL --topology v5e-8 --mesh tensor=8 --max-batch 64 \
        --max-seq-len 8192 [--quantize int8] [--cache-dtype int8] [--json]
    python -m llama_jax.serve --checkpoint DIR --compile-only --topology v5e-8 ...

MODEL is a preset, a config file or a checkpoint directory (its config is read, not its
weights). Without `--mesh` the server runs on one device, as `serve` does. The programs are the
server's own (`decode/batching.py`) at their largest: the last prefill chunk of the longest prompt,
its insertion into the rows, and a dispatch of decode steps of `max_batch` rows each attending
over `max_seq_len` positions with every sampling path; speculating (`--speculate`,
`--draft-checkpoint`), a dispatch of rounds that verify instead, and a draft model's last
prefill chunk. Every program takes the KV cache's pool of pages (the rows' and the prefix
cache's), so the server needs, per device, the most of their peaks. Beside it: the figure
`serve` checks at start-up (the weights and the planner's KV cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Callable

import jax

from llama_jax.aot.compiled import ProgramMemory, compile_program
from llama_jax.cli import user_errors_exit
from llama_jax.config import MeshConfig, ModelConfig, cache_dtype_name, load_model_config
from llama_jax.decode.decoder import DECODE_IMPLS, UNROLLED_BACKENDS, server_shape
from llama_jax.decode.speculate import speculation
from llama_jax.decode.batching import lower_programs
from llama_jax.errors import ConfigError, GenerateError
from llama_jax.formats.checkpoint import checkpoint_config
from llama_jax.formats.loading import placed_target
from llama_jax.model.params import abstract_params, param_specs
from llama_jax.model.transformer import unstack_layers
from llama_jax.parallel import sharding, target, topology as topologies
from llama_jax.parallel.devices import free_memory_bytes
from llama_jax.plan import hardware
from llama_jax.plan.costs import (SERVING_PAGE_SIZE, SERVING_PREFILL_CHUNK,
                                  SERVING_STEPS_PER_DISPATCH, format_bytes)
from llama_jax.config import parse_mesh
from llama_jax.serve.flags import add_server_arguments, check_speculation_flags


@dataclasses.dataclass(frozen=True)
class ServingReport:
    """`compile_serving`'s findings (bytes are per device)."""

    target: str
    platform: str
    n_devices: int
    mesh: dict[str, int]
    versions: dict[str, str]
    xla_flags: str
    compiler_options: dict[str, str]
    limit: int | None  # the memory XLA allows per device (this host: its free memory)
    decode_impl: str
    weights: str  # "bfloat16", "int8", ...
    cache_dtype: str
    max_batch: int
    max_seq_len: int
    cache_len: int  # positions per row, at the most
    parameters: int
    cache: int  # the KV cache's pool of pages as XLA lays it out (the prefix cache's within)
    planned_cache: int  # the planner's figure for the rows' pages, which `serve` checks
    prefill_chunk: int
    page_size: int
    prefix_cache: int  # the prefix cache's pages (whole chunks)
    programs: tuple[ProgramMemory, ...]  # prefill (a draft's too), insert, decode or speculate
    speculation: str | None = None  # "ngram, k=4", "draft, k=4" or None

    @property
    def needs(self) -> dict[str, int]:
        """What the server holds while each program runs: its peak (every program takes the
        rows and their pool of pages)."""
        return {p.name: p.total for p in self.programs}

    @property
    def need(self) -> int:
        """The most the server holds at once."""
        return max(self.needs.values())

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.programs) and (
            self.limit is None or self.need <= self.limit)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"needs": self.needs, "need": self.need,
                                           "fits": self.fits,
                                           "programs": [p.as_dict() for p in self.programs]}


def compile_serving(config: ModelConfig, topology: str | None = None, *,
                    mesh: MeshConfig | None = None, max_batch: int = 8,
                    max_seq_len: int | None = None, cache_dtype: str | None = None,
                    decode_impl: str = "auto", steps: int = SERVING_STEPS_PER_DISPATCH,
                    prefill_chunk: int = SERVING_PREFILL_CHUNK,
                    prefix_cache_bytes: int | None = None, page_size: int = SERVING_PAGE_SIZE,
                    kv_cache_bytes: int | None = None, speculate: str | None = None,
                    num_speculative_tokens: int = 4, ngram: tuple[int, int] = (1, 3),
                    draft_config: ModelConfig | None = None,
                    log: Callable[[str], None] = lambda _: None) -> ServingReport:
    """Compiles the largest programs of a server of `config` (its dtypes and quantization as
    it would load) for `topology` (None: this host's devices), on `mesh` (None: one device),
    prefilling in chunks of `prefill_chunk` beside a prefix cache of `prefix_cache_bytes` per
    device (None: the server's default share of the device's memory), over pages of
    `page_size` positions (`kv_cache_bytes` of them for the rows), speculating as
    `speculate`, `num_speculative_tokens` and `ngram` say (by a draft model of
    `draft_config`: speculate="draft" is implied by it), as `Engine`'s."""
    if decode_impl not in DECODE_IMPLS:
        raise GenerateError(f"decode_impl={decode_impl!r} must be one of "
                            f"{', '.join(DECODE_IMPLS)}")
    if topology is None:  # what `serve` checks against: the memory free now
        devices, described, limit = jax.devices(), "this host", free_memory_bytes()
        chip = None
    else:
        named = topologies.parse(topology)
        devices, described = topologies.devices(named), named.describe()
        chip = hardware.HARDWARE[named.hardware]
        limit = chip.memory_bytes
    with target.compiling_for(devices):  # `compute_dtype: auto` chooses for the target
        config = config.for_platform()
        draft_config = draft_config and draft_config.for_platform()
    cache_dtype = cache_dtype_name(cache_dtype, config.compute_dtype)  # its default follows
    platform = target.platform_name(devices[0])
    if decode_impl == "auto":  # the server drops the stacked weights: one copy either way
        decode_impl = "unrolled" if platform in UNROLLED_BACKENDS else "scan"
    params = _placed_params(config, devices, mesh)
    draft_params = None if draft_config is None else _placed_params(draft_config, devices, None)
    if decode_impl == "unrolled":
        params = _per_layer(params)
        draft_params = None if draft_params is None else _per_layer(draft_params)
    spec = speculation(config, speculate, num_speculative_tokens, ngram,
                       None if draft_config is None else (draft_config, draft_params),
                       max_batch, None, platform)
    if draft_config is not None and mesh is not None:
        raise GenerateError("a server's draft model decodes on one device: compile it "
                            "without --mesh, or speculate by prompt lookup")
    draft = None if draft_config is None else (draft_config, draft_params)
    weights = sharding.bytes_per_device((params, draft_params))
    room = None if limit is None else limit - weights
    shape = server_shape(config, params, cache_dtype, mesh, draft, max_batch=max_batch,
                         max_seq_len=max_seq_len, steps=steps, prefill_chunk=prefill_chunk,
                         page_size=page_size, speculative_tokens=spec.k if spec else 0,
                         kv_cache_bytes=kv_cache_bytes, cache_room=room)
    shape = (shape.with_default_prefix_cache(room) if prefix_cache_bytes is None
             else shape.with_prefix_cache(prefix_cache_bytes))
    log(f"compiling a server of {max_batch} x {shape.max_seq_len} tokens for {described}")
    programs = []
    with target.compiling_for(devices):
        lowered, rows = lower_programs(
            config, params, max_batch=max_batch, n_pages=shape.n_pages, page_size=page_size,
            prompt_len=shape.max_seq_len - 1, chunk=prefill_chunk, max_len=shape.cache_len,
            steps=steps, cache_dtype=cache_dtype, mesh_config=mesh,
            layout="stacked" if decode_impl == "scan" else "per_layer", spec=spec,
            draft_params=draft_params)
        options = target.compiler_options()
        for name, program in lowered.items():
            memory, _ = compile_program(name, lambda: program, options, platform, chip)
            log(f"{name}: compiled in {memory.compile_s:.1f} s")
            programs.append(memory)
    mesh_shape = dict(m.shape) if (m := sharding.mesh_of(params)) is not None else {}
    return ServingReport(
        target=described, platform=platform,
        n_devices=len(devices) if mesh is not None else 1, mesh=mesh_shape,
        versions=topologies.compiler_versions(platform) if topology else {},
        xla_flags=os.environ.get("XLA_FLAGS", ""), compiler_options=options,
        limit=limit, decode_impl=decode_impl,
        weights=config.quantize or config.param_dtype, cache_dtype=cache_dtype,
        max_batch=max_batch, max_seq_len=shape.max_seq_len, cache_len=shape.cache_len,
        parameters=weights,
        # the stored keys and values, the draft's beside the model's
        cache=sharding.bytes_per_device((rows.cache.groups, None if rows.draft_cache is None
                                         else rows.draft_cache.groups)),
        planned_cache=shape.rows_bytes, prefill_chunk=prefill_chunk, page_size=page_size,
        prefix_cache=shape.prefix_bytes,
        programs=tuple(programs),
        speculation=None if spec is None else f"{spec.method}, k={spec.k}")


def _placed_params(config: ModelConfig, devices: list, mesh: MeshConfig | None):
    """The abstract parameters as the server would load them: on a mesh of `devices` by the
    weight rules, or on the first device."""
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(devices[0])
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
                            abstract_params(config))
    device_mesh = sharding.make_mesh(mesh, devices)
    return placed_target(config, lambda c: sharding.param_shardings(param_specs(c),
                                                                    device_mesh, mesh))


def _per_layer(params):
    """The unrolled decoder's weights (`unstack_layers`) from abstract stacked ones: each
    layer's leaf laid out as its stack was, less the layer axis (as slicing a placed stack
    lays it out). `jax.eval_shape` of `unstack_layers` gives the structure but no shardings:
    on a mesh of Auto axes, as the server's, it drops them."""
    def layer_of(stacked: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        placed = stacked.sharding
        if isinstance(placed, jax.sharding.NamedSharding):
            placed = jax.sharding.NamedSharding(placed.mesh,
                                                jax.sharding.PartitionSpec(*placed.spec[1:]))
        return jax.ShapeDtypeStruct(stacked.shape[1:], stacked.dtype, sharding=placed)

    unstacked = jax.eval_shape(unstack_layers, params)  # the structure; shardings come next
    groups = tuple(tuple(jax.tree.map(layer_of, stack) for _ in layers)
                   for layers, stack in zip(unstacked["groups"], params["groups"]))
    return {**params, "groups": groups}


def render(report: ServingReport) -> str:
    """The report as text: the target and the compiler, the server's shape, then per device
    the weights, the cache and each program beside what the start-up check counts."""
    versions = ", ".join(f"{k} {v}" for k, v in report.versions.items()) or "the host's jax"
    mesh = ", ".join(f"{k}={v}" for k, v in report.mesh.items()) or "one device"
    limit = "-" if report.limit is None else format_bytes(report.limit)
    lines = [
        f"target     {report.target}; {mesh}",
        f"compiler   {versions}",
        f"server     {report.max_batch} rows x {report.max_seq_len} tokens ({report.cache_len}"
        f" cache positions each); {report.weights} weights, {report.cache_dtype} KV cache, "
        f"{report.decode_impl} decoder"
        + (f"; speculating ({report.speculation})" if report.speculation else ""),
        "per device           XLA            start-up check",
        f"  weights            {format_bytes(report.parameters):>12}   "
        f"{format_bytes(report.parameters):>12}",
        f"  KV cache pages     {format_bytes(report.cache):>12}   "
        f"{format_bytes(report.planned_cache + report.prefix_cache):>12}   "
        f"(pages of {report.page_size} positions)",
        f"   of which prefix   {format_bytes(report.prefix_cache):>12}   "
        f"{format_bytes(report.prefix_cache):>12}   (chunks of {report.prefill_chunk})",
    ]
    for program in report.programs:
        lines += program.report_lines(report.limit)
    if all(p.fits for p in report.programs):
        verdict = "fits" if report.fits else "does not fit"
        largest = max(report.needs, key=report.needs.get)
        lines.append(f"server: {verdict}: needs {format_bytes(report.need)} of {limit} per "
                     f"device (while the {largest} runs)")
    else:
        lines.append("server: does not fit")
    return "\n".join(lines)


def model_config(name_or_path: str, dtype: str | None, quantize: str | None,
                 quantize_head: bool, attention_impl: str) -> ModelConfig:
    """The config a server of `name_or_path` (a preset, a config file or a checkpoint
    directory) runs: in `dtype` (None: as given), quantized as asked."""
    config = (checkpoint_config(name_or_path) if Path(name_or_path).is_dir()
              else load_model_config(name_or_path))
    dtype = dtype or config.param_dtype
    return config.with_execution(param_dtype=dtype, compute_dtype=dtype, quantize=quantize,
                                 quantize_head=quantize_head, attention_impl=attention_impl)


def report_for(model: str, args: argparse.Namespace, mesh: MeshConfig | None) -> ServingReport:
    """`compile_serving` of `model` as the parsed server flags `args` ask."""
    try:
        config = model_config(model, args.dtype, args.quantize, args.quantize_head,
                              args.attention_impl)
    except ConfigError as e:
        raise GenerateError(f"{model}: {e}") from None
    draft_config = None
    if args.draft_checkpoint:
        try:
            draft_config = model_config(args.draft_checkpoint, args.dtype, args.quantize,
                                        args.quantize_head, args.attention_impl)
        except ConfigError as e:
            raise GenerateError(f"{args.draft_checkpoint}: {e}") from None
    return compile_serving(config, args.topology, mesh=mesh, max_batch=args.max_batch,
                           max_seq_len=args.max_seq_len, cache_dtype=args.cache_dtype,
                           decode_impl=args.decode_impl, steps=args.steps_per_dispatch,
                           prefill_chunk=args.prefill_chunk,
                           prefix_cache_bytes=0 if args.no_prefix_cache
                           else args.prefix_cache_bytes, page_size=args.page_size,
                           kv_cache_bytes=args.kv_cache_bytes, speculate=args.speculate,
                           num_speculative_tokens=args.num_speculative_tokens,
                           ngram=tuple(args.ngram), draft_config=draft_config,
                           log=lambda line: print(line, file=sys.stderr, flush=True))


def print_report(report: ServingReport, as_json: bool) -> int:
    """Prints `report` (text or one JSON object); the exit status: 0 if it fits, else 1."""
    print(json.dumps(report.as_dict(), indent=1) if as_json else render(report))
    return 0 if report.fits else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m llama_jax.aot.serving",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="preset (e.g. llama3-8b), config file or checkpoint "
                        "directory")
    parser.add_argument("--topology", default=None,
                        help="v5e-8, v5p-8, h100x8, ... (default: this host's devices)")
    add_server_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    check_speculation_flags(parser, args)
    return args


@user_errors_exit
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mesh = parse_mesh(args.mesh) if args.mesh else None
    return print_report(report_for(args.model, args, mesh), args.json)


if __name__ == "__main__":
    sys.exit(main())
