"""A soak of the server (`make soak`): `python -m llama_jax.serve` on 127.0.0.1 under 64
concurrent clients for 10 minutes, then its answers checked against `generate` alone.

    python bench/soak.py [--minutes 10] [--clients 64] [--checked 48]

The model is a small random one (4 layers, 256 wide, vocabulary 320, a SentencePiece
tokenizer of 300 pieces), served with 8 rows over a pool of pages that holds 2 full rows and a
prefix cache of 1 more (so rows are preempted and requeued), and 32-token prefill chunks. Each
client loops until the time is up, each request drawn at random: a prompt of 8-300 tokens,
half of them after one of 4 shared 64-192-token prefixes; 1-120 new tokens; greedy or sampled
(temperature 0.8, top-p 0.95, a seed); a fifth with a stop string; a tenth with n=2; a tenth
streamed and cancelled after its first tokens. Every wait and request is bounded.

It passes when no request failed, no page is held once the server is idle beyond the prefix
cache's, the server's RSS grew less than 5% from the end of the first minute to the end, and
every checked response (`--checked` of those not cancelled, each choice) equals `generate`
alone with its seed, cut before its stop string. It prints one JSON line with the counts.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import jax

import llama_jax
from llama_jax.data.tokenizer import TextStream
from llama_jax.decode.generate import generate
from llama_jax.plan.costs import kv_cache_bytes_per_token

from serve import Server, free_port

MAX_SEQ_LEN = 512
CHUNK = 32
PAGE = 16
ROWS = 8
POOL_ROWS = 2  # the rows' pages hold this many --max-seq-len rows
PREFIX_ROWS = 1  # and the prefix cache's (rows may take them when it lets go of chunks)
REQUEST_TIMEOUT_S = 300
TEXT = ["The cat sat on the mat and looked at the dog.",
        "A dog is a good friend; a cat is a proud one.", "Numbers: 12 34 56 78 90."] * 40
STOPS = ["e", "at", " the", "\n"]


def checkpoint(root: Path) -> Path:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_writer=model,
                                   vocab_size=300, model_type="bpe", byte_fallback=True,
                                   minloglevel=2)
    config = llama_jax.ModelConfig(vocab_size=320, dim=256, n_layers=4, n_heads=4,
                                   n_kv_heads=2, ffn_dim=768, max_seq_len=MAX_SEQ_LEN,
                                   eos_ids=(2,))
    llama_jax.save_native(config, llama_jax.init_params(config, jax.random.key(0)),
                          root / "native")
    (root / "native" / "tokenizer.model").write_bytes(model.getvalue())
    return root / "native"


@dataclasses.dataclass
class Asked:
    prompt: list[int]
    max_tokens: int
    temperature: float
    seed: int
    n: int
    stop: str | None
    cancel: bool
    texts: list[str] | None = None


def draw(rng: random.Random, prefixes: list[list[int]]) -> Asked:
    own = [rng.randrange(3, 300) for _ in range(rng.randrange(8, 109))]
    prompt = (rng.choice(prefixes) + own) if rng.random() < 0.5 else own
    prompt = prompt[:MAX_SEQ_LEN - 121]
    return Asked(prompt, rng.randrange(1, 121), rng.choice([0.0, 0.8]), rng.randrange(1 << 30),
                 2 if rng.random() < 0.1 else 1,
                 rng.choice(STOPS) if rng.random() < 0.2 else None, rng.random() < 0.1)


async def one(client, asked: Asked) -> None:
    kwargs = dict(model="soak", prompt=asked.prompt, max_tokens=asked.max_tokens,
                  temperature=asked.temperature, top_p=0.95 if asked.temperature else 1.0,
                  seed=asked.seed, n=asked.n, stop=[asked.stop] if asked.stop else None)
    if asked.cancel:
        stream = await client.completions.create(stream=True, **kwargs)
        async for _ in stream:
            break  # the first tokens: hang up
        await stream.close()
        return
    out = await client.completions.create(**kwargs)
    choices = sorted(out.choices, key=lambda c: c.index)
    if any(c.finish_reason not in ("stop", "length") for c in choices):
        raise RuntimeError(f"finish reasons {[c.finish_reason for c in choices]}")
    asked.texts = [c.text for c in choices]


async def clients(url: str, n: int, seconds: float, seed: int, on_minute) -> tuple[list, int]:
    import openai

    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 300) for _ in range(rng.randrange(64, 193))]
                for _ in range(4)]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                timeout=REQUEST_TIMEOUT_S)
    done: list[Asked] = []
    errors: list[str] = []
    deadline = time.monotonic() + seconds

    async def loop(k: int) -> None:
        own = random.Random(seed * 1000 + k)
        while time.monotonic() < deadline:
            asked = draw(own, prefixes)
            try:
                await asyncio.wait_for(one(client, asked), REQUEST_TIMEOUT_S)
                done.append(asked)
            except Exception as e:  # every failure counts; the soak goes on
                errors.append(f"{type(e).__name__}: {e}")

    async def minute() -> None:
        await asyncio.sleep(60)
        on_minute()

    await asyncio.gather(minute(), *(loop(k) for k in range(n)))
    return done, errors


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def wait_idle(url: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{url}/health", timeout=10).json()
        if not health["requests_running"] and not health["requests_waiting"]:
            return health
        if time.monotonic() > deadline:
            raise RuntimeError(f"not idle after {timeout} s: {health}")
        time.sleep(1)


def expected(model, asked: Asked, choice: int) -> str:
    config, params, tokenizer = model
    (tokens,) = generate(config, params, [asked.prompt], asked.max_tokens,
                         temperature=asked.temperature,
                         top_p=0.95 if asked.temperature else 1.0, seed=asked.seed + choice)
    text = TextStream(tokenizer, asked.prompt)
    full = text.push(tokens) + text.flush()
    return full[:full.index(asked.stop)] if asked.stop and asked.stop in full else full


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--checked", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        native = checkpoint(Path(tmp))
        page_bytes = PAGE * kv_cache_bytes_per_token(llama_jax.load_checkpoint(native)[0],
                                                     "float32")
        row_bytes = MAX_SEQ_LEN // PAGE * page_bytes
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = Server([sys.executable, "-m", "llama_jax.serve", "--checkpoint", str(native),
                         "--host", "127.0.0.1", "--port", str(port),
                         "--served-model-name", "soak", "--max-batch", str(ROWS),
                         "--max-seq-len", str(MAX_SEQ_LEN), "--prefill-chunk", str(CHUNK),
                         "--page-size", str(PAGE), "--kv-cache-bytes", str(POOL_ROWS * row_bytes),
                         "--prefix-cache-bytes", str(PREFIX_ROWS * row_bytes),
                         "--max-queue", "1024", "--log-level", "warning"],
                        port, "serving soak on ")
        try:
            rss = {}
            done, errors = asyncio.run(clients(
                url, args.clients, args.minutes * 60, args.seed,
                lambda: rss.setdefault("warm", rss_bytes(server.process.pid))))
            health = wait_idle(url)
            rss["end"] = rss_bytes(server.process.pid)
        finally:
            server.stop()
        model = (*llama_jax.load_checkpoint(native), llama_jax.load_tokenizer(native))
        answered = [a for a in done if a.texts is not None]
        checked = random.Random(args.seed).sample(answered, min(args.checked, len(answered)))
        wrong = sum(text != expected(model, a, c)
                    for a in checked for c, text in enumerate(a.texts))
    leaked = health["kv_pages_used"] - health["prefix_cache_blocks_used"] * (CHUNK // PAGE)
    growth = rss["end"] / rss["warm"] - 1
    result = {"minutes": args.minutes, "clients": args.clients, "requests": len(done),
              "cancelled": len(done) - len(answered), "errors": len(errors),
              "first_errors": errors[:3], "preemptions": health["preemptions"],
              "prefix_cache_hits": health["prefix_cache_hits"], "pages_leaked": leaked,
              "rss_warm_mib": rss["warm"] >> 20, "rss_end_mib": rss["end"] >> 20,
              "rss_growth": round(growth, 4), "checked_choices": sum(len(a.texts)
                                                                     for a in checked),
              "wrong": wrong}
    print(json.dumps(result))
    return 0 if not errors and not leaked and growth < 0.05 and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
