"""Paged KV cache at equal memory: a server whose pages hold `--dense-rows` rows of the full
2,048-token context (what a cache reserved per row at --max-seq-len allows in that memory)
against one of the same pages admitting up to `--max-batch` rows by free pages; both
`python -m llama_jax.serve` of this build, bench/serve.py's model and tokenizer, loaded in
turn, round after round; medians.

    python bench/serve_pages.py [--rounds 3] [--dense-rows 2] [--max-batch 8]

Workload: bench/serve.py's mixed traffic (32 requests of 16-128 prompt and new tokens, sent
at once with the `openai` async client to 127.0.0.1, every request and wait bounded):
throughput, and the rows decoding at once (`llama_jax_requests_running`, sampled every 50 ms
while the load runs: mean and most), and the preemptions /metrics counts.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import jax

import llama_jax
from llama_jax.plan.costs import SERVING_PAGE_SIZE, kv_cache_bytes_per_token
from llama_jax.plan.serving import ServerShape

from common import BENCH_MODEL, medians
from serve import Server, free_port, load, make_checkpoint, requests_of

MAX_SEQ_LEN = 2048
CACHE_DTYPE = "float32"


def server(root: Path, max_batch: int, kv_cache_bytes: int) -> Server:
    port = free_port()
    return Server([sys.executable, "-m", "llama_jax.serve", "--checkpoint",
                   str(root / "native"), "--port", str(port), "--served-model-name", "bench",
                   "--max-batch", str(max_batch), "--max-seq-len", str(MAX_SEQ_LEN),
                   "--kv-cache-bytes", str(kv_cache_bytes), "--cache-dtype", CACHE_DTYPE,
                   "--no-prefix-cache", "--max-queue", "1024", "--log-level", "warning"],
                  port, "serving bench on ")


def gauge(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith(f"{name} "))


def measured(port: int, requests: list) -> dict:
    """The mixed load's throughput, the rows running while it ran and its preemptions."""
    running, done = [], threading.Event()

    def sample():
        while not done.wait(0.05):
            running.append(gauge(port, "llama_jax_requests_running"))
    sampler = threading.Thread(target=sample, daemon=True)
    before = gauge(port, "llama_jax_preemptions_total")
    sampler.start()
    try:
        result = asyncio.run(load(port, "bench", requests, 1800))
    finally:
        done.set()
        sampler.join(10)
    busy = [r for r in running if r > 0] or [0.0]
    return {"tokens_per_s": result["tokens_per_s"], "rows_mean": statistics.mean(busy),
            "rows_max": max(busy),
            "preemptions": gauge(port, "llama_jax_preemptions_total") - before}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dense-rows", type=int, default=2,
                        help="full-context rows the KV memory holds")
    parser.add_argument("--max-batch", type=int, default=8)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    root = make_checkpoint(Path(tempfile.mkdtemp(prefix="bench_pages_")))
    tokenizer = llama_jax.load_tokenizer(root / "native")
    page = SERVING_PAGE_SIZE * kv_cache_bytes_per_token(BENCH_MODEL, CACHE_DTYPE)
    memory = ServerShape.of(BENCH_MODEL.max_seq_len, page, max_batch=args.dense_rows,
                            max_seq_len=MAX_SEQ_LEN).rows_bytes
    print(f"# {platform.processor() or platform.machine()}, jax {jax.__version__}, "
          f"{memory / 2**20:.0f} MiB of KV pages, {args.rounds} rounds", flush=True)
    names = {f"{args.dense_rows} rows (a full context each)": args.dense_rows,
             f"up to {args.max_batch} rows by pages": args.max_batch}
    results: dict = {name: [] for name in names}
    servers = {}
    try:
        for name, max_batch in names.items():
            start = time.perf_counter()
            servers[name] = server(root, max_batch, memory)
            print(f"# {name}: started in {time.perf_counter() - start:.0f} s", flush=True)
        for round_ in range(args.rounds + 1):  # round 0 warms every path up, untimed
            requests = requests_of("mixed", 32, tokenizer, seed=round_)
            figures = {name: measured(live.port, requests) for name, live in servers.items()}
            for name in figures if round_ else ():
                results[name].append(figures[name])
            print(f"# round {round_} done", flush=True)
    finally:
        for live in servers.values():
            live.stop()
        shutil.rmtree(root, ignore_errors=True)
    report(medians(results))
    return 0


def report(med: dict) -> None:
    base = next(iter(med.values()))
    print("\n| server | mixed tok/s | rows decoding (mean / most) | preemptions |\n"
          "|---|---|---|---|")
    for name, m in med.items():
        speed = m["tokens_per_s"] / base["tokens_per_s"]
        print(f"| {name} | {m['tokens_per_s']:.0f} ({speed:.2f}x)"
              f" | {m['rows_mean']:.1f} / {m['rows_max']:.0f} "
              f"({m['rows_mean'] / base['rows_mean']:.2f}x) | {m['preemptions']:.0f} |")


if __name__ == "__main__":
    sys.exit(main())
