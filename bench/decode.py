"""Decode throughput: llama_jax `generate` vs transformers `generate()` (KV cache, torch CPU),
and against the memory-bandwidth floor measured in the same run.

    python bench/decode.py [--rounds 3] [--repeats 3] [--batches 1 8]
                           [--cases float32/float32 float32/bfloat16 bfloat16/bfloat16]
                           [--impls unrolled scan] [--pythons PY [PY ...]]

Same model for both (D=512, L=8, N=8, K=4, F=1536, V=8192, random weights, exported once from
llama_jax to a HF directory), a 128-token random prompt per row, 128 new tokens, greedy, no early
stop. Ours runs under each decode implementation (`--impls`: the unrolled loop over per-layer
weights that "auto" picks on CPU, and the lax.scan over stacked weights of accelerators). Runs
alternate between the implementations and the bandwidth probe so they share the machine's
noise; medians are reported. `--pythons` runs ours under each of several interpreters (e.g.
the venvs of two JAX releases) in the same alternation; the jax column names the release.

- tokens/s: B·128 new tokens / wall time of the whole call (prefill included, compile excluded).
- step ms: our decode time per step after the first token.
- floor ms: (weight bytes read per step + KV-cache bytes at the mean context of 192 tokens) /
  bandwidth, where bandwidth is a jitted `sum` over a 1 GiB fp32 array (read-only traffic).
  The input-embedding table is gathered (B rows), not read; the LM head is read in full.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import llama_jax
from llama_jax.plan import costs
from llama_jax.decode.generate import GenerationStats, generate
from llama_jax.plan.hardware import bandwidth_probe

from common import BENCH_MODEL, run_child

CONFIG = BENCH_MODEL
PROMPT, NEW = 128, 128
# Untimed runs first: on this VM the first seconds after allocating run up to 2x slower.
WARMUP_RUNS = 3


def floor_seconds(config, weight_dtype: str, cache_dtype: str, batch: int,
                  bandwidth: float) -> float:
    weights = costs.decode_bytes_per_step(config, batch, 0, weight_dtype)
    kv = batch * (PROMPT + NEW // 2) * costs.kv_cache_bytes_per_token(config, cache_dtype)
    return (weights + kv) / bandwidth


def run_ours(hf_dir: str, case: str, batch: int, repeats: int, impl: str) -> dict:
    dtype, cache_dtype = case.split("/")
    config, params = llama_jax.load_checkpoint(hf_dir, dtype=dtype)
    prompts = np.random.default_rng(batch).integers(0, CONFIG.vocab_size, (batch, PROMPT))
    probe = bandwidth_probe()
    warm = GenerationStats()
    for _ in range(WARMUP_RUNS):
        generate(config, params, prompts.tolist(), NEW, stop_tokens=[], stats=warm,
                 cache_dtype=cache_dtype, decode_impl=impl)
    result = {"tokens_per_s": [], "step_s": [], "bandwidth": [], "compile_s": warm.compile_s,
              "jax": jax.__version__}
    for _ in range(repeats):
        stats = GenerationStats()
        start = time.perf_counter()
        out = generate(config, params, prompts.tolist(), NEW, stop_tokens=[], stats=stats,
                       cache_dtype=cache_dtype, decode_impl=impl)
        result["tokens_per_s"].append(batch * NEW / (time.perf_counter() - start))
        result["step_s"].append(stats.decode_s / (NEW - 1))
        result["bandwidth"].append(probe())
        assert all(len(o) == NEW for o in out)
    return result


def run_transformers(hf_dir: str, case: str, batch: int, repeats: int, impl: str,
                     threads: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(threads)
    dtype = case.split("/")[0]  # transformers' cache is in the model's dtype
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.as_tensor(np.random.default_rng(batch).integers(0, CONFIG.vocab_size,
                                                                (batch, PROMPT)))

    def run():
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                  min_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)

    for _ in range(WARMUP_RUNS):
        run()
    result = {"tokens_per_s": []}
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        result["tokens_per_s"].append(batch * NEW / (time.perf_counter() - start))
    return result


def worker(kind: str, hf_dir: str, case: str, batch: int, repeats: int, threads: int,
           impl: str = "-", python: str = sys.executable) -> dict:
    return run_child(__file__, "--worker", kind, hf_dir, case, str(batch), str(repeats), impl,
                     "--threads", str(threads), python=python)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternations of the two implementations")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per round")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--cases", nargs="+", default=["float32/float32", "float32/bfloat16",
                                                         "bfloat16/bfloat16"],
                        help="weight dtype / our KV-cache dtype")
    parser.add_argument("--impls", nargs="+", default=["unrolled", "scan"],
                        help="our decode implementations")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--pythons", nargs="+", default=[sys.executable],
                        help="interpreters to run ours under (each with llama_jax installed)")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, hf_dir, case, batch, repeats, impl = args.worker
        run = run_ours if kind == "ours" else functools.partial(run_transformers,
                                                                threads=args.threads)
        print(json.dumps(run(hf_dir, case, int(batch), int(repeats), impl)))
        return

    hf_dir = str(Path(tempfile.mkdtemp()) / "hf")
    llama_jax.export_hf(CONFIG, llama_jax.init_params(CONFIG, jax.random.key(0)), hf_dir)
    print(f"model D={CONFIG.D} L={CONFIG.L} N={CONFIG.N} K={CONFIG.K} F={CONFIG.F} "
          f"V={CONFIG.V}; prompt {PROMPT}, new {NEW}, greedy; torch threads "
          f"{args.threads}; median of {args.rounds} rounds x {args.repeats} runs, each "
          f"implementation in its own process; transformers under Python "
          f"{platform.python_version()}, jax {jax.__version__} beside it")
    print("| batch | weights / our cache | jax | decode impl | ours tok/s | transformers tok/s "
          "| ratio | ours step ms | floor ms | % of floor | bandwidth GB/s | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    runs = [(python, impl) for python in args.pythons for impl in args.impls]
    for case in args.cases:
        dtype, cache_dtype = case.split("/")
        for batch in args.batches:
            ours = {run: {"tokens_per_s": [], "step_s": [], "bandwidth": [], "compile_s": []}
                    for run in runs}
            versions = {}
            hf: list[float] = []
            for _ in range(args.rounds):
                for python, impl in runs:
                    result = worker("ours", hf_dir, case, batch, args.repeats, args.threads, impl,
                                    python)
                    for key in ("tokens_per_s", "step_s", "bandwidth"):
                        ours[python, impl][key] += result[key]
                    ours[python, impl]["compile_s"].append(result["compile_s"])
                    versions[python] = result["jax"]
                hf += worker("hf", hf_dir, case, batch, args.repeats,
                             args.threads)["tokens_per_s"]
            hf_tps = statistics.median(hf)
            for python, impl in runs:
                med = {k: statistics.median(v) for k, v in ours[python, impl].items()}
                floor = floor_seconds(CONFIG, dtype, cache_dtype, batch, med["bandwidth"])
                print(f"| {batch} | {case} | {versions[python]} | {impl} | "
                      f"{med['tokens_per_s']:.0f} | {hf_tps:.0f} | "
                      f"{med['tokens_per_s'] / hf_tps:.2f}x | {med['step_s'] * 1e3:.2f} | "
                      f"{floor * 1e3:.2f} | {100 * floor / med['step_s']:.0f}% | "
                      f"{med['bandwidth'] / 1e9:.1f} | {med['compile_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
