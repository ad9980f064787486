"""Multi-head Latent Attention at decode: step time and KV-cache bytes of the MLA demo model
against its GQA (the demo) and MHA versions, and MLA's absorbed decode against its expanded one.

    python bench/mla.py [--rounds 3] [--steps 20] [--contexts 512 4096] [--batches 1 8]

Models: configs/demo.yaml (GQA: 4 heads, 2 KV heads of 64), the same with 4 KV heads (MHA),
and configs/mla-demo.yaml (a 48-wide latent + a 16-wide RoPE key per token), random weights,
fp32 weights and cache, context window raised to fit. One decode step is timed at a time: B rows,
each with S tokens already in the cache (its contents do not matter to the time), one new
token each, under the unrolled decoder that `decode_impl="auto"` runs on CPU (per-layer
weights and caches), compiled once, `--steps` steps timed after three untimed ones. MLA runs
both ways: absorbed (scores against the cached latents; `mla_decode: absorbed`, the default)
and expanded (every step rebuilds the S cached tokens' per-head keys and values from the
latents, as training does). Each variant runs in its own process, the variants alternate
within each round, and medians are reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import llama_jax
from llama_jax.plan import costs
from llama_jax.model.kv_cache import init_cache
from llama_jax.model.transformer import apply, unstack_layers
from llama_jax.nn.heads import lm_head

from common import run_child

VARIANTS = ("gqa", "mha", "mla-absorbed", "mla-expanded")
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def config_of(variant: str, max_len: int) -> llama_jax.ModelConfig:
    demo = llama_jax.load_model_config(CONFIGS / "demo.yaml")
    if variant == "mha":
        demo = dataclasses.replace(demo, n_kv_heads=demo.n_heads)
    if variant.startswith("mla"):
        demo = llama_jax.load_model_config(CONFIGS / "mla-demo.yaml").with_execution(
            mla_decode=variant.split("-")[1])
    return dataclasses.replace(demo, max_seq_len=max_len)


def run_variant(variant: str, batch: int, context: int, steps: int) -> dict:
    warmup = 3
    config = config_of(variant, context + warmup + steps)
    params = unstack_layers(llama_jax.init_params(config, jax.random.key(0)))
    cache = init_cache(config, batch, context + warmup + steps, layout="per_layer")
    cache = cache.replace(end=jnp.asarray(context, jnp.int32))  # S tokens already cached

    @jax.jit
    def step(params, token_B1, cache):
        out = apply(config, params, token_B1, cache=cache)
        return jnp.argmax(lm_head(config, params, out.hidden_BTD)[:, -1], -1)[:, None], out.cache

    token = jnp.asarray(np.random.default_rng(0).integers(0, config.V, (batch, 1)), jnp.int32)
    start = time.perf_counter()
    token, cache = jax.block_until_ready(step(params, token, cache))
    compile_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        token, cache = step(params, token, cache)
    jax.block_until_ready(token)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        token, cache = jax.block_until_ready(step(params, token, cache))
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "compile_s": compile_s,
            "cache_bytes_per_token": costs.kv_cache_bytes_per_token(config, "float32")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per run")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        variant, batch, context, steps = args.worker
        print(json.dumps(run_variant(variant, int(batch), int(context), int(steps))))
        return

    print(f"demo-sized models, fp32 weights and cache, unrolled decoder; median step of "
          f"{args.steps} x {args.rounds} rounds, each variant in its own process")
    print("| B | S | variant | KV cache B/token | cache at B x S | step ms | vs GQA | "
          "compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for context in args.contexts:
        for batch in args.batches:
            runs = {v: [] for v in args.variants}
            for _ in range(args.rounds):
                for v in args.variants:
                    runs[v].append(run_child(__file__, "--worker", v, str(batch), str(context),
                                             str(args.steps)))
            step = {v: statistics.median(r["step_s"] for r in runs[v]) for v in args.variants}
            for v in args.variants:
                per_token = runs[v][0]["cache_bytes_per_token"]
                vs = f"{step['gqa'] / step[v]:.2f}x" if "gqa" in step else "-"
                print(f"| {batch} | {context} | {v} | {per_token:,} | "
                      f"{per_token * batch * context / 2 ** 20:.1f} MiB | {step[v] * 1e3:.2f} | "
                      f"{vs} | {statistics.median(r['compile_s'] for r in runs[v]):.1f} |",
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
