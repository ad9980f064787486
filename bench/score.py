"""Log-likelihood scoring throughput (what lm-eval's multiple-choice tasks spend their time
on): `llama_jax.score` vs transformers scoring the same requests the way lm-eval's HF model
(HFLM) does.

    python bench/score.py [--rounds 3] [--requests 256] [--batch-size 32] [--dtype float32]

Same model for both (D=512, L=8, N=8, K=4, F=1536, V=8192, random weights, exported once from
llama_jax to a HF directory). Requests are multiple-choice shaped: 64 contexts of 64–448
random tokens, each with 4 continuations of 1–16 tokens. transformers (torch CPU) gets HFLM's
algorithm: requests sorted by length (longest first), batches of `--batch-size` right-padded
to the longest row with an attention mask, one forward, log-softmax, the continuation's
log-probabilities gathered and summed, greedy = every continuation token is the argmax. Ours
is `score` as lm-eval's adapter calls it. Each implementation runs in its own process,
rounds alternate, medians are reported; the first call of each process (our compile) is not
timed. The log-probabilities of the two are compared request by request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import llama_jax

from common import BENCH_MODEL, run_child

CONTEXTS, CHOICES = 64, 4


def requests(n: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(0)
    contexts, continuations = [], []
    while len(contexts) < n:
        context = [1] + rng.integers(3, BENCH_MODEL.vocab_size, rng.integers(63, 448)).tolist()
        for _ in range(CHOICES):
            contexts.append(context)
            continuations.append(rng.integers(3, BENCH_MODEL.vocab_size,
                                              rng.integers(1, 17)).tolist())
    return contexts[:n], continuations[:n]


def run_ours(hf_dir: str, n: int, batch_size: int, dtype: str, repeats: int) -> dict:
    config, params = llama_jax.load_checkpoint(hf_dir, dtype=dtype)
    contexts, continuations = requests(n)
    llama_jax.score(config, params, contexts, continuations, batch_size=batch_size)  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        scores = llama_jax.score(config, params, contexts, continuations, batch_size=batch_size)
        times.append(time.perf_counter() - start)
    return {"seconds": times, "logprobs": [s.logprob for s in scores],
            "greedy": [s.greedy for s in scores]}


def run_transformers(hf_dir: str, n: int, batch_size: int, dtype: str, repeats: int,
                     threads: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=getattr(torch, dtype)).eval()
    contexts, continuations = requests(n)
    # HFLM: the model reads context + continuation[:-1]; longest first
    inputs = [(c + k)[:-1] for c, k in zip(contexts, continuations)]
    order = sorted(range(n), key=lambda i: -len(inputs[i]))

    def run() -> tuple[list[float], list[bool]]:
        logprobs, greedy = [0.0] * n, [False] * n
        for start in range(0, n, batch_size):
            batch = order[start:start + batch_size]
            T = max(len(inputs[i]) for i in batch)
            ids = torch.zeros((len(batch), T), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(batch):
                ids[row, :len(inputs[i])] = torch.tensor(inputs[i])
                mask[row, :len(inputs[i])] = 1
            with torch.no_grad():
                logits = model(ids, attention_mask=mask).logits.float()
            log_p = torch.log_softmax(logits, dim=-1)
            for row, i in enumerate(batch):
                K = len(continuations[i])
                end = len(inputs[i])
                rows = log_p[row, end - K:end]
                target = torch.tensor(continuations[i])
                logprobs[i] = float(rows.gather(1, target[:, None]).sum())
                greedy[i] = bool((rows.argmax(-1) == target).all())
        return logprobs, greedy

    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        logprobs, greedy = run()
        times.append(time.perf_counter() - start)
    return {"seconds": times, "logprobs": logprobs, "greedy": greedy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per round")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, hf_dir = args.worker
        common = (hf_dir, args.requests, args.batch_size, args.dtype, args.repeats)
        result = run_ours(*common) if kind == "ours" else run_transformers(*common,
                                                                           args.threads)
        print(json.dumps(result))
        return

    hf_dir = str(Path(tempfile.mkdtemp()) / "hf")
    llama_jax.export_hf(BENCH_MODEL, llama_jax.init_params(BENCH_MODEL, jax.random.key(0)),
                        hf_dir)
    contexts, continuations = requests(args.requests)
    tokens = sum(len(c) + len(k) - 1 for c, k in zip(contexts, continuations))
    flags = ["--requests", str(args.requests), "--batch-size", str(args.batch_size), "--dtype",
             args.dtype, "--repeats", str(args.repeats), "--threads", str(args.threads)]
    seconds = {"ours": [], "transformers": []}
    last = {}
    for _ in range(args.rounds):
        for kind in seconds:
            last[kind] = run_child(__file__, *flags, "--worker", kind, hf_dir)
            seconds[kind] += last[kind]["seconds"]
    ours, theirs = (statistics.median(seconds[k]) for k in ("ours", "transformers"))
    difference = np.abs(np.subtract(last["ours"]["logprobs"], last["transformers"]["logprobs"]))
    agree = np.mean(np.equal(last["ours"]["greedy"], last["transformers"]["greedy"]))
    print(f"model D={BENCH_MODEL.D} L={BENCH_MODEL.L} V={BENCH_MODEL.V} {args.dtype}; "
          f"{args.requests} requests ({tokens:,} tokens read), batch {args.batch_size}; torch "
          f"threads {args.threads}; median of {args.rounds} rounds x {args.repeats} calls")
    print("| implementation | seconds | requests/s | tokens/s |")
    print("|---|---|---|---|")
    for name, s in (("llama_jax.score", ours), ("transformers (HFLM's method)", theirs)):
        print(f"| {name} | {s:.2f} | {args.requests / s:.1f} | {tokens / s:,.0f} |")
    print(f"ratio (ours / transformers, throughput): {theirs / ours:.2f}x; log-probabilities "
          f"differ by at most {difference.max():.2e} nats (median {np.median(difference):.1e});"
          f" greedy flags agree on {agree:.0%} of requests")


if __name__ == "__main__":
    main()
