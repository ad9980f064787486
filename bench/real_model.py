"""A real instruct model on one GGUF file: SmolLM2-135M-Instruct's Q4_1 (`make chat` fetches
it), ours and transformers' dequantized to float32 (ours also as int8), and llama.cpp running
the file's Q4_1 blocks itself (llama-cpp-python, `make llama-cpp`; left out when not built).

    python bench/real_model.py [--gguf FILE] [--rounds 3] [--new-tokens 128]

- perplexity of this repository's README (its first 2,048 tokens): ours and transformers', which
  must agree (the same weights);
- decode tokens/s at batch 1 and 8, greedy, 128 new tokens after the chat-formatted question
  (each row the same prompt; no early stop; the prompt's prefill included): ours (`generate`,
  compile excluded), transformers' `generate()` (KV cache, torch CPU) and llama.cpp (2
  threads, the rows as 8 sequences of one batch through its C API, argmax of each row's
  logits);
- the weight bytes each reads per decode step, and how many of the first 50 greedy tokens
  each side shares with ours;
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


def chat_prompt(gguf: Path) -> list[int]:
    import llama_jax
    from llama_jax.data.chat import chat_format

    return chat_format(gguf, llama_jax.load_tokenizer(gguf))(QUESTION)


def ours(gguf: Path, batch: int, new_tokens: int, quantize: str | None = None) -> dict:
    import jax
    import numpy as np

    import llama_jax

    start_rss = peak_rss_bytes()
    config, params = llama_jax.load_checkpoint(gguf, "float32", quantize=quantize)
    load_mib = (peak_rss_bytes() - start_rss) / 2**20
    tokenizer = llama_jax.load_tokenizer(gguf)
    prompt = chat_prompt(gguf)
    run = lambda: llama_jax.generate(config, params, [prompt] * batch, new_tokens,  # noqa: E731
                                     stop_tokens=[])
    run()  # compiles
    start = time.perf_counter()
    tokens = run()
    seconds = time.perf_counter() - start
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    if quantize is not None:
        return {"tokens_per_s": batch * new_tokens / seconds, "tokens": list(tokens[0][:50]),
                "weight_mib": weight_bytes / 2**20}
    text = tokenizer.encode((ROOT / "README.md").read_text())[:2048]
    logits = np.asarray(llama_jax.forward(config, params, np.array([text])), np.float64)[0]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                              keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -logp[np.arange(len(text) - 1), text[1:]].mean()
    return {"tokens_per_s": batch * new_tokens / seconds, "perplexity": float(np.exp(nll)),
            "load_peak_mib": load_mib, "prompt_tokens": len(prompt),
            "tokens": list(tokens[0][:50]), "weight_mib": weight_bytes / 2**20}


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
        tokens = model.generate(ids, **kwargs)[0, len(prompt):].tolist()
        seconds = time.perf_counter() - start
        text = tokenizer((ROOT / "README.md").read_text()).input_ids[:2048]
        loss = model(torch.tensor([text]), labels=torch.tensor([text])).loss.item()
    return {"tokens_per_s": batch * new_tokens / seconds, "perplexity": float(torch.exp(
        torch.tensor(loss))), "prompt_tokens": len(prompt), "tokens": tokens[:50],
        "weight_mib": sum(p.nbytes for p in model.parameters()) / 2**20}


def llama_cpp_side(gguf: Path, batch: int, new_tokens: int) -> dict:
    """llama.cpp's greedy decode of `batch` copies of the prompt as one batch of sequences."""
    import gguf as gguf_package
    import llama_cpp as lc
    import numpy as np

    prompt = chat_prompt(gguf)  # llama.cpp's tokenizer gives the same ids (tests/test_llama_cpp)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
    params = lc.llama_context_default_params()
    per_row = -(-(len(prompt) + new_tokens) // 256) * 256
    params.n_ctx, params.n_seq_max = per_row * batch, batch
    params.n_batch = params.n_ubatch = max(512, batch * len(prompt))
    params.n_threads = params.n_threads_batch = 2
    ctx = lc.llama_init_from_model(model, params)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    step = lc.llama_batch_init(params.n_batch, 0, batch)

    def add(token: int, position: int, row: int, logits: bool) -> None:
        i = step.n_tokens
        step.token[i], step.pos[i], step.n_seq_id[i], step.logits[i] = token, position, 1, logits
        step.seq_id[i][0] = row
        step.n_tokens += 1

    def generate() -> list[list[int]]:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        step.n_tokens = 0
        for row in range(batch):
            for j, token in enumerate(prompt):
                add(token, j, row, j == len(prompt) - 1)
        outputs = [row * len(prompt) + len(prompt) - 1 for row in range(batch)]
        rows: list[list[int]] = [[] for _ in range(batch)]
        for n in range(new_tokens):
            if lc.llama_decode(ctx, step) != 0:
                raise RuntimeError("llama_decode failed")
            chosen = [int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i),
                                                shape=(n_vocab,)).argmax()) for i in outputs]
            step.n_tokens = 0
            for row, token in enumerate(chosen):
                rows[row].append(token)
                add(token, len(prompt) + n, row, True)
            outputs = list(range(batch))
        return rows

    generate()  # warm-up
    start = time.perf_counter()
    rows = generate()
    seconds = time.perf_counter() - start
    lc.llama_batch_free(step)
    weight_bytes = sum(t.n_bytes for t in gguf_package.GGUFReader(gguf).tensors)
    return {"tokens_per_s": batch * new_tokens / seconds, "tokens": rows[0][:50],
            "weight_mib": weight_bytes / 2**20}


SIDES = {"ours": ours, "ours-int8": lambda *a: ours(*a, quantize="int8"),
         "transformers": transformers_side, "llama.cpp": llama_cpp_side}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # side, batch
    args = parser.parse_args()
    if args.child:
        side, batch = args.child
        print(json.dumps(SIDES[side](args.gguf, int(batch), args.new_tokens)))
        return 0
    if not args.gguf.is_file():
        sys.exit(f"error: {args.gguf}: no such file (make chat fetches it)")
    sides = [side for side in SIDES if side != "llama.cpp" or _has_llama_cpp()]
    results: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.rounds):
        for batch in (1, 8):
            for side in sides:
                results.setdefault((side, batch), []).append(run_child(
                    __file__, "--gguf", str(args.gguf), "--new-tokens", str(args.new_tokens),
                    "--child", side, str(batch)))
    ours_tokens = results[("ours", 1)][0]["tokens"]
    print("| side | weights read per step | tok/s batch 1 | tok/s batch 8 | "
          "first 50 greedy tokens shared with ours |")
    print("|---|---|---|---|---|")
    for side in sides:
        speed = [statistics.median(r["tokens_per_s"] for r in results[(side, batch)])
                 for batch in (1, 8)]
        first = results[(side, 1)][0]
        shared = next((i for i, (a, b) in enumerate(zip(first["tokens"], ours_tokens))
                       if a != b), min(len(first["tokens"]), len(ours_tokens)))
        print(f"| {side} | {first['weight_mib']:.0f} MiB | {speed[0]:,.1f} | {speed[1]:,.1f} | "
              f"{shared} |")
    p = results[("ours", 1)][0]["perplexity"], results[("transformers", 1)][0]["perplexity"]
    print(f"perplexity of README.md, ours / transformers: {p[0]:.4f} / {p[1]:.4f}")
    print(f"peak host memory while loading (ours, float32): "
          f"{statistics.median(r['load_peak_mib'] for r in results[('ours', 1)]):.0f} MiB")
    return 0


def _has_llama_cpp() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None

if __name__ == "__main__":
    sys.exit(main())
