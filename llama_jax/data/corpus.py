"""Training text: a corpus of documents → tokenizer → cached token arrays (batches.py packs them).

- A corpus is a directory (every file below it, hidden ones skipped) or a glob; one document per
  file, read as UTF-8. Documents go to the validation split by a hash of their path relative to
  the corpus root, so the split is stable when files are added or the corpus moves.
- The tokenizer is given (`data.tokenizer`) or trained with SentencePiece on the training split
  (`tokenizer.train_sentencepiece`) and kept in the workdir.
- Each split is tokenized once into one flat memory-mapped array, `BOS doc EOS BOS doc EOS ...`,
  cached in a directory named by a hash of the corpus content, the split and the tokenizer file,
  so changing any of them tokenizes afresh. The cache is written to a temporary directory and
  renamed into place, so an interrupted run never leaves a half-written cache behind.
- Batches of the cached tokens: `data.batches`.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from llama_jax.config import DEFAULT_CORPUS, DataConfig
from llama_jax.errors import DataError
from llama_jax.files import sibling_temp, write_atomically
from llama_jax.data.tokenizer import TOKENIZER_FILE, Tokenizer, load_tokenizer, train_sentencepiece

CACHE_VERSION = 1  # bump when the cached layout changes



# ------------------------------------------------------------------------------------- corpus

@dataclasses.dataclass(frozen=True)
class Corpus:
    root: Path  # documents are named relative to it
    train: tuple[Path, ...]
    val: tuple[Path, ...]


def find_corpus(spec: str, val_fraction: float) -> Corpus:
    """The documents of a corpus directory or glob, split into train and validation."""
    path = Path(spec).expanduser()
    if path.is_dir():
        root = path
        files = [f for f in path.rglob("*") if f.is_file()
                 and not any(part.startswith(".") for part in f.relative_to(path).parts)]
    elif glob.has_magic(spec):
        files = [Path(f) for f in glob.glob(os.path.expanduser(spec), recursive=True)
                 if Path(f).is_file()]
        root = Path(os.path.commonpath([f.parent for f in files])) if files else path.parent
    else:
        hint = (" — it comes with Debian's python3.11-doc package (`sudo apt-get install "
                "python3.11-doc`), or point --corpus at your own text files"
                if spec == DEFAULT_CORPUS else "")
        raise DataError(f"corpus {spec!r}: no such directory{hint}")
    if len(files) < 2:
        raise DataError(f"corpus {spec!r}: found {len(files)} file(s); need at least two "
                        "documents (one file each) to hold one out for validation")
    ranked = sorted(files, key=lambda f: unit_hash(f.relative_to(root).as_posix()))
    n_val = max(1, sum(unit_hash(f.relative_to(root).as_posix()) < val_fraction for f in files))
    n_val = min(n_val, len(files) - 1)
    return Corpus(root=root, train=tuple(sorted(ranked[n_val:])), val=tuple(sorted(ranked[:n_val])))


def unit_hash(name: str) -> float:
    """A stable pseudo-random number in [0, 1) for a document name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2 ** 64


def read_document(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read as UTF-8 text ({e})") from None


# ---------------------------------------------------------------------------------- tokenizer

def prepare_tokenizer(data: DataConfig, corpus: Corpus, vocab_size: int, workdir: Path,
                      log: Callable[[str], None] = print) -> Tokenizer:
    """The run's tokenizer, kept in the workdir: a copy of `data.tokenizer`, the one a previous
    run of this workdir trained, or a SentencePiece model trained now on the training split."""
    kept = workdir / TOKENIZER_FILE
    if data.tokenizer is not None:
        source = Path(data.tokenizer).expanduser()
        if source.is_dir():
            source = source / TOKENIZER_FILE
        if not source.is_file():
            raise DataError(f"data.tokenizer {data.tokenizer!r}: no such file")
        keep_tokenizer(source, workdir)
    elif not kept.is_file():
        log(f"training a {vocab_size}-token SentencePiece BPE tokenizer on "
            f"{len(corpus.train)} documents")
        texts = list(_limit_chars((read_document(p) for p in corpus.train),
                                  data.max_tokenizer_chars))
        if not any(text.strip() for text in texts):
            raise DataError(f"corpus {corpus.root}: the training documents are empty")
        try:
            model = train_sentencepiece(texts, vocab_size)
        except RuntimeError as e:  # e.g. a vocabulary larger than the text allows
            raise DataError(f"training the tokenizer on {corpus.root} failed: {e}") from None
        write_atomically(kept, model)
    tokenizer = load_tokenizer(kept)
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"tokenizer {kept} has {tokenizer.vocab_size} tokens, more than "
                        f"model.vocab_size={vocab_size}")
    return tokenizer


def keep_tokenizer(source: Path, workdir: Path) -> None:
    """A copy of the tokenizer file `source` in the workdir, where sample.py, predict and
    load_tokenizer(workdir) find it."""
    kept = workdir / TOKENIZER_FILE
    if not kept.is_file() or kept.read_bytes() != source.read_bytes():
        write_atomically(kept, source.read_bytes())


def _limit_chars(texts: Iterator[str], limit: int) -> Iterator[str]:
    total = 0
    for text in texts:
        if total >= limit:
            return
        total += len(text)
        yield text


# ------------------------------------------------------------------------------- token cache

@dataclasses.dataclass(frozen=True)
class TokenizedCorpus:
    train: np.ndarray  # flat token ids (memory-mapped): BOS doc EOS BOS doc EOS ...
    val: np.ndarray
    bos_id: int
    cache_dir: Path


def cache_root() -> Path:
    """Where token caches live: `$LLAMA_JAX_CACHE/tokens`, by default ~/.cache/llama_jax/tokens.
    Shared by runs: the cache key covers everything the tokens depend on."""
    return Path(os.environ.get("LLAMA_JAX_CACHE", Path.home() / ".cache" / "llama_jax")) / "tokens"


def tokenize_corpus(corpus: Corpus, tokenizer: Tokenizer, cache_root: Path,
                    log: Callable[[str], None] = print) -> TokenizedCorpus:
    """Both splits as memory-mapped token arrays, tokenized on first use and cached."""
    key = _cache_key(corpus, Path(tokenizer.path))
    cache = cache_root / key
    if not (cache / "meta.json").is_file():
        log(f"tokenizing {len(corpus.train) + len(corpus.val)} documents into {cache}")
        temp = sibling_temp(cache)
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
        dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
        meta = {"version": CACHE_VERSION, "dtype": np.dtype(dtype).name,
                "bos_id": tokenizer.bos_id, "corpus": str(corpus.root)}
        for split in ("train", "val"):
            meta[split] = _write_tokens(getattr(corpus, split), tokenizer, temp / f"{split}.bin",
                                        dtype)
        (temp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            temp.rename(cache)
        except OSError:  # another process finished the same cache first
            shutil.rmtree(temp, ignore_errors=True)
    meta = json.loads((cache / "meta.json").read_text())
    splits = {split: np.memmap(cache / f"{split}.bin", dtype=meta["dtype"], mode="r",
                               shape=(meta[split]["tokens"],))
              for split in ("train", "val")}
    return TokenizedCorpus(**splits, bos_id=meta["bos_id"], cache_dir=cache)


def _cache_key(corpus: Corpus, tokenizer_file: Path) -> str:
    digest = hashlib.sha256(f"v{CACHE_VERSION}".encode())
    for split in ("train", "val"):
        for path in getattr(corpus, split):
            digest.update(f"{split}:{path.relative_to(corpus.root).as_posix()}:".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    digest.update(tokenizer_file.read_bytes())
    return digest.hexdigest()[:24]


def _write_tokens(paths: tuple[Path, ...], tokenizer: Tokenizer, out: Path,
                  dtype: type) -> dict:
    """Streams `BOS doc EOS` of every non-empty document to a raw binary file."""
    n_tokens = n_docs = 0
    with out.open("wb") as f:
        for path in paths:
            text = read_document(path)
            if not text.strip():
                continue
            ids = np.asarray(tokenizer.encode(text, bos=True, eos=True), dtype)
            f.write(ids.tobytes())
            n_tokens += ids.size
            n_docs += 1
    if n_docs == 0:
        raise DataError(f"{paths[0].parent}: every document of the split is empty")
    return {"tokens": n_tokens, "documents": n_docs}


def unigram_entropy(tokens: np.ndarray, bos_id: int) -> float:
    """Entropy in nats of the split's own token frequencies (BOS excluded: it is never a
    scored target) — the loss of the best model that ignores context, a baseline to beat."""
    counts = np.bincount(np.asarray(tokens)).astype(np.float64)
    counts[bos_id] = 0
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
