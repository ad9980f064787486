"""Decode throughput: llama_jax `generate` vs transformers `generate()` (KV cache, torch CPU),
and against the memory-bandwidth floor measured in the same run.

    python bench/decode.py [--rounds 3] [--repeats 3] [--batches 1 8] [--prompt 128]
                           [--cases float32/float32 float32/bfloat16 bfloat16/bfloat16]
                           [--impls unrolled scan] [--pythons PY [PY ...]] [--no-peer]

Same model for both (D=512, L=8, N=8, K=4, F=1536, V=8192, random weights, exported once from
llama_jax to a HF directory), a random prompt of `--prompt` tokens per row, 128 new tokens,
greedy, no early stop. A case is weights / our KV-cache dtype; weights `int8` are the bf16
model quantized while loading (`quantize="int8"`: block matmul weights), cache `int8` an int8
KV cache; transformers runs the float dtype (bf16 for int8 weights; its cache is the model's).
After the table, the int8 cases' step times are given as ratios to the bf16 ones (weights:
int8/bfloat16 vs bfloat16/bfloat16; cache: bfloat16/int8 vs bfloat16/bfloat16). Ours runs under each decode implementation (`--impls`: the unrolled loop over per-layer
weights that "auto" picks on CPU and GPU, and the lax.scan over stacked weights). Runs
alternate between the implementations and the bandwidth probe so they share the machine's
noise; medians are reported. `--pythons` runs ours under each of several interpreters (e.g.
the venvs of two JAX releases) in the same alternation; the jax column names the release.

- tokens/s: B·128 new tokens / wall time of the whole call (prefill included, compile excluded).
- step ms: our decode time per step after the first token.
- floor ms: (weight bytes read per step, int8 values and scales counted as stored, + KV-cache
  bytes at the mean context of prompt + 64 tokens) / bandwidth, where bandwidth is a jitted `sum` over a 1 GiB fp32 array (read-only traffic).
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
NEW = 128
# Untimed runs first: on this VM the first seconds after allocating run up to 2x slower.
WARMUP_RUNS = 3


def weights_of(case: str) -> tuple[str, str | None, str]:
    """(float dtype, quantize, cache dtype) of a case "weights/cache"."""
    weights, cache_dtype = case.split("/")
    return ("bfloat16", "int8", cache_dtype) if weights == "int8" else (weights, None,
                                                                         cache_dtype)


def floor_seconds(config, case: str, batch: int, prompt: int, bandwidth: float) -> float:
    dtype, quantize, cache_dtype = weights_of(case)
    config = config.with_execution(quantize=quantize)
    return costs.decode_bytes_per_step(config, batch, prompt + NEW // 2, dtype,
                                       cache_dtype) / bandwidth


def run_ours(hf_dir: str, case: str, batch: int, prompt: int, repeats: int, impl: str) -> dict:
    dtype, quantize, cache_dtype = weights_of(case)
    config, params = llama_jax.load_checkpoint(hf_dir, dtype=dtype, quantize=quantize)
    prompts = np.random.default_rng(batch).integers(0, CONFIG.vocab_size, (batch, prompt))
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


def run_transformers(hf_dir: str, case: str, batch: int, prompt: int, repeats: int, impl: str,
                     threads: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(threads)
    dtype = weights_of(case)[0]  # transformers' cache is in the model's dtype
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.as_tensor(np.random.default_rng(batch).integers(0, CONFIG.vocab_size,
                                                                (batch, prompt)))

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


def worker(kind: str, hf_dir: str, case: str, batch: int, prompt: int, repeats: int,
           threads: int, impl: str = "-", python: str = sys.executable) -> dict:
    return run_child(__file__, "--worker", kind, hf_dir, case, str(batch), str(prompt),
                     str(repeats), impl, "--threads", str(threads), python=python)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternations of the two implementations")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per round")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument("--cases", nargs="+", default=["float32/float32", "float32/bfloat16",
                                                         "bfloat16/bfloat16"],
                        help="weights (a float dtype, or int8) / our KV-cache dtype (a float "
                             "dtype, or int8)")
    parser.add_argument("--impls", nargs="+", default=["unrolled", "scan"],
                        help="our decode implementations")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--pythons", nargs="+", default=[sys.executable],
                        help="interpreters to run ours under (each with llama_jax installed)")
    parser.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, hf_dir, case, batch, prompt, repeats, impl = args.worker
        run = run_ours if kind == "ours" else functools.partial(run_transformers,
                                                                threads=args.threads)
        print(json.dumps(run(hf_dir, case, int(batch), int(prompt), int(repeats), impl)))
        return
    if args.prompt + NEW > CONFIG.max_seq_len:
        parser.error(f"--prompt {args.prompt} + {NEW} new tokens exceed the model's "
                     f"max_seq_len {CONFIG.max_seq_len}")

    hf_dir = str(Path(tempfile.mkdtemp()) / "hf")
    llama_jax.export_hf(CONFIG, llama_jax.init_params(CONFIG, jax.random.key(0)), hf_dir)
    print(f"model D={CONFIG.D} L={CONFIG.L} N={CONFIG.N} K={CONFIG.K} F={CONFIG.F} "
          f"V={CONFIG.V}; prompt {args.prompt}, new {NEW}, greedy; torch threads "
          f"{args.threads}; median of {args.rounds} rounds x {args.repeats} runs, each "
          f"implementation in its own process; transformers under Python "
          f"{platform.python_version()}, jax {jax.__version__} beside it")
    print("| batch | weights / our cache | jax | decode impl | ours tok/s | transformers tok/s "
          "| ratio | ours step ms | floor ms | % of floor | bandwidth GB/s | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    runs = [(case, python, impl) for case in args.cases for python in args.pythons
            for impl in args.impls]
    for batch in args.batches:
        # Every case in every round, so that the ratios between cases share the noise.
        ours = {run: {"tokens_per_s": [], "step_s": [], "bandwidth": [], "compile_s": []}
                for run in runs}
        versions = {}
        hf: dict[str, list[float]] = {case: [] for case in args.cases}
        for _ in range(args.rounds):
            for case, python, impl in runs:
                result = worker("ours", hf_dir, case, batch, args.prompt, args.repeats,
                                args.threads, impl, python)
                for key in ("tokens_per_s", "step_s", "bandwidth"):
                    ours[case, python, impl][key] += result[key]
                ours[case, python, impl]["compile_s"].append(result["compile_s"])
                versions[python] = result["jax"]
            for case in hf if not args.no_peer else ():
                hf[case] += worker("hf", hf_dir, case, batch, args.prompt, args.repeats,
                                   args.threads)["tokens_per_s"]
        step = {}
        for case, python, impl in runs:
            med = {k: statistics.median(v) for k, v in ours[case, python, impl].items()}
            step[case, python, impl] = med["step_s"]
            floor = floor_seconds(CONFIG, case, batch, args.prompt, med["bandwidth"])
            peer = (f"{statistics.median(hf[case]):.0f} | "
                    f"{med['tokens_per_s'] / statistics.median(hf[case]):.2f}x"
                    if hf[case] else "- | -")
            print(f"| {batch} | {case} | {versions[python]} | {impl} | "
                  f"{med['tokens_per_s']:.0f} | {peer} | {med['step_s'] * 1e3:.2f} | "
                  f"{floor * 1e3:.2f} | {100 * floor / med['step_s']:.0f}% | "
                  f"{med['bandwidth'] / 1e9:.1f} | {med['compile_s']:.2f} |", flush=True)
        for (case, python, impl), seconds in step.items():
            base = ("bfloat16/bfloat16", python, impl)
            if "int8" in case and base in step:
                print(f"batch {batch}, {impl}: {case} step / bfloat16/bfloat16 step = "
                      f"{seconds / step[base]:.2f}", flush=True)


if __name__ == "__main__":
    main()
