"""Where a training step's time goes: a `jax.profiler` trace of the GPU benchmark model's step
(bench/gpu.py), its device op time summed by category.

    python bench/profile_step.py [--impl cudnn] [--set remat=attention loss_chunk=512
                                                      mu_dtype=bfloat16]
                                 [--steps 5] [--tiny] [--out DIR]

Categories, from the compiled program: every HLO instruction is placed by its JAX name stack
(`op_name` metadata: the library's `attention`, `loss` and `optimizer` scopes) and by what it
computes — collectives, then attention (anything under the `attention` scope: cuDNN's fused
call, the blockwise loops, the dense scores), matmuls (a dot or a cuBLAS call, or a fusion
around one), the loss's other ops, the optimizer (AdamW, clipping, the update), copies
(copy, transpose, dynamic slices and updates: the layer scan's and the cache's moves), and
the rest (norms, activations, RoPE, residual adds: elementwise). The trace's device events
carry the instruction they ran (`hlo_op`); their durations are summed per category over the
profiled steps. Runs as bench/gpu.py's training does: bf16 compute, fp32 master weights,
AdamW, the state donated; `--tiny` is a CPU dry run of the same code.

Prints a table (ms per step, share of the op time) and writes profile.json and the trace
under `--out` (default $OUT, else .).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import time
from pathlib import Path

import jax

from gpu import FULL, TINY, WARMUP_STEPS, compiled_train_step

CATEGORIES = ("collectives", "attention", "matmuls", "loss", "optimizer", "copies",
              "norms and elementwise")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute")
_COPIES = ("copy", "transpose", "dynamic-slice", "dynamic-update-slice", "slice",
           "concatenate", "pad", "bitcast", "reshape", "broadcast")
_CONTAINERS = ("while", "conditional", "call", "async-start", "async-done")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\S.*?\s([\w\-]+)\(")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def parse_hlo(text: str) -> tuple[dict, dict]:
    """(instruction -> (opcode, op_name, called computations, custom-call target),
    computation -> its instructions' opcodes)."""
    instructions, computations, current = {}, collections.defaultdict(list), None
    for line in text.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            computation = _COMPUTATION.match(line)
            if computation:
                current = computation.group(1)
            continue
        name, opcode = match.groups()
        op_name = re.search(r'op_name="([^"]*)"', line)
        target = re.search(r'custom_call_target="([^"]*)"', line)
        calls = re.findall(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)", line)
        instructions[name] = (opcode, op_name.group(1) if op_name else "", calls,
                              target.group(1) if target else "")
        computations[current].append(opcode)
    return instructions, computations


def category(instruction: tuple, computations: dict) -> str:
    opcode, op_name, calls, target = instruction
    inner = {op for called in calls for op in computations.get(called, ())} | {opcode}
    # scopes as the name stack writes them under transformations: "transpose(jvp(loss))"
    scopes = {re.sub(r"^(?:[\w\-]+\()+|\)+$", "", part) for part in op_name.split("/")}
    if inner & set(_COLLECTIVES) or any(c.rstrip("-startdone") in _COLLECTIVES for c in inner):
        return "collectives"
    if "attention" in scopes or "fmha" in target.lower() or "cudnn$flash" in target:
        return "attention"
    if "dot" in inner or "gemm" in target.lower() or "matmul" in target.lower():
        return "matmuls"
    if "loss" in scopes:
        return "loss"
    if "optimizer" in scopes:
        return "optimizer"
    if inner - {"parameter", "constant", "tuple", "get-tuple-element"} <= set(_COPIES):
        return "copies"
    return "norms and elementwise"


def device_op_times(trace_path: Path, module: str) -> dict[str, float]:
    """Seconds per HLO instruction of `module` over the trace: device (GPU stream) events,
    or on CPU the executor's op events."""
    events = json.load(gzip.open(trace_path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    times = collections.Counter()
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and args.get("hlo_op") and module in args.get("hlo_module", ""):
            times[args["hlo_op"]] += e.get("dur", 0) / 1e6
    return times


def profile(plan, run: str, steps: int, out: Path) -> dict:
    """The profile of a run of bench/gpu.py's training ("impl+field=value+...")."""
    compiled, state, batch, _ = compiled_train_step(plan, run)
    for _ in range(WARMUP_STEPS):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(state)
    trace_dir = out / "trace"
    start = time.perf_counter()
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(steps):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(state)
    wall_s = (time.perf_counter() - start) / steps
    trace = max(trace_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    instructions, computations = parse_hlo(compiled.as_text())
    module = re.search(r"HloModule\s+([\w.\-]+)", compiled.as_text()).group(1)
    per_category = collections.Counter()
    unmatched = collections.Counter()
    for name, seconds in device_op_times(trace, module).items():
        if name in instructions and instructions[name][0] in _CONTAINERS:
            continue  # its body's ops have events of their own
        if name in instructions:
            per_category[category(instructions[name], computations)] += seconds / steps
        else:
            unmatched[name] += seconds / steps
    return {"device": str(jax.devices()[0].device_kind), "run": run,
            "steps": steps, "wall_s_per_step": wall_s,
            "unmatched_s_per_step": sum(unmatched.values()),
            # what the trace names that the compiled program's text does not: the first thing
            # to read when the categories come out empty (a jax whose names differ)
            "unmatched_top": dict(unmatched.most_common(10)),
            "op_s_per_step": {c: per_category.get(c, 0.0) for c in CATEGORIES},
            "trace": str(trace)}


def render(result: dict) -> str:
    ops = result["op_s_per_step"]
    total = sum(ops.values()) or 1.0
    impl, *settings = result["run"].split("+")
    lines = [f"{result['device']}: training step, attention {impl}"
             + "".join(f", {s}" for s in settings)
             + f"; wall {result['wall_s_per_step'] * 1e3:.1f} ms per step, device ops "
             f"{total * 1e3:.1f} ms (unmatched {result['unmatched_s_per_step'] * 1e3:.2f} ms)",
             "| category | ms per step | share |", "|---|---:|---:|"]
    for name in CATEGORIES:
        lines.append(f"| {name} | {ops[name] * 1e3:.2f} | {ops[name] / total:.1%} |")
    if result["unmatched_top"]:
        lines.append("unmatched: " + ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s
                                               in result["unmatched_top"].items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="cudnn", help="attention_impl (default cudnn)")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="settings of the model's execution or of the train: section, "
                             "e.g. remat=attention mu_dtype=bfloat16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run of small sizes")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = profile(TINY if args.tiny else FULL, "+".join([args.impl, *args.set]), args.steps,
                     out)
    (out / "profile.json").write_text(json.dumps(result, indent=2))
    print(render(result))


if __name__ == "__main__":
    main()
