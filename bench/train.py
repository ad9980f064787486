"""Training throughput: llama_jax's train step vs transformers' LlamaForCausalLM with torch AdamW
(CPU), and our MFU against the float32 matmul peak measured in the same run.

    python bench/train.py [--rounds 3] [--steps 5] [--computes float32 bfloat16] [--threads 2]

Same model and batch for both: D=512, L=8, N=8, K=4, F=1536, V=8192, seq 256, batch 8, random
tokens, fp32 parameters. One step = forward, backward, global-norm clipping (1.0) and an AdamW
update (weight decay 0.1), as train.py runs it (llama_jax: one jitted step with the state
donated; transformers: `model(ids, labels=ids)`, `loss.backward()`, `clip_grad_norm_`,
`AdamW.step()`, `zero_grad()`). "bfloat16" computes in bf16 with fp32 master weights (llama_jax's
`compute_dtype`; torch's CPU autocast).

- tokens/s: batch·seq / median step time (3 untimed steps first, compile excluded).
- MFU = 6·P_mm + 6·L·T·D FLOPs per token (causal attention, LM head counted) ×
  tokens/s / peak, peak = best rate of a jitted 1536³ fp32 matmul measured in the same process.
- peak MiB: the process's peak RSS (VmHWM) above its RSS after imports.
Each implementation runs in its own process, alternating, `--rounds` times; medians.
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

from common import (BENCH_MODEL, lm_train_step, peak_rss_bytes, rss_bytes, run_child,
                    time_torch_train_steps, time_train_steps)
from llama_jax.plan import costs, hardware
from llama_jax.config import TrainConfig
from llama_jax.training.optim import make_optimizer
from llama_jax.training.step import init_state

SEQ, BATCH = 256, 8
WARMUP_STEPS = 3
TRAIN = TrainConfig(seq_len=SEQ, batch_size=BATCH, steps=10_000, warmup_steps=100)


def random_batch() -> np.ndarray:
    window = np.random.default_rng(0).integers(3, BENCH_MODEL.vocab_size, (BATCH, SEQ + 1))
    window[:, 0] = 1  # BOS: one document per row, as the data pipeline packs them
    return window.astype(np.int32)


def run_ours(compute: str, steps: int) -> dict:
    baseline = rss_bytes()
    config = dataclasses.replace(BENCH_MODEL, compute_dtype=compute)
    optimizer = make_optimizer(config, TRAIN)
    state = jax.jit(functools.partial(init_state, config, optimizer))(jax.random.key(0))
    step = lm_train_step(config, TRAIN, optimizer)
    batch = jax.numpy.asarray(random_batch())
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    times = time_train_steps(compiled, state, batch, WARMUP_STEPS, steps)
    return {"step_s": times, "compile_s": compile_s,
            "peak_flops": hardware.measure_matmul_flops("float32"),
            "peak_mib": (peak_rss_bytes() - baseline) / 2 ** 20,
            "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2 ** 20}


def run_transformers(compute: str, steps: int, threads: int) -> dict:
    import torch
    import transformers

    baseline = rss_bytes()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    c = BENCH_MODEL
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=c.V, hidden_size=c.D, intermediate_size=c.F, num_hidden_layers=c.L,
        num_attention_heads=c.N, num_key_value_heads=c.K, max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps, tie_word_embeddings=False))
    ids = torch.as_tensor(random_batch()[:, :SEQ], dtype=torch.long)  # labels shift inside
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute == "bfloat16")
    times = time_torch_train_steps(model, ids, WARMUP_STEPS, steps, autocast)
    return {"step_s": times, "peak_mib": (peak_rss_bytes() - baseline) / 2 ** 20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--computes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, compute, steps = args.worker
        result = (run_ours(compute, int(steps)) if kind == "ours"
                  else run_transformers(compute, int(steps), args.threads))
        print(json.dumps(result))
        return

    tokens = BATCH * SEQ
    flops_per_token = costs.train_flops_per_token(BENCH_MODEL, SEQ)
    print(f"model D={BENCH_MODEL.D} L={BENCH_MODEL.L} N={BENCH_MODEL.N} K={BENCH_MODEL.K} "
          f"F={BENCH_MODEL.F} V={BENCH_MODEL.V}; batch {BATCH} x seq {SEQ}; AdamW; torch "
          f"threads {args.threads}; {flops_per_token / 1e6:.1f} MFLOP/token; median of "
          f"{args.rounds} rounds x {args.steps} steps, each implementation in its own process")
    print("| compute | ours tok/s | transformers tok/s | ratio | our MFU | fp32 peak GFLOP/s "
          "| ours step ms | transformers step ms | ours peak MiB | transformers peak MiB "
          "| our compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for compute in args.computes:
        ours: dict = {"step_s": [], "peak_flops": [], "peak_mib": [], "compile_s": []}
        theirs: dict = {"step_s": [], "peak_mib": []}
        for _ in range(args.rounds):
            for kind, into in (("ours", ours), ("hf", theirs)):
                result = run_child(__file__, "--worker", kind, compute, str(args.steps),
                                   "--threads", str(args.threads))
                for key, value in result.items():
                    if key in into:
                        into[key] += value if isinstance(value, list) else [value]
        med = {k: statistics.median(v) for k, v in ours.items()}
        hf = {k: statistics.median(v) for k, v in theirs.items()}
        ours_tps, hf_tps = tokens / med["step_s"], tokens / hf["step_s"]
        print(f"| {compute} | {ours_tps:.0f} | {hf_tps:.0f} | {ours_tps / hf_tps:.2f}x | "
              f"{flops_per_token * ours_tps / med['peak_flops']:.0%} | "
              f"{med['peak_flops'] / 1e9:.0f} | {med['step_s'] * 1e3:.0f} | "
              f"{hf['step_s'] * 1e3:.0f} | {med['peak_mib']:.0f} | {hf['peak_mib']:.0f} | "
              f"{med['compile_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
