"""What runs between decode steps: a `jax.profiler` trace of `generate` on the GPU benchmark
model (bench/gpu.py's decode: bf16 weights and cache, greedy, random prompts), per step.

    python bench/profile_decode.py [--impl scan] [--batch 1] [--tiny] [--out DIR]

From the trace's events of the decode program (the jitted while loop after the first token):
- device busy ms per step: the union of its kernels' intervals, against the wall-clock step
  (`GenerationStats.decode_s` / steps). The difference is time the GPU waited: launches, the
  loop condition read back by the host, anything between kernels;
- kernels and host<->device copies per step (a memcpy per step is the loop's condition);
- the instructions that took the most device time, by HLO name (`dynamic-slice`/`copy` ones
  in a scan over layers are weights copied out of the stacked arrays).

XLA runs without command buffers (CUDA graphs) while a profiler is attached, unless told
otherwise: this script tells it (`--xla_enable_command_buffers_during_profiling=true`), so the
trace shows the program as it runs unprofiled. Kernels inside a graph may then be credited to
the command-buffer thunk rather than to their own HLO instructions.

Bytes per step over the measured step give the achieved bandwidth; `bench/gpu.py` compares it
with the copy bandwidth. Prints a summary and writes profile_decode.json and the trace under
`--out` (default $OUT, else .). `--tiny` is a CPU dry run (its "kernels" are the CPU
executor's op events). Set XLA_FLAGS or LLAMA_JAX_GPU_FLAGS=0 to profile other settings.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import time
from pathlib import Path

import jax
import numpy as np

import llama_jax
from gpu import BF16, FULL, TINY, decode_prompts
from llama_jax.decode.generate import GenerationStats
from llama_jax.plan import costs

PROFILE_GRAPHS = "--xla_enable_command_buffers_during_profiling=true"


def module_events(trace_path: Path, module: str) -> tuple[list, list]:
    """(kernel events, memcpy events) of the HLO module whose name contains `module`:
    complete ("X") events with an `hlo_op` of that module, and the copies whose name says
    memcpy within the span of those kernels. On a GPU only the device's rows count (the
    trace's process names "/device:GPU:..."); a CPU trace has none, and all of its rows do."""
    with gzip.open(trace_path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") ==
                "process_name" and "/device:GPU" in (e.get("args") or {}).get("name", "")}
    complete = [e for e in events if e.get("ph") == "X" and (not gpu_pids or e["pid"] in gpu_pids)]
    kernels = [e for e in complete if module in (e.get("args") or {}).get("hlo_module", "")
               and (e.get("args") or {}).get("hlo_op")]
    if not kernels:
        return [], []
    first, last = min(e["ts"] for e in kernels), max(e["ts"] + e.get("dur", 0) for e in kernels)
    copies = [e for e in complete if "memcpy" in e.get("name", "").lower()
              and first <= e["ts"] <= last]
    return kernels, copies


def busy_s(events: list) -> float:
    """Seconds covered by the union of the events' [ts, ts + dur) intervals."""
    total, end = 0.0, -np.inf
    for start, stop in sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events):
        if start > end:
            total, end = total + (stop - start), stop
        elif stop > end:
            total, end = total + (stop - end), stop
    return total / 1e6


def profile(plan, impl: str, batch: int, out: Path) -> dict:
    config = plan.big.with_execution(param_dtype=BF16, compute_dtype=BF16)
    params = llama_jax.init_params(config, jax.random.key(0))
    prompts = decode_prompts(plan, batch).tolist()

    def run(stats: GenerationStats) -> None:
        llama_jax.generate(config, params, prompts, plan.decode_new, stop_tokens=[],
                           decode_impl=impl, stats=stats)
    for _ in range(2):  # the first compiles
        run(GenerationStats())
    trace_dir, stats = out / "trace", GenerationStats()
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        start = time.perf_counter()
        run(stats)
        wall_s = time.perf_counter() - start
    trace = max(trace_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    kernels, copies = module_events(trace, "_decode")
    steps = plan.decode_new - 1
    by_op = collections.Counter()
    for e in kernels:
        by_op[e["args"]["hlo_op"]] += e.get("dur", 0) / 1e6 / steps
    bytes_per_step = costs.decode_bytes_per_step(
        config, batch, plan.decode_prompt + plan.decode_new // 2, BF16, BF16)
    return {"device": str(jax.devices()[0].device_kind), "impl": impl, "batch": batch,
            "xla_flags": os.environ.get("XLA_FLAGS"), "wall_s": wall_s,
            "step_s": stats.decode_s / steps, "busy_s_per_step": busy_s(kernels) / steps,
            "kernels_per_step": len(kernels) / steps, "memcpys_per_step": len(copies) / steps,
            "bytes_per_step": bytes_per_step,
            "top_ops_s_per_step": dict(by_op.most_common(15)), "trace": str(trace)}


def render(r: dict) -> str:
    step, busy = r["step_s"], r["busy_s_per_step"]
    lines = [f"{r['device']}: decode {r['impl']}, batch {r['batch']}; XLA_FLAGS {r['xla_flags']}",
             f"step {step * 1e3:.3f} ms, device busy {busy * 1e3:.3f} ms ({busy / step:.0%}), "
             f"{r['kernels_per_step']:.1f} kernels and {r['memcpys_per_step']:.2f} memcpys per "
             f"step; {r['bytes_per_step'] / step / 1e12:.2f} TB/s achieved "
             f"({r['bytes_per_step'] / 2 ** 20:.0f} MiB read per step)",
             "| instruction | ms per step |", "|---|---:|"]
    lines += [f"| {op} | {s * 1e3:.4f} |" for op, s in r["top_ops_s_per_step"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="scan", choices=["scan", "unrolled"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run of small sizes")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    # Read when JAX starts its backend, which nothing has asked for yet.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {PROFILE_GRAPHS}".strip()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = profile(TINY if args.tiny else FULL, args.impl, args.batch, out)
    (out / "profile_decode.json").write_text(json.dumps(result, indent=2))
    print(render(result))


if __name__ == "__main__":
    main()
