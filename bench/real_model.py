"""A real instruct model against transformers on the same GGUF file: SmolLM2-135M-Instruct's
Q4_1 (`make chat` fetches it), both dequantized to float32.

    python bench/real_model.py [--gguf FILE] [--rounds 3] [--new-tokens 128]

- perplexity of this repository's README (its first 2,048 tokens): ours and transformers', which
  must agree (the same weights);
- decode tokens/s at batch 1 and 8, greedy, 128 new tokens after the chat-formatted question
  (each row the same prompt; no early stop), ours (`generate`, compile excluded) and
  transformers' `generate()` (KV cache, torch CPU);
- peak host memory while loading (ours, in a child process).

Each measurement runs in its own process; rounds alternate between the two sides and medians
are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_rss_bytes, run_child  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = Path.home() / ".cache" / "llama_jax" / "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def ours(gguf: Path, batch: int, new_tokens: int) -> dict:
    import numpy as np

    import llama_jax
    from llama_jax.data.chat import chat_format

    start_rss = peak_rss_bytes()
    config, params = llama_jax.load_checkpoint(gguf, "float32")
    load_mib = (peak_rss_bytes() - start_rss) / 2**20
    tokenizer = llama_jax.load_tokenizer(gguf)
    prompt = chat_format(gguf, tokenizer)(QUESTION)
    run = lambda: llama_jax.generate(config, params, [prompt] * batch, new_tokens,  # noqa: E731
                                     stop_tokens=[])
    run()  # compiles
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    text = tokenizer.encode((ROOT / "README.md").read_text())[:2048]
    logits = np.asarray(llama_jax.forward(config, params, np.array([text])), np.float64)[0]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                              keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -logp[np.arange(len(text) - 1), text[1:]].mean()
    return {"tokens_per_s": batch * new_tokens / seconds, "perplexity": float(np.exp(nll)),
            "load_peak_mib": load_mib, "prompt_tokens": len(prompt)}


def transformers_side(gguf: Path, batch: int, new_tokens: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompt = tokenizer(tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                                     tokenize=False)).input_ids
    ids = torch.tensor([prompt] * batch)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with torch.no_grad():
        model.generate(ids, **kwargs)  # warm-up
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        seconds = time.perf_counter() - start
        text = tokenizer((ROOT / "README.md").read_text()).input_ids[:2048]
        loss = model(torch.tensor([text]), labels=torch.tensor([text])).loss.item()
    return {"tokens_per_s": batch * new_tokens / seconds, "perplexity": float(torch.exp(
        torch.tensor(loss))), "prompt_tokens": len(prompt)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # side, batch
    args = parser.parse_args()
    if args.child:
        side, batch = args.child
        fn = ours if side == "ours" else transformers_side
        print(json.dumps(fn(args.gguf, int(batch), args.new_tokens)))
        return 0
    if not args.gguf.is_file():
        sys.exit(f"error: {args.gguf}: no such file (make chat fetches it)")
    results: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.rounds):
        for batch in (1, 8):
            for side in ("ours", "transformers"):
                results.setdefault((side, batch), []).append(run_child(
                    __file__, "--gguf", str(args.gguf), "--new-tokens", str(args.new_tokens),
                    "--child", side, str(batch)))
    print("| batch | ours tok/s | transformers tok/s | ratio | perplexity ours / transformers |")
    print("|---|---|---|---|---|")
    for batch in (1, 8):
        a = statistics.median(r["tokens_per_s"] for r in results[("ours", batch)])
        b = statistics.median(r["tokens_per_s"] for r in results[("transformers", batch)])
        p = results[("ours", batch)][0]["perplexity"], \
            results[("transformers", batch)][0]["perplexity"]
        print(f"| {batch} | {a:,.1f} | {b:,.1f} | {a / b:.2f}x | {p[0]:.4f} / {p[1]:.4f} |")
    print(f"peak host memory while loading (ours): "
          f"{statistics.median(r['load_peak_mib'] for r in results[('ours', 1)]):.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
