"""The data pipeline at pod scale: prepare's tokens/s per worker, the loader's tokens/s per
host against what a pod host needs, training start-up on a large prepared dataset, and
prepare's peak memory for a huge document and for corpora of growing size.

    python bench/data.py [--parts prepare loader startup memory] [--rounds 3]
                         [--doc-mb 500] [--corpus-gb 0.1 2] [--startup-gb 10]

- prepare: the demo corpus (python3.11-doc) with 1 and 2 workers, alternating rounds, medians;
  beside it the peer: the serial pass the library had before prepared shards (read a file,
  SentencePiece `encode`, write), in the same rounds. Output is byte-identical for any workers
  (tests/test_prepare.py); each round prepares into a fresh directory.
- loader: `data.batches.train_batches` over the prepared demo corpus at the demo's shape (16 x
  256) and at LLaMA-3 8B's on a v5p pod per 4-chip host (4 rows x 8192 tokens), against what
  such a host consumes: 4 chips x 459 TFLOP/s x 50% MFU / the step's FLOPs per token
  (`plan.costs.train_flops_per_token`).
- startup: a synthetic prepared dataset of `--startup-gb` GB (random tokens in 40 shards):
  the seconds from `corpus_tokens` to the first training batch, in a fresh process.
- memory: peak RSS of `python -m llama_jax.data.prepare` (2 workers: the largest process) on
  one document of `--doc-mb` MB and on JSONL corpora of each `--corpus-gb` (64 MB files),
  text made of the demo corpus's documents.

A scratch directory under /tmp is removed at the end. Nothing here may run beside another job.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from llama_jax.config import DEFAULT_CORPUS, load_model_config
from llama_jax.data import batches, corpus as corpora
from llama_jax.data.prepare import prepare
from llama_jax.data.shards import FORMAT_VERSION, open_prepared, sha256
from llama_jax.data.tokenizer import load_tokenizer, train_sentencepiece
from llama_jax.plan import costs, hardware

PARTS = ("prepare", "loader", "startup", "memory")
HOST_CHIPS, MFU = 4, 0.5


def demo_tokenizer(scratch: Path) -> Path:
    corpus = corpora.find_corpus(DEFAULT_CORPUS, 0.05)
    path = scratch / "tokenizer.model"
    texts = [corpora.read_document(p) for p in corpus.train]
    path.write_bytes(train_sentencepiece(texts, 8192))
    return path


def serial_tokens_per_s(tokenizer_path: Path, out: Path) -> tuple[float, int]:
    """The pipeline before prepared shards: one pass, one process."""
    tokenizer = load_tokenizer(tokenizer_path)
    corpus = corpora.find_corpus(DEFAULT_CORPUS, 0.05)
    start, n = time.perf_counter(), 0
    with out.open("wb") as f:
        for path in corpus.train + corpus.val:
            ids = np.asarray(tokenizer.encode(corpora.read_document(path), bos=True, eos=True),
                             np.uint16)
            f.write(ids.tobytes())
            n += ids.size
    return n / (time.perf_counter() - start), n


def bench_prepare(scratch: Path, tokenizer: Path, rounds: int) -> dict:
    rates: dict[str, list[float]] = {"serial (before)": [], "prepare, 1 worker": [],
                                     "prepare, 2 workers": []}
    tokens = 0
    for r in range(rounds):
        rate, tokens = serial_tokens_per_s(tokenizer, scratch / f"serial-{r}.bin")
        rates["serial (before)"].append(rate)
        for workers in (1, 2):
            out = scratch / f"prepared-{r}-{workers}"
            start = time.perf_counter()
            meta = prepare([DEFAULT_CORPUS], tokenizer, out, workers=workers,
                           val_fraction=0.05, log=lambda _: None, progress=False)
            seconds = time.perf_counter() - start
            n = meta["train"]["tokens"] + meta["val"]["tokens"]
            rates[f"prepare, {workers} worker{'s' * (workers > 1)}"].append(n / seconds)
            if not (r == rounds - 1 and workers == 1):
                shutil.rmtree(out)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    return {"tokens": tokens, "tokens_per_s": medians,
            "two_workers_over_one": medians["prepare, 2 workers"] / medians["prepare, 1 worker"]}


def host_need_tokens_per_s() -> float:
    config = load_model_config("llama3-8b")
    per_token = costs.train_flops_per_token(config, 8192)
    return HOST_CHIPS * hardware.HARDWARE["v5p"].peak_bf16_flops * MFU / per_token


def bench_loader(dataset: Path, rounds: int) -> dict:
    tokens = open_prepared(dataset).train
    out = {}
    for name, (rows, seq) in {"demo, 16 x 256": (16, 256), "8B pod host, 4 x 8192": (4, 8192)
                              }.items():
        rates = []
        for r in range(rounds):
            iterator = batches.train_batches(tokens, seq, rows, seed=r)
            next(iterator)
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < 2.0:
                n += next(iterator).size
            rates.append(n / (time.perf_counter() - start))
        out[name] = statistics.median(rates)
    need = host_need_tokens_per_s()
    return {"tokens_per_s": out, "host_need_tokens_per_s": need,
            "pod_host_over_need": out["8B pod host, 4 x 8192"] / need}


def synthetic_prepared(root: Path, tokenizer: Path, gb: float, shards: int = 40) -> Path:
    """A prepared dataset of random tokens, `gb` GB of uint16 in `shards` train shards."""
    (root / "shards").mkdir(parents=True)
    per_shard = int(gb * 1e9 / 2 / shards)
    rng = np.random.default_rng(0)
    entries = []
    for u in range(shards):
        for split, n in (("train", per_shard), ("val", 1 << 16)):
            rng.integers(3, 8192, n, dtype=np.uint16).tofile(
                root / "shards" / f"{u:05d}.{split}.bin")
        entries.append({"unit": u, "train": {"tokens": per_shard, "documents": 1},
                        "val": {"tokens": 1 << 16, "documents": 1}})
    shutil.copy(tokenizer, root / "tokenizer.model")
    (root / "plan.json").write_text("{}")
    meta = {"version": FORMAT_VERSION, "tokenizer_sha256": sha256(tokenizer), "vocab_size": 8192,
            "dtype": "uint16", "shards": entries,
            **{s: {"tokens": sum(e[s]["tokens"] for e in entries), "documents": shards}
               for s in ("train", "val")}}
    (root / "meta.json").write_text(json.dumps(meta))
    return root


STARTUP_CHILD = """
import sys, time
start = time.perf_counter()
from llama_jax.data import batches, corpus
from llama_jax.data.tokenizer import load_tokenizer
imported = time.perf_counter()
tokens = corpus.corpus_tokens(sys.argv[1], 0.05, load_tokenizer(sys.argv[2]), lambda _: None)
iterator = batches.train_batches(tokens.train, 8192, 4, seed=0)
next(iterator)
val = batches.val_batches(tokens.val, 8192, 4, 10)
print(f"{time.perf_counter() - imported:.3f} {len(tokens.train)}")
"""


def bench_startup(scratch: Path, tokenizer: Path, gb: float, rounds: int) -> dict:
    root = synthetic_prepared(scratch / "synthetic", tokenizer, gb)
    size = sum(p.stat().st_size for p in (root / "shards").iterdir())
    seconds = []
    for _ in range(rounds):
        out = subprocess.run([sys.executable, "-c", STARTUP_CHILD, str(root), str(tokenizer)],
                             check=True, capture_output=True, text=True).stdout.split()
        seconds.append(float(out[0]))
    shutil.rmtree(root)
    return {"dataset_bytes": size, "train_tokens": int(out[1]),
            "seconds_to_first_batch": statistics.median(seconds)}


def demo_texts() -> list[str]:
    corpus = corpora.find_corpus(DEFAULT_CORPUS, 0.05)
    return [corpora.read_document(p) for p in corpus.train + corpus.val]


def write_corpus(root: Path, texts: list[str], gb: float, file_mb: int = 64) -> Path:
    """JSONL files of `file_mb` MB holding the demo's documents over and over, `gb` GB."""
    root.mkdir(parents=True)
    lines = [json.dumps({"text": t}) + "\n" for t in texts]
    written, f, i = 0, None, 0
    while written < gb * 1e9:
        if f is None or f.tell() >= file_mb << 20:
            f = (root / f"part-{len(list(root.iterdir())):04d}.jsonl").open("w")
        f.write(lines[i % len(lines)])
        written += len(lines[i % len(lines)])
        i += 1
    return root


def peak_rss_of_prepare(inputs: Path, tokenizer: Path, out: Path) -> tuple[int, float]:
    """Peak RSS in bytes of the largest process of a 2-worker prepare, and its seconds."""
    child = ("import resource, subprocess, sys, time; start = time.perf_counter(); "
             "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
             "time.perf_counter() - start)")
    command = [sys.executable, "-m", "llama_jax.data.prepare", str(inputs), "--tokenizer",
               str(tokenizer), "--out", str(out), "--workers", "2", "--no-progress"]
    kib, seconds = subprocess.run([sys.executable, "-c", child, *command], check=True,
                                  capture_output=True, text=True).stdout.split()
    return int(kib) * 1024, float(seconds)


def bench_memory(scratch: Path, tokenizer: Path, doc_mb: int, corpus_gb: list[float]) -> dict:
    texts = demo_texts()
    cases = {}
    one = scratch / "one-document"
    one.mkdir()
    with (one / "huge.txt").open("w") as f:
        i = 0
        while f.tell() < doc_mb << 20:
            f.write(texts[i % len(texts)])
            i += 1
    rss, seconds = peak_rss_of_prepare(one, tokenizer, scratch / "one-out")
    cases[f"one {doc_mb} MB document"] = {"peak_rss_bytes": rss, "seconds": seconds}
    shutil.rmtree(one)
    shutil.rmtree(scratch / "one-out")
    for gb in corpus_gb:
        root = write_corpus(scratch / f"corpus-{gb}", texts, gb)
        rss, seconds = peak_rss_of_prepare(root, tokenizer, scratch / f"corpus-{gb}-out")
        cases[f"{gb} GB of JSONL"] = {"peak_rss_bytes": rss, "seconds": seconds}
        shutil.rmtree(root)
        shutil.rmtree(scratch / f"corpus-{gb}-out")
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--doc-mb", type=int, default=500)
    parser.add_argument("--corpus-gb", type=float, nargs="+", default=[0.1, 2.0])
    parser.add_argument("--startup-gb", type=float, default=10.0)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-data-"))
    results: dict = {"cpus": os.cpu_count()}
    try:
        tokenizer = demo_tokenizer(scratch)
        if "prepare" in args.parts or "loader" in args.parts:
            results["prepare"] = bench_prepare(scratch, tokenizer, args.rounds)
            print(json.dumps(results["prepare"], indent=1), flush=True)
        if "loader" in args.parts:
            results["loader"] = bench_loader(scratch / f"prepared-{args.rounds - 1}-1",
                                             args.rounds)
            print(json.dumps(results["loader"], indent=1), flush=True)
        if "startup" in args.parts:
            results["startup"] = bench_startup(scratch, tokenizer, args.startup_gb, args.rounds)
            print(json.dumps(results["startup"], indent=1), flush=True)
        if "memory" in args.parts:
            results["memory"] = bench_memory(scratch, tokenizer, args.doc_mb, args.corpus_gb)
            print(json.dumps(results["memory"], indent=1), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
