"""Long-context training on CPU: the dense (`xla`) and blockwise (`chunked`) attention
implementations on the demo model, step time and memory by sequence length.

    python bench/attention.py [--lengths 1024 4096 16384] [--rounds 3] [--steps 3]
    python bench/attention.py --fit [--budget-gib 24]

A step is train.py's: forward, backward, clipping and AdamW on the demo model (configs/demo.yaml:
D=256, L=6, N=4, K=2, F=768, V=8192), fp32, one document per row, 16,384 tokens per step (B =
16384 / T rows of T tokens), chunked with its default 512 x 512 blocks.
- step ms / tokens/s: median over `--steps` timed steps (2 untimed first, compile excluded);
- peak MiB: the process's peak RSS (VmHWM) above its RSS after imports;
- XLA MiB: arguments + temporaries of the compiled step (`memory_analysis()`). A step whose
  compiled size exceeds the memory available is not run ("does not fit").
Each (T, implementation) runs in its own process, implementations alternating, `--rounds`
times; medians. `--fit` finds, per implementation, the longest T (a multiple of 1024, one row)
whose compiled step fits in `--budget-gib`, by bisection on compiled sizes (nothing runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time

import jax
import numpy as np

from common import lm_train_step, peak_rss_bytes, rss_bytes, run_child, time_train_steps
from llama_jax.config import TrainConfig, load_model_config
from llama_jax.training.optim import make_optimizer
from llama_jax.training.step import init_state

TOKENS_PER_STEP = 16384
WARMUP_STEPS = 2
IMPLS = ("xla", "chunked")


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        line = next(line for line in f if line.startswith("MemAvailable:"))
    return int(line.split()[1]) * 1024


def compiled_step(impl: str, T: int, rows: int):
    config = dataclasses.replace(load_model_config("demo"), attention_impl=impl,
                                 max_seq_len=max(T, 512))
    train = TrainConfig(seq_len=T, batch_size=rows, steps=10_000, warmup_steps=100)
    optimizer = make_optimizer(config, train)
    init = jax.jit(functools.partial(init_state, config, optimizer))
    step = lm_train_step(config, train, optimizer)
    state = jax.eval_shape(init, jax.random.key(0))
    batch = jax.ShapeDtypeStruct((rows, T + 1), np.int32)
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    analysis = compiled.memory_analysis()
    size = analysis.argument_size_in_bytes + analysis.temp_size_in_bytes
    return init, compiled, size, time.perf_counter() - start


def run(impl: str, T: int, steps: int) -> dict:
    baseline = rss_bytes()
    rows = max(1, TOKENS_PER_STEP // T)
    init, compiled, size, compile_s = compiled_step(impl, T, rows)
    result = {"xla_mib": size / 2 ** 20, "compile_s": compile_s}
    if size > available_bytes():
        return {**result, "fits": False}
    window = np.random.default_rng(0).integers(3, 8192, (rows, T + 1)).astype(np.int32)
    window[:, 0] = 1  # BOS: one document per row
    state, batch = init(jax.random.key(0)), jax.numpy.asarray(window)
    times = time_train_steps(compiled, state, batch, WARMUP_STEPS, steps)
    return {**result, "fits": True, "step_s": statistics.median(times),
            "peak_mib": (peak_rss_bytes() - baseline) / 2 ** 20}


def longest_fitting(impl: str, budget: int) -> tuple[int, float]:
    """The longest T (multiple of 1024) whose one-row step compiles to at most `budget` bytes,
    and its compiled MiB."""
    def size(T):
        return compiled_step(impl, T, 1)[2]
    lo, hi = 1, 2  # in units of 1024 tokens: lo fits, hi is to be tried
    while size(hi * 1024) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid * 1024) <= budget else (lo, mid)
    return lo * 1024, size(lo * 1024) / 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--fit", action="store_true", help="longest T within --budget-gib")
    parser.add_argument("--budget-gib", type=float, default=24)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        impl, T, steps = args.worker
        print(json.dumps(run(impl, int(T), int(steps))))
        return
    if args.fit:
        print(f"longest context (one row, multiple of 1024) whose compiled demo-model step fits "
              f"in {args.budget_gib:g} GiB:")
        for impl in IMPLS:
            T, mib = longest_fitting(impl, int(args.budget_gib * 2 ** 30))
            print(f"| {impl} | {T:,} tokens | {mib:,.0f} MiB |", flush=True)
        return

    print(f"demo model, {TOKENS_PER_STEP} tokens per step, AdamW, fp32; median of "
          f"{args.rounds} rounds x {args.steps} steps, each (T, implementation) in its own "
          "process, alternating")
    print("| T | rows | xla step ms | chunked step ms | chunked / xla time | xla peak MiB | "
          "chunked peak MiB | xla XLA MiB | chunked XLA MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in args.lengths:
        results = {impl: [] for impl in IMPLS}
        for _ in range(args.rounds):
            for impl in IMPLS:
                results[impl].append(run_child(__file__, "--worker", impl, str(T),
                                               str(args.steps)))
        cells = {}
        for impl, rs in results.items():
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "fits"}
            cells[impl] = med if rs[0]["fits"] else {"xla_mib": med["xla_mib"]}
        x, c = cells["xla"], cells["chunked"]

        def ms(cell):
            return f"{cell['step_s'] * 1e3:,.0f}" if "step_s" in cell else "does not fit"

        def peak(cell):
            return f"{cell['peak_mib']:,.0f}" if "peak_mib" in cell else "—"
        ratio = (f"{c['step_s'] / x['step_s']:.2f}" if "step_s" in x and "step_s" in c
                 else "—")
        print(f"| {T:,} | {max(1, TOKENS_PER_STEP // T)} | {ms(x)} | {ms(c)} | {ratio} | "
              f"{peak(x)} | {peak(c)} | {x['xla_mib']:,.0f} | {c['xla_mib']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
