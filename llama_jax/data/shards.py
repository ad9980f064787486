"""Prepared token shards on disk: writing one unit of work (`prepare_unit`, what prepare's
workers run) and reading a prepared dataset (`open_prepared`).

A prepared directory holds, per unit of work (data/documents.py) and split (train, val):
`shards/NNNNN.SPLIT.bin`, the unit's documents `BOS doc EOS` as uint16 tokens (uint32 for a
vocabulary over 65,536), and `.idx`, the uint64 offset of each document's first token, then
the total; `ledger/NNNNN.json`, written last for a finished unit, with its counts and its
shards' sizes and hashes; and once every unit is done `meta.json` and a copy of the tokenizer.
A chat dataset (`prepare --chat`: meta.json's `kind` is "chat") holds conversations instead,
each as its chat template renders it (no BOS or EOS of ours), and beside `.bin` a `.mask` of
one uint8 per token, 1 where the token is the assistant's (`conversation_arrays` reads them).
Opening a dataset reads meta.json only: the shards are memory-mapped when first read.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from llama_jax.data.chat_template import ChatTemplate
from llama_jax.data.conversations import Conversation, chat_documents
from llama_jax.data.documents import (BAD_KINDS, BadInput, unit_documents, unit_files,
                                      unit_hash)
from llama_jax.data.tokenizer import TOKENIZER_FILE, Tokenizer, load_tokenizer
from llama_jax.errors import DataError
from llama_jax.files import sibling_temp, write_atomically

FORMAT_VERSION = 1
SPLITS = ("train", "val")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the prepared tokens depend on besides the files."""

    tokenizer_sha256: str
    text_key: str = "text"
    val_fraction: float = 0.05
    skip_bad: bool = False
    # How a document's split is keyed (documents.py): a record by its id or text, a text file
    # by its name. Part of the plan, so a prepare begun under another rule is not resumed
    # under this one (before it, records were keyed by file name and line).
    split_key: str = "record id or text; file name"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class _SplitWriter:
    """One split's shard of a unit: tokens appended document by document (a conversation's
    assistant flags beside them, `masked`), and their offsets, written beside their final
    names and renamed into place when closed."""

    def __init__(self, path: Path, dtype: np.dtype, masked: bool = False):
        self.path, self.dtype = path, dtype  # the tokens' final path; the offsets' is .idx
        self.files = {"bin": _partial(path).open("wb")}
        if masked:
            self.files["mask"] = _partial(path.with_suffix(".mask")).open("wb")
        self.offsets = [0]

    def begin(self) -> None:
        self.start = self.offsets[-1]

    def write(self, ids, assistant=None) -> None:
        np.asarray(ids, self.dtype).tofile(self.files["bin"])
        if assistant is not None:
            np.asarray(assistant, np.uint8).tofile(self.files["mask"])

    def end(self) -> None:
        self.offsets.append(self.files["bin"].tell() // self.dtype.itemsize)

    def drop(self) -> None:
        """Takes back the document begun last (it was bad)."""
        for suffix, file in self.files.items():
            file.seek(self.start * (self.dtype.itemsize if suffix == "bin" else 1))
            file.truncate()

    def close(self) -> dict:
        """Renames the shard into place; its counts, and each file's size and hash."""
        for file in self.files.values():
            file.close()
        index = self.path.with_suffix(".idx")
        np.asarray(self.offsets, np.uint64).tofile(_partial(index))
        record = {"tokens": self.offsets[-1], "documents": len(self.offsets) - 1}
        for path in (self.path, index, *[self.path.with_suffix(".mask")] * ("mask" in self.files)):
            os.replace(_partial(path), path)
            record[path.suffix[1:]] = {"bytes": path.stat().st_size, "sha256": sha256(path)}
        return record


def _partial(path: Path) -> Path:
    """This process's name for `path` while it is written: processes that prepare the same
    unit at once (the processes of one run, each preparing a raw corpus) write the same bytes
    and rename them in turn."""
    return sibling_temp(path)


def shard_paths(out: Path, index: int) -> dict[str, Path]:
    return {split: out / "shards" / f"{index:05d}.{split}.bin" for split in SPLITS}


def prepare_unit(index: int, unit: dict, tokenizer_path: str, out: str, settings: Settings,
                 template: ChatTemplate | None = None) -> dict:
    """Tokenizes one unit into its shards and writes its ledger; returns the ledger. With a
    chat `template`, the unit's JSONL lines are conversations, written with their assistant
    flags (conversations.chat_documents)."""
    out_dir = Path(out)
    tokenizer = _tokenizer(tokenizer_path)
    dtype = token_dtype(tokenizer.vocab_size)
    paths = shard_paths(out_dir, index)
    writers = {split: _SplitWriter(path, dtype, masked=template is not None)
               for split, path in paths.items()}
    counts = {"empty_documents": 0, **{f"skipped_{k}": 0 for k in BAD_KINDS}}
    documents = (unit_documents(unit, settings.text_key) if template is None
                 else chat_documents(unit, template, tokenizer))
    for key, document in documents:
        writer = writers["val" if unit_hash(key) < settings.val_fraction else "train"]
        writer.begin()
        try:
            if isinstance(document, BadInput):
                raise document
            written = (_write_document(writer, document, tokenizer) if template is None
                       else _write_conversation(writer, document))
        except BadInput as bad:
            if not settings.skip_bad:
                raise DataError(f"{bad} (`python -m llama_jax.data.prepare --skip-bad` skips "
                                "and counts such documents)") from None
            writer.drop()
            counts[f"skipped_{bad.kind}"] += 1
            continue
        if written:
            writer.end()
        else:
            counts["empty_documents"] += 1
    ledger = {"unit": index, "files": unit_files(unit), **counts}
    for split, writer in writers.items():
        ledger[split] = writer.close()
    write_atomically(out_dir / "ledger" / f"{index:05d}.json",
                     json.dumps(ledger, indent=1).encode())
    return ledger


def prepare_unit_job(job: tuple) -> dict:
    """`prepare_unit(*job)`: what a worker process is handed."""
    return prepare_unit(*job)


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Tokenizer:
    """The tokenizer at `path`, loaded once per process (a worker prepares many units)."""
    return load_tokenizer(path)


def _write_document(writer: _SplitWriter, pieces, tokenizer) -> bool:
    """Writes `BOS doc EOS` of a document's pieces; False (nothing written) if it is empty."""
    begun = False
    for piece in pieces:
        if not begun and not piece.strip():
            continue
        ids = tokenizer.encode(piece, bos=not begun, eos=False)
        writer.write(ids)
        begun = True
    if begun:
        writer.write(tokenizer.encode("", bos=False, eos=True))
    return begun


def _write_conversation(writer: _SplitWriter, conversation: Conversation) -> bool:
    """Writes a conversation's tokens as its template rendered them (no BOS or EOS of ours)
    and their assistant flags."""
    writer.write(conversation.tokens, conversation.assistant)
    return len(conversation.tokens) > 0


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def unit_done(out: Path, index: int, unit: dict) -> bool:
    """Whether unit `index` finished: its ledger names its files, and its shards are the
    sizes the ledger records (a shard cut short by a killed prepare is not)."""
    ledger_path = out / "ledger" / f"{index:05d}.json"
    if not ledger_path.is_file():
        return False
    ledger = json.loads(ledger_path.read_text())
    if ledger["files"] != unit_files(unit):
        return False
    for split, path in shard_paths(out, index).items():
        for suffix in ("bin", "idx", "mask"):
            if suffix == "mask" and suffix not in ledger[split]:  # a text corpus has none
                continue
            shard = path.with_suffix("." + suffix)
            if not shard.is_file() or shard.stat().st_size != ledger[split][suffix]["bytes"]:
                return False
    return True


# ---------------------------------------------------------------------------------- reading

class ShardedTokens:
    """One split of a prepared dataset as one flat token sequence (`len`, slices, `np.asarray`),
    read from its shards' memory maps; a shard is mapped when first read."""

    def __init__(self, paths: list[Path], sizes: list[int], dtype: str):
        kept = [(p, n) for p, n in zip(paths, sizes) if n > 0]
        self.paths = [p for p, _ in kept]
        self.ends = np.cumsum([n for _, n in kept], dtype=np.int64)
        self.dtype = np.dtype(dtype)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise IndexError("ShardedTokens takes contiguous slices only")
        pieces, first = [], int(np.searchsorted(self.ends, start, side="right"))
        for shard in range(first, len(self.ends)):
            begin = int(self.ends[shard - 1]) if shard else 0
            if begin >= stop:
                break
            tokens = self._shard(shard)
            pieces.append(tokens[max(start - begin, 0):stop - begin])
        return np.concatenate(pieces) if pieces else np.zeros((0,), self.dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[0:len(self)]
        return out if dtype is None else out.astype(dtype)

    def _shard(self, i: int) -> np.ndarray:
        n = int(self.ends[i]) - (int(self.ends[i - 1]) if i else 0)
        return _mapped(str(self.paths[i]), self.dtype.str, n)


@functools.lru_cache(maxsize=256)  # at most this many shards mapped (and their files open)
def _mapped(path: str, dtype: str, n: int) -> np.ndarray:
    try:
        return np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read {n} tokens from the shard ({e}); prepare the "
                        "dataset again") from None


_KINDS = {"text": "text corpus", "chat": "set of conversations"}


@dataclasses.dataclass(frozen=True)
class PreparedData:
    """A prepared dataset, opened: its meta.json and each split's tokens."""

    root: Path
    meta: dict
    train: ShardedTokens
    val: ShardedTokens

    @property
    def tokenizer_path(self) -> Path:
        return self.root / TOKENIZER_FILE


def conversation_arrays(prepared: PreparedData, splits: tuple[str, ...]
                        ) -> tuple[ShardedTokens, ShardedTokens, np.ndarray]:
    """Splits of a prepared chat dataset, end to end: the tokens, their assistant flags (uint8)
    and each conversation's first token's offset, then the total (int64 `[C + 1]`)."""
    found = [(prepared.root / "shards" / f"{s['unit']:05d}.{split}.bin", s[split]["tokens"])
             for split in splits for s in prepared.meta["shards"] if s[split]["tokens"]]
    paths, sizes = [p for p, _ in found], [n for _, n in found]
    starts, base = [], 0
    for path, n in found:
        offsets = np.fromfile(path.with_suffix(".idx"), np.uint64).astype(np.int64)
        starts.append(offsets[:-1] + base)
        base += n
    return (ShardedTokens(paths, sizes, prepared.meta["dtype"]),
            ShardedTokens([p.with_suffix(".mask") for p in paths], sizes, "uint8"),
            np.concatenate(starts + [np.asarray([base], np.int64)]))


def is_prepared(path: str | Path) -> bool:
    """Whether `path` is a prepared dataset's directory (finished or not)."""
    return (Path(path).expanduser() / "plan.json").is_file()


def open_prepared(path: str | Path, kind: str = "text") -> PreparedData:
    """Opens a prepared dataset of `kind` ("text" or "chat"): reads its meta.json and nothing
    of the tokens."""
    root = Path(path).expanduser()
    try:
        meta = json.loads((root / "meta.json").read_text())
    except FileNotFoundError:
        raise DataError(f"{root}: no meta.json: its prepare has not finished (run it again; "
                        "with --shard, every host's part must be done)") from None
    if meta.get("version") != FORMAT_VERSION:
        raise DataError(f"{root}: prepared with format version {meta.get('version')}; this "
                        f"version reads {FORMAT_VERSION}: prepare it again")
    if meta.get("kind", "text") != kind:
        raise DataError(f"{root}: a prepared {_KINDS[meta.get('kind', 'text')]}, not "
                        f"{_KINDS[kind]}: it is read as " + (
                            "a chat run's task.train or task.val" if kind == "text" else
                            "data.corpus; prepare chat JSONL with `python -m "
                            "llama_jax.data.prepare --chat CHECKPOINT`"))
    splits = {split: ShardedTokens(
        [root / "shards" / f"{s['unit']:05d}.{split}.bin" for s in meta["shards"]],
        [s[split]["tokens"] for s in meta["shards"]], meta["dtype"]) for split in SPLITS}
    return PreparedData(root, meta, **splits)
