"""A model's decode programs compiled for one chip of a TPU slice or GPU node this host does not
have: what the prefill and one decode step hold on it, and what a step reads.

    python -m llama_jax.aot.decoding llama3-8b --topology v5e-1 [--batch 1] [--context 2048]

compiles, for every decoder (scan, unrolled), weight format (bf16, int8) and KV cache (bf16,
int8), the greedy prefill and one step of the decode loop (`decode.generate.lower_programs`),
and prints per case: whether it fits the chip (XLA's peak against the memory XLA allows),
and XLA's bytes accessed per step (its cost analysis of the unrolled step; the scan's counts
its loop body once, so it is left out) beside the bandwidth floor's bytes (`plan.costs`): the
weights as stored and the cache. int8 weights must read about half the bytes of bf16's: a
dequantized copy of the weights would read more, not less. Nothing runs: speed needs the chip.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

import jax

from llama_jax.aot.compiled import ProgramMemory, compile_program
from llama_jax.aot.estimate import duration
from llama_jax.cli import user_errors_exit
from llama_jax.config import ModelConfig, load_model_config
from llama_jax.decode.generate import lower_programs
from llama_jax.model.params import abstract_params
from llama_jax.model.transformer import unstack_layers
from llama_jax.parallel import target, topology as topologies
from llama_jax.plan import costs, hardware
from llama_jax.quant import is_int8

CASES = [(impl, weights, cache) for impl in ("scan", "unrolled")
         for weights in ("bfloat16", "int8") for cache in ("bfloat16", "int8")]


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decoder / weights / cache combination compiled for one chip."""

    decode_impl: str
    weights: str  # "bfloat16" or "int8"
    cache_dtype: str
    prefill: ProgramMemory
    step: ProgramMemory
    bytes_accessed: float | None  # XLA's cost analysis of one step (unrolled only)
    floor_bytes: int  # what a step must read: the weights as stored and the cache
    bandwidth: float  # the chip's HBM bytes/s: the floor's time is floor_bytes / bandwidth
    # int8 weights: buffers of an int8 matrix's shape in a float type that the compiled step
    # writes to memory (a dequantized copy); 0 when every dequantization is fused into its
    # matmul
    dequantized_copies: int | None

    @property
    def floor_ratio(self) -> float | None:
        """XLA:TPU's estimated step time over the HBM floor's (None: no estimate)."""
        clock = self.step.clock
        return None if clock is None else clock.seconds / (self.floor_bytes / self.bandwidth)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"fits": self.prefill.fits and self.step.fits,
                                           "floor_ratio": self.floor_ratio,
                                           "prefill": self.prefill.as_dict(),
                                           "step": self.step.as_dict()}


def compile_decoding(config: ModelConfig, topology: str, *, batch: int = 1,
                     context: int = 2048, cases=CASES) -> list[DecodeCase]:
    """The decode programs of `config` (bf16 compute) for one chip of `topology`, per case."""
    named = topologies.parse(topology)
    device, chip = topologies.devices(named)[0], hardware.HARDWARE[named.hardware]
    platform = target.platform_name(device)
    here = jax.sharding.SingleDeviceSharding(device)
    prompt = context // 2
    results = []
    for impl, weights, cache in cases:
        model = config.with_execution(compute_dtype="bfloat16", param_dtype="bfloat16",
                                      quantize="int8" if weights == "int8" else None)
        params = abstract_params(model)
        if impl == "unrolled":
            params = jax.eval_shape(unstack_layers, params)
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here),
                              params)
        with target.compiling_for([device]):
            prefill, step = lower_programs(model, params, batch=batch, prompt_len=prompt,
                                           new_tokens=context - prompt, cache_dtype=cache)
            options = target.compiler_options()
            prefill_memory, _ = compile_program("prefill", lambda: prefill, options, platform,
                                                chip)
            step_memory, compiled = compile_program("decode step", lambda: step, options,
                                                    platform, chip)
        results.append(DecodeCase(
            impl, weights, cache, prefill_memory, step_memory,
            _bytes_accessed(compiled) if impl == "unrolled" else None,
            costs.decode_bytes_per_step(model, batch, context, "bfloat16", cache),
            chip.bandwidth,
            dequantized_copies(compiled, params, impl == "scan")
            if weights == "int8" and compiled else None))
    return results


def dequantized_copies(compiled, params, stacked: bool) -> int:
    """How many values of the compiled program (outside fusions) are float arrays shaped like
    one layer's int8 matrix of `params` (layers `stacked` along a leading axis, or not):
    dequantized copies written to device memory (HBM). A dequantization fused into its matmul
    is none, nor one converted in a TPU core's own memory."""
    shapes = {leaf.values.shape[1:] if stacked else leaf.values.shape  # one layer's matrix
              for leaf in jax.tree.leaves(params, is_leaf=is_int8) if is_int8(leaf)}
    found = re.findall(r"= (?:bf16|f16|f32)\[([\d,]+)\](\{[^}]*\})? (\w+)",
                       _unfused(compiled.as_text()))
    return sum(1 for shape, layout, op in found
               if tuple(map(int, shape.split(","))) in shapes and op != "parameter"
               and "S(" not in layout)  # S(n): an on-chip memory space (a TPU's VMEM)


def _unfused(hlo_text: str) -> str:
    """The computations of an HLO module whose values live in memory: the entry, loop bodies
    and conditions, calls; not the insides of fusions (computations named *fus*)."""
    blocks = re.split(r"\n(?=ENTRY |%\S+ \()", hlo_text)
    return "\n".join(b for b in blocks if "fus" not in b.split("(", 1)[0])


def _bytes_accessed(compiled) -> float | None:
    if compiled is None:
        return None
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return (analysis or {}).get("bytes accessed")


def render(cases: list[DecodeCase], limit: int | None, layers: int) -> str:
    """One line per case; a GPU's also counts the step's kernels (per layer: over `layers`)."""
    lines = []
    for c in cases:
        read = "" if c.bytes_accessed is None else (
            f"; reads {costs.format_bytes(c.bytes_accessed)} per step by XLA's count, floor "
            f"{costs.format_bytes(c.floor_bytes)}")
        copies = "" if c.dequantized_copies is None else \
            f"; dequantized weight copies: {c.dequantized_copies}"
        if c.floor_ratio is not None:
            copies += (f"; XLA's clock {duration(c.step.clock.seconds)} per step = "
                       f"{c.floor_ratio:.2f}x the HBM floor")
        if c.step.clock is not None and c.step.clock.launches is not None:
            copies += (f"; {c.step.clock.launches:g} kernels per step "
                       f"({c.step.clock.launches / layers:.1f} per layer)")
        lines.append(f"{c.decode_impl} decoder, {c.weights} weights, {c.cache_dtype} cache: "
                     f"prefill {c.prefill.verdict(limit)}; step {c.step.verdict(limit)}"
                     f"{read}{copies}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m llama_jax.aot.decoding",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="preset name (e.g. llama3-8b) or a config file")
    parser.add_argument("--topology", required=True, help="one chip of it is compiled for: "
                        "v5e-1, v5p-8, h100x1, ...")
    parser.add_argument("--batch", type=int, default=1, help="rows decoded together")
    parser.add_argument("--context", type=int, default=2048,
                        help="tokens per row: half prompt, half generated")
    parser.add_argument("--json", action="store_true", help="print one JSON list")
    return parser.parse_args(argv)


@user_errors_exit
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    named = topologies.parse(args.topology)
    config = load_model_config(args.config)
    cases = compile_decoding(config, args.topology, batch=args.batch, context=args.context)
    limit = hardware.HARDWARE[named.hardware].memory_bytes
    print(json.dumps([c.as_dict() for c in cases], indent=1) if args.json
          else f"{args.config} on one chip of {named.describe()}, batch {args.batch}, "
               f"context {args.context}\n" + render(cases, limit, config.n_layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
