"""Speculative decoding on vs off, in one run: what a verify pass costs, and the speed-up of
prompt lookup and of a draft model on the demo model.

    python bench/speculate.py [--rounds 3] [--checkpoint runs/demo]
                              [--draft runs/demo-draft] [--k 4] [--new 128]
                              [--verify-model bench|gpu] [--verify-k K ...] [--out FILE]
                              [--prompts FILE | --save-prompts FILE]

1. Verify cost: the benchmark model (D=512, L=8, random weights, fp32; `--verify-model gpu`:
   bench/gpu.py's D=2048, L=16 in bf16) with the unrolled decoder at batch 1 and 8 with 192
   cached tokens: one pass of k + 1 tokens against the cache (rows at their own ends) over
   one decode step.
2. Generation, batch 1, greedy, `--new` tokens without early stop, on the demo model (`make
   demo`) and passages of the demo corpus's validation split (192 tokens from a paragraph a
   third of the way into a document):
   - repeat: a passage, a blank line, and the passage's first 16 tokens again: the model
     goes on copying (input-grounded output, as a summary's or an edit's);
   - continue: the passage's first 192 tokens, continued;
   - unrelated: the passage's first 24 tokens, continued (little to look up: auto-off).
   Modes: off, ngram (prompt lookup), draft (the `--draft` checkpoint, `make demo-draft`;
   skipped when absent). tokens/s is new tokens / (time to first token + decode), compile
   excluded; rounds alternate the modes; medians over passages and rounds. accepted: guesses
   kept / guesses verified; ratio: tokens/s over off's.

On a machine without the corpus (a lent GPU), `--save-prompts FILE` writes the workloads'
prompts where the corpus is, and `--prompts FILE` reads them there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np

import llama_jax
from llama_jax.data.corpus import DEFAULT_CORPUS, find_corpus, read_document
from llama_jax.decode.decoder import owned_decoder_params
from llama_jax.decode.generate import GenerationStats, generate
from llama_jax.model.kv_cache import init_cache
from llama_jax.model.transformer import apply, unstack_layers
from llama_jax.nn.heads import lm_head

from common import BENCH_MODEL
from gpu import BIG

VERIFY_MODELS = {"bench": (BENCH_MODEL, "float32"), "gpu": (BIG, "bfloat16")}

WORKLOADS = ("repeat", "continue", "unrelated")


def verify_cost(model: str, ks: list[int], repeats: int = 30) -> dict[int, dict]:
    """Milliseconds of a decode step and of a verify pass of k + 1 tokens for each k, per
    batch, and each pass's ratio to the step."""
    config, dtype = VERIFY_MODELS[model]
    config = config.with_execution(param_dtype=dtype, compute_dtype=dtype)
    params = unstack_layers(llama_jax.init_params(config, jax.random.key(0)))

    def forward(params, tokens_BT, cache):
        h_BTD, cache, _ = apply(config, params, tokens_BT, cache=cache)
        return lm_head(config, params, h_BTD), cache

    run = jax.jit(forward, donate_argnums=2)
    lengths = [1] + [k + 1 for k in ks]
    out = {}
    for B in (1, 8):
        tokens = np.random.default_rng(0).integers(0, config.vocab_size, (B, 192))
        cache = init_cache(config, B, 512, dtype, layout="per_layer")
        _, cache = run(params, tokens, cache)
        cache = cache.with_row_ends()
        times: dict[int, list[float]] = {T: [] for T in lengths}
        for T in lengths * 2:  # alternating: every length sees the same drift
            for i in range(repeats + 3):
                start = time.perf_counter()
                logits, cache = run(params, tokens[:, :T], cache)
                logits.block_until_ready()
                if i >= 3:
                    times[T].append(time.perf_counter() - start)
                cache = cache.replace(end=cache.end - T)  # the same context every time
        step = statistics.median(times[1]) * 1e3
        verify = {k: statistics.median(times[k + 1]) * 1e3 for k in ks}
        out[B] = {"step_ms": step, "verify_ms": verify,
                  "ratio": {k: ms / step for k, ms in verify.items()}}
    return out


def prompts(tokenizer, n_passages: int) -> dict[str, list[list[int]]]:
    """Each workload's prompts from passages of 192 tokens of the validation documents, from
    the first paragraph a third of the way in (past the title's header lines)."""
    corpus = find_corpus(DEFAULT_CORPUS, 0.05)
    passages = []
    for path in corpus.val:
        text = read_document(path)
        middle = text.find("\n\n", len(text) // 3)
        tokens = tokenizer.encode(text[middle:].strip(), bos=False)
        if middle >= 0 and len(tokens) >= 192:
            passages.append(tokens[:192])
        if len(passages) == n_passages:
            break
    bos = [tokenizer.bos_id]
    blank = tokenizer.encode("\n\n", bos=False)
    return {"repeat": [bos + p + blank + p[:16] for p in passages],
            "continue": [bos + p for p in passages],
            "unrelated": [bos + p[:24] for p in passages]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passages", type=int, default=4)
    parser.add_argument("--checkpoint", default="runs/demo")
    parser.add_argument("--draft", default="runs/demo-draft")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--verify-model", choices=tuple(VERIFY_MODELS), default="bench")
    parser.add_argument("--prompts", help="the workloads' prompts from this JSON file")
    parser.add_argument("--save-prompts", help="write the workloads' prompts here and stop")
    parser.add_argument("--verify-k", type=int, nargs="*", default=[],
                        help="more guess counts whose verify pass to time, beside --k")
    parser.add_argument("--out", help="also write the results' JSON to this file")
    args = parser.parse_args()
    if args.save_prompts:
        tokenizer = llama_jax.load_tokenizer(args.checkpoint)
        Path(args.save_prompts).write_text(json.dumps(prompts(tokenizer, args.passages)))
        return

    cost = verify_cost(args.verify_model, sorted({args.k, *args.verify_k}))
    for B, row in cost.items():
        for k, ms in row["verify_ms"].items():
            print(f"verify of {k + 1} tokens, batch {B}: step {row['step_ms']:.2f} ms, "
                  f"verify {ms:.2f} ms, ratio {row['ratio'][k]:.2f}")

    config, params = llama_jax.load_checkpoint(args.checkpoint)
    params, impl = owned_decoder_params(params, "auto")
    modes = {"off": {}, "ngram": {"speculate": "ngram"}}
    if Path(args.draft).exists():
        draft_config, draft_params = llama_jax.load_checkpoint(args.draft)
        modes["draft"] = {"draft": (draft_config, owned_decoder_params(draft_params, impl)[0])}
    workloads = (json.loads(Path(args.prompts).read_text()) if args.prompts else
                 prompts(llama_jax.load_tokenizer(args.checkpoint), args.passages))
    rates: dict = {}
    kept: dict = {}
    for _ in range(args.rounds):
        for workload, batch in workloads.items():
            for prompt in batch:
                for mode, how in modes.items():
                    stats = GenerationStats()
                    for _ in range(2):  # the first call compiles
                        stats = GenerationStats()
                        generate(config, params, [prompt], args.new, stop_tokens=[],
                                 num_speculative_tokens=args.k, stats=stats, **how)
                    rates.setdefault((workload, mode), []).append(stats.tokens_per_s)
                    counts = kept.setdefault((workload, mode), [0, 0])
                    counts[0] += stats.accepted_tokens
                    counts[1] += stats.drafted_tokens
    table = []
    print(f"\n{'workload':10} {'mode':6} {'tokens/s':>9} {'ratio':>6} {'accepted':>9}")
    for (workload, mode), values in rates.items():
        tps = statistics.median(values)
        ratio = tps / statistics.median(rates[(workload, "off")])
        accepted, drafted = kept[(workload, mode)]
        rate = f"{accepted / drafted:.0%}" if drafted else "-"
        print(f"{workload:10} {mode:6} {tps:9.1f} {ratio:6.2f} {rate:>9}")
        table.append(dict(workload=workload, mode=mode, tokens_per_s=tps, ratio=ratio,
                          accepted=accepted, drafted=drafted))
    result = json.dumps({"device": str(jax.devices()[0].device_kind), "verify": cost,
                         "generate": table})
    print(result)
    if args.out:
        Path(args.out).write_text(result)


if __name__ == "__main__":
    main()
