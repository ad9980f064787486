"""Quality of int8 inference: validation perplexity and greedy agreement of int8 weights, an
int8 KV cache and both, against the bf16 model with a bf16 cache.

    python bench/quantize_quality.py [--checkpoint runs/demo] [--windows 64] [--prompts 16]

The checkpoint is a training run (the demo's by default: `make demo`); its validation split
(the run's corpus and val_fraction, tokenized with its tokenizer) is cut into `--windows`
windows of the run's seq_len, each scored in one pass (`llama_jax.perplexity`, through a KV
cache of the variant's dtype, as the decoder reads a prompt). Greedy agreement: the first 32
tokens of `--prompts` windows are decoded greedily for 64 new tokens under every variant; the
number of tokens until the first one that differs from the bf16 model's is reported.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

import llama_jax
from llama_jax.data.corpus import corpus_tokens
from llama_jax.formats.workdir import run_config

VARIANTS = {  # name: (weights quantized, KV-cache dtype)
    "bf16 weights, bf16 cache": (None, "bfloat16"),
    "int8 weights, bf16 cache": ("int8", "bfloat16"),
    "bf16 weights, int8 cache": (None, "int8"),
    "int8 weights, int8 cache": ("int8", "int8"),
}
PROMPT, NEW = 32, 64


def validation_windows(checkpoint: str, n: int) -> tuple[np.ndarray, int]:
    """The first `n` windows of seq_len tokens of the run's validation split."""
    run = run_config(Path(checkpoint))
    tokenizer = llama_jax.load_tokenizer(checkpoint)
    tokens = corpus_tokens(run.data.corpus, run.data.val_fraction, tokenizer,
                           lambda _: None).val
    T = run.train.seq_len
    n = min(n, len(tokens) // T)
    return tokens[:n * T].astype(np.int32).reshape(n, T), T


def greedy_agreement(reference: list[list[int]], other: list[list[int]]) -> list[int]:
    """Per prompt: tokens until the first that differs (all of them when none does)."""
    agree = []
    for a, b in zip(reference, other):
        differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        agree.append(differ[0] if differ else min(len(a), len(b)))
    return agree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="runs/demo")
    parser.add_argument("--windows", type=int, default=64, help="validation windows scored")
    parser.add_argument("--prompts", type=int, default=16, help="greedy-agreement prompts")
    args = parser.parse_args()
    windows, T = validation_windows(args.checkpoint, args.windows)
    print(f"checkpoint {args.checkpoint}: {len(windows)} validation windows of {T} tokens; "
          f"greedy agreement over {args.prompts} prompts of {PROMPT} tokens, {NEW} new")
    print("| variant | perplexity | vs bf16 | greedy tokens until divergence: mean, median, "
          "min | all agree |")
    print("|---|---|---|---|---|")
    baseline_ppl, baseline_tokens = None, None
    prompts = windows[:args.prompts, :PROMPT].tolist()
    for name, (quantize, cache_dtype) in VARIANTS.items():
        config, params = llama_jax.load_checkpoint(args.checkpoint, "bfloat16",
                                                   quantize=quantize)
        scored = llama_jax.perplexity(config, params, windows.tolist(), window=T,
                                      cache_dtype=cache_dtype)
        ppl = float(np.exp(sum(p.nll for p in scored) / sum(p.n_tokens for p in scored)))
        tokens = llama_jax.generate(config, params, prompts, NEW, stop_tokens=[],
                                    cache_dtype=cache_dtype)
        baseline_ppl = baseline_ppl or ppl
        baseline_tokens = baseline_tokens or tokens
        agree = greedy_agreement(baseline_tokens, tokens)
        print(f"| {name} | {ppl:.4f} | {100 * (ppl / baseline_ppl - 1):+.2f}% | "
              f"{statistics.mean(agree):.1f}, {statistics.median(agree):.0f}, {min(agree)} | "
              f"{sum(a == NEW for a in agree)}/{len(agree)} |", flush=True)


if __name__ == "__main__":
    main()
