"""Serving throughput and latency: `python -m llama_jax.serve` (continuous batching) under a
load of concurrent requests, against `generate` on the same requests one at a time and in
static batches, and against transformers' own OpenAI-compatible server (`transformers serve
--continuous-batching`, given as much KV cache as ours) when it runs here.

    python bench/serve.py [--requests 32] [--rounds 3] [--max-batch 8] [--steps-per-dispatch 4]
                          [--no-transformers] [--speculate]

The benchmark model (D=512, L=8, N=8, K=4, F=1536, V=8192, random fp32 weights) is saved once
with a small SentencePiece tokenizer; prompts are random pieces of that tokenizer, sampling is
greedy, and every implementation gets the same requests (text for the servers, its ids for
`generate`). Two workloads:

- mixed: `--requests` requests with prompts of 16-128 tokens and 16-128 new tokens each, all
  sent at once (the load generator is the `openai` async client, bounded in count and time,
  to 127.0.0.1 only).
- equal: the same number of requests of 64 prompt and 128 new tokens: full static batches are
  the best `generate` can do with `--max-batch` rows, the ceiling for the server's slots.

Peers on the same requests, each in its own process: `generate` one request at a time, and
`generate` on static batches of `--max-batch` requests in arrival order (a batch decodes until
its longest request is done; only the tokens asked for count). "engine" is the server's
continuous batching called in-process, without HTTP or a client: the part of the server's time
that the engine itself takes. Throughput = output tokens /
wall time from the first request sent to the last token received (compile excluded: every
program is warmed up first). For the servers, time to first token (TTFT) and time per output
token after the first (TPOT, per request) are reported as p50/p99. Rounds alternate the
implementations; medians are reported. Last, the decode steps that static batches and ideal
continuous batching (no row ever idle) need for the requests bound what the engine can gain.

`--speculate`: speculative decoding on vs off instead: the server with `--speculate ngram`,
and with a draft model (`--draft-checkpoint`: the benchmark model's first 2 of its 8 layers,
embedding and head; a draft that agrees with random weights more than any trained one could),
against the same server without either, round after round on the same requests (no peers).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import heapq
import io
import json
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np

import llama_jax
from llama_jax.decode.generate import generate
from llama_jax.plan.costs import SERVING_STEPS_PER_DISPATCH
from llama_jax.serve.engine import Engine
from llama_jax.serve.requests import Request

from common import BENCH_MODEL, run_child

MAX_SEQ_LEN = 320  # the longest request: about 128 prompt + 128 new tokens
PAGE = 32  # the KV-cache page of transformers' server, in tokens
BYTE_PIECES = 256  # a SentencePiece model with byte fallback: ids 3..258 are bytes
START_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 600
WORKLOADS = ("mixed", "equal")


def requests_of(workload: str, n: int, tokenizer, seed: int = 0) -> list[tuple]:
    """(prompt text, its ids, new tokens) of each request. The text joins random pieces of the
    tokenizer's own (not its byte pieces), so that any tokenizer of the same file reads it as
    about as many tokens; the ids are what this one reads."""
    rng = np.random.default_rng(seed)
    if workload == "mixed":
        lengths = rng.integers(16, 129, n), rng.integers(16, 129, n)
    else:
        lengths = np.full(n, 64), np.full(n, 128)
    pieces = range(BYTE_PIECES + 3, tokenizer.vocab_size)
    out = []
    for p, m in zip(*lengths):
        text = tokenizer.decode(rng.choice(pieces, p - 1).tolist())
        out.append((text, tokenizer.encode(text), int(m)))
    return out


def make_checkpoint(root: Path) -> Path:
    """The benchmark model with a SentencePiece tokenizer (whose EOS the model never sees in
    these prompts); HF files beside it for transformers."""
    import sentencepiece as spm

    model = io.BytesIO()
    text = ["The cat sat on the mat.", "A dog is a good friend.", "Numbers: 12 34 56."] * 40
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=model,
                                   vocab_size=300, model_type="bpe", byte_fallback=True,
                                   minloglevel=2)
    config = dataclasses.replace(BENCH_MODEL, eos_ids=(2,))
    params = llama_jax.init_params(config, jax.random.key(0))
    llama_jax.save_native(config, params, root / "native")
    (root / "native" / "tokenizer.model").write_bytes(model.getvalue())
    llama_jax.export_hf(config, params, root / "hf")
    shutil.copy(root / "native" / "tokenizer.model", root / "hf" / "tokenizer.model")
    layers = 2  # the draft of --speculate: the model's first layers
    llama_jax.save_native(dataclasses.replace(config, n_layers=layers), {
        **params, "groups": tuple(jax.tree.map(lambda w: w[:layers], g)
                                  for g in params["groups"])}, root / "draft")
    return root


# --------------------------------------------------------------------------- the servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process, started and stopped here, ready once `ready_line` is printed (or
    /health answers)."""

    def __init__(self, argv: list[str], port: int, ready_line: str | None):
        self.port = port
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.process.stdout:
                self.lines.append(line)
                if ready_line and line.startswith(ready_line):
                    ready.set()
            ready.set()
        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.wait(1.0):
            if ready_line is None and self._healthy():
                break
            if time.monotonic() > deadline:
                break
        if self.process.poll() is not None or not (ready.is_set() or self._healthy()):
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-20:]))

    def _healthy(self) -> bool:
        import httpx
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).is_success
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def ours(root: Path, max_batch: int, steps: int, *flags: str) -> Server:
    port = free_port()
    return Server([sys.executable, "-m", "llama_jax.serve", "--checkpoint",
                   str(root / "native"), "--port", str(port), "--served-model-name", "bench",
                   "--max-batch", str(max_batch), "--max-seq-len", str(MAX_SEQ_LEN),
                   "--steps-per-dispatch", str(steps), "--max-queue", "1024",
                   "--log-level", "warning", *flags], port, "serving bench on ")


def transformers_server(root: Path, max_batch: int) -> Server:
    """transformers' server with as much KV cache as ours (`max_batch` sequences of
    MAX_SEQ_LEN tokens, in pages of PAGE tokens): by default it would run every request at
    once, each in the pages it needs."""
    port = free_port()
    return Server([str(Path(sys.executable).with_name("transformers")), "serve",
                   str(root / "hf"), "--port", str(port), "--host", "127.0.0.1",
                   "--device", "cpu", "--continuous-batching",
                   "--cb-block-size", str(PAGE),
                   "--cb-num-blocks", str(max_batch * MAX_SEQ_LEN // PAGE),
                   "--cb-max-batch-tokens", str(max_batch * MAX_SEQ_LEN)], port, None)


def batching_bound(requests, max_batch: int) -> tuple[int, int]:
    """Decode steps of (static batches of `max_batch` in arrival order, each as long as its
    longest request; continuous batching on `max_batch` rows in arrival order with no row ever
    idle): the most that continuous batching can gain on these requests when every step costs
    the same whatever its rows hold."""
    new = [m for *_, m in requests]
    static = sum(max(new[i:i + max_batch]) for i in range(0, len(new), max_batch))
    rows = [0] * max_batch  # when each row is next free
    for m in new:
        heapq.heappush(rows, heapq.heappop(rows) + m)
    return static, max(rows)


async def load(port: int, model: str, requests, timeout_s: float) -> dict:
    """All requests at once, streamed; throughput and latencies. A request's time per output
    token (TPOT) is (its last chunk - its first) / (its tokens - 1)."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                  max_retries=0, timeout=REQUEST_TIMEOUT_S) as client:
        async def one(prompt, new):
            sent, first, last, tokens, chunks = time.perf_counter(), None, None, 0, 0
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=new, temperature=0, stream=True,
                stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if chunk.choices:  # a chunk of tokens (their text may be empty: most of
                    last = time.perf_counter()  # the model's ids are past the tokenizer's)
                    first = first or last
                    chunks += 1
            return sent, first, last, tokens or chunks  # no usage: a chunk per token

        start = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(one(t, m) for t, _, m in requests)),
                                         timeout_s)
    wall = max(last for _, _, last, _ in results if last) - start
    ttft = [first - sent for sent, first, _, _ in results if first]
    tpot = [(last - first) / (n - 1) for _, first, last, n in results if first and n > 1]
    tokens = sum(n for *_, n in results)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
            "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
            "tpot_p50_ms": 1e3 * float(np.percentile(tpot, 50)),
            "tpot_p99_ms": 1e3 * float(np.percentile(tpot, 99))}


# ---------------------------------------------------------------------- generate, in a child

def engine_run(engine: Engine, requests) -> tuple[int, float]:
    """All requests submitted at once to a running engine: (tokens, seconds until the last)."""
    done, tokens = threading.Semaphore(0), []

    def deliver(chunk):
        tokens.append(len(chunk.tokens))
        if chunk.finish_reason or chunk.error:
            done.release()
    start = time.perf_counter()
    for prompt, new in requests:
        engine.submit(Request(prompt, new, deliver))
    for _ in requests:
        if not done.acquire(timeout=REQUEST_TIMEOUT_S):
            raise RuntimeError("the engine did not finish the requests")
    return sum(tokens), time.perf_counter() - start


def generate_worker(root: Path, workload: str, n: int, max_batch: int, steps: int) -> dict:
    """`generate` on the workload one at a time and in static batches, and the server's engine
    without HTTP (each warmed up)."""
    config, params = llama_jax.load_checkpoint(root / "native")
    requests = [(ids, m) for _, ids, m in requests_of(
        workload, n, llama_jax.load_tokenizer(root / "native"))]
    batches = [requests[i:i + max_batch] for i in range(0, len(requests), max_batch)]

    def run_batch(batch):
        generate(config, params, [p for p, _ in batch], max(m for _, m in batch),
                 stop_tokens=[])

    out = {}
    for name, units in (("one_at_a_time", [[r] for r in requests]), ("static", batches)):
        for unit in units:
            run_batch(unit)  # untimed: every program this mode meets is compiled
        start = time.perf_counter()
        for unit in units:
            run_batch(unit)
        wall = time.perf_counter() - start
        tokens = sum(m for _, m in requests)
        out[name] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}
    engine = Engine(config, params, max_batch=max_batch, max_seq_len=MAX_SEQ_LEN, stop_ids=[],
                    steps_per_dispatch=steps, max_queue=len(requests))
    engine.warm_up()
    engine.start()
    try:
        engine_run(engine, requests)  # untimed
        tokens, wall = engine_run(engine, requests)
    finally:
        engine.stop()
    out["engine"] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}
    return out


# ---------------------------------------------------------------------------------- main

def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--steps-per-dispatch", type=int, default=SERVING_STEPS_PER_DISPATCH)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--speculate", action="store_true",
                        help="the server with --speculate ngram and with a draft model "
                             "against it without, only")
    parser.add_argument("--worker", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def median(rounds: list[dict], key: str):
    values = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(values) if values else None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(generate_worker(Path(args.root), args.worker, args.requests,
                                         args.max_batch, args.steps_per_dispatch)))
        return 0
    root = make_checkpoint(Path(tempfile.mkdtemp(prefix="bench_serve_")))
    print(f"# {platform.processor() or platform.machine()}, jax {jax.__version__}, "
          f"{args.requests} requests, --max-batch {args.max_batch}, --steps-per-dispatch "
          f"{args.steps_per_dispatch}, {args.rounds} rounds", flush=True)
    tokenizer = llama_jax.load_tokenizer(root / "native")
    workloads = {w: requests_of(w, args.requests, tokenizer) for w in WORKLOADS}
    results: dict = {}

    def record(name, workload, result):
        results.setdefault((name, workload), []).append(result)

    if args.speculate:
        speculation(root, args, workloads)
        return 0
    server = ours(root, args.max_batch, args.steps_per_dispatch)
    try:
        for w in WORKLOADS:  # warm the server's caches and connections
            asyncio.run(load(server.port, "bench", workloads[w][:args.max_batch], 600))
        for round_ in range(args.rounds):
            for w in WORKLOADS:
                record("ours", w, asyncio.run(load(server.port, "bench", workloads[w], 1800)))
                peers = run_child(__file__, "--worker", w, "--root", str(root),
                                  "--requests", str(args.requests),
                                  "--max-batch", str(args.max_batch),
                                  "--steps-per-dispatch", str(args.steps_per_dispatch))
                for name, result in peers.items():
                    record(name if name == "engine" else f"generate {name}", w, result)
            print(f"# round {round_ + 1} done", flush=True)
    finally:
        server.stop()
    if not args.no_transformers:
        try:
            peer = transformers_server(root, args.max_batch)
        except (RuntimeError, OSError) as e:
            print(f"# transformers serve did not run here: {str(e).splitlines()[0]}")
        else:
            try:
                for w in WORKLOADS:
                    asyncio.run(load(peer.port, str(root / "hf"), workloads[w][:2], 1800))
                for _ in range(args.rounds):
                    for w in WORKLOADS:
                        record("transformers serve", w, asyncio.run(load(
                            peer.port, str(root / "hf"), workloads[w], 3600)))
            except Exception as e:  # the peer's failure is reported, not ours
                print(f"# transformers serve failed: {type(e).__name__}: {e}")
            finally:
                peer.stop()
    report(results)
    for w in WORKLOADS:
        static, continuous = batching_bound(workloads[w], args.max_batch)
        print(f"# {w}: static batches decode {static} steps; continuous batching with no row "
              f"ever idle, {continuous}: at most {static / continuous:.2f}x on decode")
    shutil.rmtree(root, ignore_errors=True)
    return 0


def speculation(root: Path, args, workloads: dict) -> None:
    """The server without speculation, with `--speculate ngram` and with a draft model,
    alternating, on the same requests."""
    flags = {"ours": (), "ours --speculate ngram": ("--speculate", "ngram"),
             "ours --draft-checkpoint": ("--draft-checkpoint", str(root / "draft"))}
    servers = {name: ours(root, args.max_batch, args.steps_per_dispatch, *f)
               for name, f in flags.items()}
    results: dict = {}
    try:
        for server in servers.values():
            for w in WORKLOADS:
                asyncio.run(load(server.port, "bench", workloads[w][:args.max_batch], 600))
        for round_ in range(args.rounds):
            for w in WORKLOADS:
                for name, server in servers.items():
                    results.setdefault((name, w), []).append(
                        asyncio.run(load(server.port, "bench", workloads[w], 1800)))
            print(f"# round {round_ + 1} done", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    report(results)
    shutil.rmtree(root, ignore_errors=True)


def report(results: dict) -> None:
    print("\n| workload | implementation | tokens/s | ours vs it | TTFT p50 / p99 ms | "
          "TPOT p50 / p99 ms |\n|---|---|---|---|---|---|")
    for w in WORKLOADS:
        base = median(results.get(("ours", w), []), "tokens_per_s")
        for (name, workload), rounds in results.items():
            if workload != w:
                continue
            tps = median(rounds, "tokens_per_s")
            lat = lambda k: (f"{median(rounds, k + '_p50_ms'):.0f} / "  # noqa: E731
                             f"{median(rounds, k + '_p99_ms'):.0f}"
                             if median(rounds, k + "_p50_ms") is not None else "")
            print(f"| {w} | {name} | {tps:.1f} | {base / tps:.2f}x | {lat('ttft')} | "
                  f"{lat('tpot')} |")


if __name__ == "__main__":
    sys.exit(main())
