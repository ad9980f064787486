"""Training text: a corpus → its tokenizer → its tokens, as prepared shards (batches.py packs
them).

- A corpus is a prepared dataset (`python -m llama_jax.data.prepare`: a directory with
  plan.json and meta.json), or a raw one: a directory (every file below it, hidden ones
  skipped) or a glob, one UTF-8 document per file. A raw corpus is prepared once, into the
  cache (`cache_root()`), with every core, and read in its prepared form from then on; the
  cache directory is named by the files' names, sizes and modification times, the tokenizer
  and the split, so changing any of them prepares afresh, and naming it reads no file.
- Documents go to the validation split by a hash of their path relative to the corpus root
  (`find_corpus`; at least one document each way), so the split is stable when files are
  added or the corpus moves.
- The tokenizer is given (`data.tokenizer`), a prepared dataset's own, or trained with
  SentencePiece on a raw corpus's training split (`tokenizer.train_sentencepiece`); it is kept
  in the workdir. A prepared dataset whose tokenizer is not the run's is refused.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from llama_jax.config import DEFAULT_CORPUS, DataConfig
from llama_jax.data.documents import files_of, held_out_keys, unit_hash
from llama_jax.data.prepare import prepare
from llama_jax.data.shards import (FORMAT_VERSION, ShardedTokens, is_prepared, open_prepared,
                                   sha256)
from llama_jax.data.tokenizer import TOKENIZER_FILE, Tokenizer, load_tokenizer, train_sentencepiece
from llama_jax.errors import DataError
from llama_jax.files import keep_file



# ------------------------------------------------------------------------------------- corpus

@dataclasses.dataclass(frozen=True)
class Corpus:
    root: Path  # documents are named relative to it
    train: tuple[Path, ...]
    val: tuple[Path, ...]


def find_corpus(spec: str, val_fraction: float) -> Corpus:
    """The documents of a corpus directory or glob, split into train and validation."""
    if not (Path(spec).expanduser().is_dir() or glob.has_magic(spec)):
        hint = (" — it comes with Debian's python3.11-doc package (`sudo apt-get install "
                "python3.11-doc`), or point --corpus at your own text files"
                if spec == DEFAULT_CORPUS else "")
        raise DataError(f"corpus {spec!r}: no such directory{hint}")
    root, files = files_of(spec)
    if len(files) < 2:
        raise DataError(f"corpus {spec!r}: found {len(files)} file(s); need at least two "
                        "documents (one file each) to hold one out for validation")
    held_out = held_out_keys((f.relative_to(root).as_posix() for f in files), val_fraction)
    val = [f for f in files if f.relative_to(root).as_posix() in held_out]
    return Corpus(root=root, train=tuple(sorted(set(files) - set(val))), val=tuple(sorted(val)))


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
        keep_file(kept, model)
    return _within_vocab(load_tokenizer(kept), vocab_size)


def _within_vocab(tokenizer: Tokenizer, vocab_size: int) -> Tokenizer:
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens, more "
                        f"than model.vocab_size={vocab_size}")
    return tokenizer


def keep_tokenizer(source: Path, workdir: Path) -> None:
    """A copy of the tokenizer file `source` in the workdir, where sample.py, predict and
    load_tokenizer(workdir) find it."""
    keep_file(workdir / TOKENIZER_FILE, source.read_bytes())


def _limit_chars(texts: Iterator[str], limit: int) -> Iterator[str]:
    total = 0
    for text in texts:
        if total >= limit:
            return
        total += len(text)
        yield text


# ------------------------------------------------------------------------------ the tokens

@dataclasses.dataclass(frozen=True)
class CorpusTokens:
    """A run's corpus as tokens: each split one flat sequence `BOS doc EOS BOS doc EOS ...`."""

    train: ShardedTokens
    val: ShardedTokens
    bos_id: int
    dataset: Path  # the prepared directory read
    meta: dict  # its meta.json


def cache_root() -> Path:
    """Where raw corpora are prepared: `$LLAMA_JAX_CACHE/tokens`, by default
    ~/.cache/llama_jax/tokens. Shared by runs: a directory per corpus and tokenizer."""
    return Path(os.environ.get("LLAMA_JAX_CACHE", Path.home() / ".cache" / "llama_jax")) / "tokens"


def corpus_tokenizer(data: DataConfig, vocab_size: int, workdir: Path,
                     log: Callable[[str], None] = print) -> Tokenizer:
    """The run's tokenizer, kept in the workdir: `data.tokenizer`, else a prepared corpus's
    own, else (a raw corpus) one a previous run of this workdir trained or one trained now
    (`prepare_tokenizer`). Of a mixture, the first source's."""
    first = data.corpora[0].path  # of a mixture, the first source
    if not is_prepared(first):
        corpus = find_corpus(first, data.val_fraction)
        return prepare_tokenizer(data, corpus, vocab_size, workdir, log)
    source = Path(data.tokenizer or open_prepared(first).tokenizer_path).expanduser()
    if source.is_dir():
        source = source / TOKENIZER_FILE
    if not source.is_file():
        raise DataError(f"data.tokenizer {data.tokenizer!r}: no such file")
    keep_tokenizer(source, workdir)
    return _within_vocab(load_tokenizer(workdir / TOKENIZER_FILE), vocab_size)


def corpus_tokens(spec: str, val_fraction: float, tokenizer: Tokenizer,
                  log: Callable[[str], None] = print) -> CorpusTokens:
    """The corpus `spec` as tokens of `tokenizer`: a prepared dataset, opened (its meta.json
    is read, not its tokens); or a raw corpus (`val_fraction` held out), prepared once into
    the cache (data/prepare.py, with every core) and then opened. A prepared dataset of
    another tokenizer is refused."""
    if is_prepared(spec):
        dataset = Path(spec).expanduser()
    else:
        dataset = _prepared_raw(find_corpus(spec, val_fraction), spec, tokenizer, log)
    prepared = open_prepared(dataset)
    if prepared.meta["tokenizer_sha256"] != sha256(Path(tokenizer.path)):
        raise DataError(f"{dataset}: prepared with another tokenizer than the run's "
                        f"({tokenizer.path}); prepare it with that one, or set data.tokenizer "
                        f"to {prepared.tokenizer_path}")
    return CorpusTokens(prepared.train, prepared.val, tokenizer.bos_id, dataset, prepared.meta)


def _prepared_raw(corpus: Corpus, spec: str, tokenizer: Tokenizer,
                  log: Callable[[str], None]) -> Path:
    """The cache directory of `corpus` prepared with `tokenizer`, preparing it first if
    needed. It is named by the files' names, sizes and modification times, the tokenizer and
    the split (no file is read to name it), so a changed corpus is prepared afresh."""
    threshold = val_threshold(corpus)
    digest = hashlib.sha256(f"v{FORMAT_VERSION}:{threshold!r}:".encode())
    digest.update(sha256(Path(tokenizer.path)).encode())
    for path in sorted(corpus.train + corpus.val):
        stat = path.stat()
        digest.update(f"{path.relative_to(corpus.root).as_posix()}:{stat.st_size}:"
                      f"{stat.st_mtime_ns}\n".encode())
    dataset = cache_root() / digest.hexdigest()[:24]
    if not (dataset / "meta.json").is_file():
        log(f"preparing {len(corpus.train) + len(corpus.val)} documents into {dataset}")
        prepare([spec], tokenizer.path, dataset, workers=os.cpu_count() or 1,
                val_fraction=threshold, log=lambda _: None, progress=False)
    return dataset


def val_threshold(corpus: Corpus) -> float:
    """A hash threshold below which exactly the corpus's validation documents fall (their
    `unit_hash` is below it, the training documents' are not): how prepare splits it."""
    hashes = {p: unit_hash(p.relative_to(corpus.root).as_posix())
              for p in corpus.train + corpus.val}
    highest_val = max(hashes[p] for p in corpus.val)
    lowest_train = min(hashes[p] for p in corpus.train)
    return (highest_val + lowest_train) / 2


def unigram_entropy(tokens: np.ndarray, bos_id: int) -> float:
    """Entropy in nats of the split's own token frequencies (BOS excluded: it is never a
    scored target) — the loss of the best model that ignores context, a baseline to beat."""
    counts = np.bincount(np.asarray(tokens)).astype(np.float64)
    counts[bos_id] = 0
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
