"""The server's prefix cache, chunked prefill and shared prefill of `n` choices, on against off:
two servers of the same build (`python -m llama_jax.serve`, bench/serve.py's model and
tokenizer, --max-seq-len 2048, 8 slots), loaded in turn, round after round; medians.

    python bench/serve_features.py [--rounds 3] [--chunks 128] [--max-batch 8]

"on" is the default server (--prefill-chunk C and its prefix cache; one server per C in
--chunks); "off" has --no-prefix-cache and --prefill-chunk 2048 (a prompt in one program, as
before chunking). Prompts are token ids (random, never EOS), sampling greedy unless said, all
to 127.0.0.1 with the `openai` async client, every request and wait bounded:

- shared: 32 requests of one 256-token prefix and 16-64 tokens of their own, 32 new tokens
  each: time to first token (TTFT) p50 sent one at a time, and throughput sent at once.
- chunked: 7 streams of 32-token prompts decoding 256 tokens; once each has its first tokens,
  a 1,536-token prompt arrives (16 new tokens). The 7 streams' gaps between deliveries (p99
  against median, over the whole run) and the long prompt's TTFT.
- mixed: bench/serve.py's mixed workload (32 requests, 16-128 prompt and new tokens, no
  shared prefixes): throughput, the features' cost where they cannot help.
- n=4: a 256-token prompt, 16 new tokens sampled, as one request with n=4 against 4 separate
  requests at once (seeds s..s+3), both on "off" (no cache: four prefills); wall time, and
  the prefill chunks /metrics counts for each.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import jax
import numpy as np

import llama_jax

from common import BENCH_MODEL, medians
from serve import REQUEST_TIMEOUT_S, Server, free_port, load, make_checkpoint, requests_of

MAX_SEQ_LEN = 2048
OFF_CHUNK = 2048  # one chunk per prompt
EOS = 2


def server(root: Path, max_batch: int, *flags: str) -> Server:
    port = free_port()
    return Server([sys.executable, "-m", "llama_jax.serve", "--checkpoint",
                   str(root / "native"), "--port", str(port), "--served-model-name", "bench",
                   "--max-batch", str(max_batch), "--max-seq-len", str(MAX_SEQ_LEN),
                   "--max-queue", "1024", "--log-level", "warning", *flags],
                  port, "serving bench on ")


def ids(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(EOS + 1, vocab, n).tolist()


def client(port: int):
    import openai

    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                              max_retries=0, timeout=REQUEST_TIMEOUT_S)


async def stream(api, prompt, max_tokens: int, **sampling) -> dict:
    """One streamed completion: when it was sent and when each delivery arrived."""
    sent, arrivals, tokens = time.perf_counter(), [], 0
    response = await api.completions.create(
        model="bench", prompt=prompt, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, **{"temperature": 0, **sampling})
    async for chunk in response:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices:
            arrivals.append(time.perf_counter())
    return {"sent": sent, "arrivals": arrivals, "tokens": tokens}


async def shared(port: int, prompts: list[list[int]]) -> dict:
    async with client(port) as api:
        ttft = []
        for prompt in prompts:  # one at a time
            r = await stream(api, prompt, 32)
            ttft.append(r["arrivals"][0] - r["sent"])
        start = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(
            *(stream(api, p, 32) for p in prompts)), REQUEST_TIMEOUT_S)
    wall = max(r["arrivals"][-1] for r in results) - start
    return {"ttft_c1_p50_ms": 1e3 * statistics.median(ttft),
            "tokens_per_s": sum(r["tokens"] for r in results) / wall}


async def chunked(port: int, short: list[list[int]], long: list[int]) -> dict:
    async with client(port) as api:
        streams = [asyncio.ensure_future(stream(api, p, 256)) for p in short]
        # The long prompt arrives once every stream is decoding (bounded wait).
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while not all(s.done() for s in streams) and time.monotonic() < deadline:
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            in_use = [line for line in metrics.splitlines()
                      if line.startswith("llama_jax_slots_in_use ")]
            if in_use and float(in_use[0].split()[1]) >= len(short):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        arrival = await asyncio.wait_for(stream(api, long, 16), REQUEST_TIMEOUT_S)
        results = await asyncio.wait_for(asyncio.gather(*streams), REQUEST_TIMEOUT_S)
    gaps = np.concatenate([np.diff(r["arrivals"]) for r in results])
    return {"gap_p50_ms": 1e3 * float(np.median(gaps)),
            "gap_p99_ms": 1e3 * float(np.percentile(gaps, 99)),
            "gap_max_ms": 1e3 * float(gaps.max()),
            "long_ttft_ms": 1e3 * (arrival["arrivals"][0] - arrival["sent"])}


def prefill_chunks(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("llama_jax_prefill_chunks_total "))


async def n_choices(port: int, prompt: list[int], seed: int) -> dict:
    async with client(port) as api:
        before = prefill_chunks(port)
        start = time.perf_counter()
        await api.completions.create(model="bench", prompt=prompt, max_tokens=16, n=4,
                                     temperature=1.0, seed=seed)
        together = time.perf_counter() - start
        middle = prefill_chunks(port)
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(
            api.completions.create(model="bench", prompt=prompt, max_tokens=16,
                                   temperature=1.0, seed=seed + j) for j in range(4))),
            REQUEST_TIMEOUT_S)
        apart = time.perf_counter() - start
    return {"n4_s": together, "separate_s": apart, "n4_chunks": middle - before,
            "separate_chunks": prefill_chunks(port) - middle}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", default="128", help="--prefill-chunk of each 'on' server")
    parser.add_argument("--max-batch", type=int, default=8)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    root = make_checkpoint(Path(tempfile.mkdtemp(prefix="bench_features_")))
    vocab = BENCH_MODEL.vocab_size
    tokenizer = llama_jax.load_tokenizer(root / "native")

    def workloads(round_: int) -> dict:
        """Fresh prompts each round (a cache warmed by an earlier round would flatter "on"):
        the shared prefix misses once per round."""
        rng = np.random.default_rng(round_)
        prefix = ids(rng, 256, vocab)
        return {"shared": [prefix + ids(rng, int(n), vocab) for n in rng.integers(16, 65, 32)],
                "short": [ids(rng, 32, vocab) for _ in range(args.max_batch - 1)],
                "long": ids(rng, 1536, vocab), "n": ids(rng, 256, vocab),
                "mixed": requests_of("mixed", 32, tokenizer, seed=round_)}
    print(f"# {platform.processor() or platform.machine()}, jax {jax.__version__}, "
          f"--max-batch {args.max_batch}, {args.rounds} rounds", flush=True)
    names = [f"on (chunk {c})" for c in args.chunks.split(",")] + ["off"]
    servers = {}
    try:
        for name, chunk in zip(names, args.chunks.split(",")):
            start = time.perf_counter()
            servers[name] = server(root, args.max_batch, "--prefill-chunk", chunk)
            print(f"# {name}: started in {time.perf_counter() - start:.0f} s", flush=True)
        servers["off"] = server(root, args.max_batch, "--no-prefix-cache", "--prefill-chunk",
                                str(OFF_CHUNK))
        results: dict = {name: [] for name in servers}
        for round_ in range(args.rounds + 1):  # round 0 warms every path up, untimed
            w = workloads(round_)
            for name, live in servers.items():
                port = live.port
                r = asyncio.run(shared(port, w["shared"]))
                r |= asyncio.run(chunked(port, w["short"], w["long"]))
                r |= {"mixed_tokens_per_s": asyncio.run(load(port, "bench", w["mixed"], 1800))[
                    "tokens_per_s"]}
                if name == "off":
                    r |= asyncio.run(n_choices(port, w["n"], 100 * round_))
                if round_:
                    results[name].append(r)
            print(f"# round {round_} done", flush=True)
    finally:
        for live in servers.values():
            live.stop()
    report(results)
    shutil.rmtree(root, ignore_errors=True)
    return 0


def report(results: dict) -> None:
    med = medians(results)
    off = med["off"]
    print("\n| server | shared TTFT p50 (c=1) ms | shared tok/s (c=32) | 7 streams' gap p50 / "
          "p99 / max ms | 1,536-token TTFT ms | mixed tok/s |\n|---|---|---|---|---|---|")
    ratio = lambda m, k: f"{m[k]:.0f} ({m[k] / off[k]:.2f}x)"  # noqa: E731
    for name, m in med.items():
        print(f"| {name} | {ratio(m, 'ttft_c1_p50_ms')} | {ratio(m, 'tokens_per_s')} | "
              f"{m['gap_p50_ms']:.0f} / {m['gap_p99_ms']:.0f} / {m['gap_max_ms']:.0f} "
              f"(p99 {m['gap_p99_ms'] / m['gap_p50_ms']:.1f}x p50) | "
              f"{ratio(m, 'long_ttft_ms')} | {ratio(m, 'mixed_tokens_per_s')} |")
    print(f"\nn=4 of a 256-token prompt (off): {off['n4_s']:.2f} s for one request of n=4 "
          f"({off['n4_chunks']:.0f} prefill) against {off['separate_s']:.2f} s for 4 requests "
          f"({off['separate_chunks']:.0f} prefills): {off['n4_s'] / off['separate_s']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
