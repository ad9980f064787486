"""Documents from training inputs: which files the inputs name, their kinds, how they are cut
into units of work, and each document's text, read in bounded pieces.

- Kinds: `.jsonl`, `.jsonl.gz`, `.jsonl.zst` (one document per line, its text under a key),
  `.parquet` (one document per row of a text column; pyarrow), anything else one UTF-8
  document per file (`.txt`, `.md`).
- A document's name is its file's path relative to its input (a directory, a glob's common
  directory, a file's directory), with `:LINE` or `:ROW` inside a JSONL or Parquet file. A
  hash (`unit_hash`) of its split key decides its split: a record's `id` when it has one, else
  its text (`record_key`), so the same records split the same whatever file holds them
  (renamed, compressed, re-cut); a text file's key is its name, its path in the corpus. The
  split never depends on where the corpus lives or how the work is spread.
- Units of work, in the files' order: a JSONL or Parquet file alone; consecutive text files
  together up to about UNIT_BYTES.
- Text files are read in pieces of about PIECE_BYTES cut after a line end, so memory does not
  grow with a document's size.

Bad input (a line that is not JSON or has no string under the key, text that is not UTF-8) is
yielded or raised as `BadInput`, naming the file and line, for the caller to stop or count.
This module imports nothing heavy: prepare's worker processes start from it.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

from llama_jax.errors import DataError

UNIT_BYTES = 1 << 20  # text files are grouped into units of work of about this size
PIECE_BYTES = 1 << 20  # documents are read and encoded in pieces of about this size
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
# what a prepare may skip, by kind (bad_chat: a conversation that is not one, chat_documents)
BAD_KINDS = ("not_json", "no_text", "not_utf8", "bad_chat")


def unit_hash(name: str) -> float:
    """A stable pseudo-random number in [0, 1) for a document name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2 ** 64


def held_out_keys(keys: Iterable[str], val_fraction: float) -> set[str] | None:
    """The keys a split holds out for validation: those whose `unit_hash` is below
    `val_fraction`, at least one and never all; None when there are fewer than two keys (no
    split leaves one on each side)."""
    ranked = sorted(set(keys), key=unit_hash)
    if len(ranked) < 2:
        return None
    n_val = min(max(1, sum(unit_hash(k) < val_fraction for k in ranked)), len(ranked) - 1)
    return set(ranked[:n_val])


def record_key(record_id: object, text: str) -> str:
    """A JSONL or Parquet record's split key: its `id` (a JSON value; null is none) when it
    has one, else its text."""
    if record_id is not None:
        return "id " + json.dumps(record_id, sort_keys=True)
    return "text " + text


def jsonl_records(path: str | Path, what: str) -> Iterator[tuple[str, Any]]:
    """(`file:LINE`, the parsed JSON) of every non-blank line of a JSONL file read whole (a
    task's or chat examples: `what` names them in errors); a DataError names the file, or the
    line that is not JSON."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{what} file {path}: cannot read ({e})") from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            where = f"{path}:{number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not a JSON object ({e.msg})") from None


def files_of(spec: str) -> tuple[Path, list[Path]]:
    """The files one input names (a directory: every file below it, hidden ones skipped; a
    file; a glob), and the directory their names are relative to (the directory, the file's,
    the glob's files' common one). Raises for a path that does not exist."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path, [f for f in path.rglob("*") if f.is_file() and not any(
            part.startswith(".") for part in f.relative_to(path).parts)]
    if path.is_file():
        return path.parent, [path]
    if glob.has_magic(spec):
        files = [Path(f) for f in glob.glob(os.path.expanduser(spec), recursive=True)
                 if Path(f).is_file()]
        return (Path(os.path.commonpath([f.parent for f in files])) if files
                else path.parent), files
    raise DataError(f"input {spec!r}: no such file or directory")


def input_files(inputs: list[str]) -> list[tuple[Path, str]]:
    """(path, name) of every file the inputs name, sorted by name. A file's name is its path
    relative to its input's directory (`files_of`), or with several inputs to the directory
    they share, so that files of different inputs never share a name."""
    found = []
    for spec in inputs:
        root, files = files_of(spec)
        if not files:
            raise DataError(f"input {spec!r}: no files")
        found.append((root, files))
    if len(found) > 1:  # absolute paths: the inputs may be given relative or not
        found = [(root.absolute(), [f.absolute() for f in files]) for root, files in found]
    common = Path(os.path.commonpath([root for root, _ in found]))
    named = {f.relative_to(common).as_posix(): f for _, files in found for f in files}
    # by path components, as `sorted(paths)` orders the files of one directory
    return sorted(((path, name) for name, path in named.items()),
                  key=lambda pn: pn[1].split("/"))


def kind_of(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def plan_units(files: list[tuple[Path, str]]) -> list[dict]:
    """The units of work, in order: a JSONL or Parquet file alone, consecutive text files
    together up to about UNIT_BYTES."""
    units: list[dict] = []
    group: list[dict] = []
    for path, name in files:
        entry = {"name": name, "path": str(path), "bytes": path.stat().st_size}
        if kind_of(path) != "text":
            units.append({"kind": kind_of(path), "files": [entry]})
            continue
        if group and sum(f["bytes"] for f in group) + entry["bytes"] > UNIT_BYTES:
            units.append({"kind": "text", "files": group})
            group = []
        group.append(entry)
    if group:
        units.append({"kind": "text", "files": group})
    return units


def unit_files(unit: dict) -> list[dict]:
    """A unit's files as plan.json and its ledger record them: name and size."""
    return [{"name": f["name"], "bytes": f["bytes"]} for f in unit["files"]]


class BadInput(Exception):
    """One bad document: `kind` (one of BAD_KINDS) and where."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def text_pieces(path: Path, name: str) -> Iterator[str]:
    """A text file's text in pieces of about PIECE_BYTES, cut after a line end."""
    line, rest = 1, b""
    with path.open("rb") as f:
        while True:
            chunk = f.read(PIECE_BYTES)
            data = rest + chunk
            cut = data.rfind(b"\n") + 1 if chunk else len(data)
            if chunk and cut == 0:  # no line end yet: keep reading (one long line)
                rest = data
                continue
            piece, rest = data[:cut], data[cut:]
            try:
                text = piece.decode("utf-8")
            except UnicodeDecodeError as e:
                at = line + piece[:e.start].count(b"\n")
                raise BadInput("not_utf8", f"{path}: line {at}: not UTF-8 ({e.reason})") from None
            line += piece.count(b"\n")
            if text:
                yield text
            if not chunk:
                return


def _open_text(path: Path) -> io.TextIOBase:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="strict")
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path}: reading .zst needs zstandard: pip install "
                            "'llama_jax[data]'") from None
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(path.open("rb")),
                                encoding="utf-8", errors="strict")
    return path.open("r", encoding="utf-8", errors="strict")


def jsonl_lines(path: Path, name: str) -> Iterator[tuple[str, int, Any]]:
    """(name:LINE, the line's number, its parsed JSON or a BadInput) per non-blank line of a
    JSONL file: bad lines are yielded (dropped, or they stop the run), not raised."""
    with _open_text(path) as f:
        line_no = 0
        while True:
            line_no += 1
            where = f"{name}:{line_no}"
            try:
                line = f.readline()
            except UnicodeDecodeError as e:
                yield where, line_no, BadInput(
                    "not_utf8", f"{path}: line {line_no}: not UTF-8 ({e.reason})")
                return  # the decoder cannot go on past it
            if not line:
                return
            if not line.strip():
                continue
            try:
                yield where, line_no, json.loads(line)
            except json.JSONDecodeError as e:
                yield where, line_no, BadInput(
                    "not_json", f"{path}: line {line_no}: not valid JSON ({e.msg})")


def jsonl_documents(path: Path, name: str, text_key: str
                    ) -> Iterator[tuple[str, list[str] | BadInput]]:
    """(split key, [text]) per line of a JSONL file, or (its name:LINE, a BadInput) for
    a bad line (dropped, or it stops the run)."""
    for where, line_no, record in jsonl_lines(path, name):
        if isinstance(record, BadInput):
            yield where, record
            continue
        text = record.get(text_key) if isinstance(record, dict) else None
        if not isinstance(text, str):
            found = "no key" if isinstance(record, dict) and text_key not in record else \
                type(text if isinstance(record, dict) else record).__name__
            yield where, BadInput(
                "no_text", f"{path}: line {line_no}: no string under {text_key!r} ({found})")
            continue
        yield record_key(record.get("id"), text), [text]


def parquet_documents(path: Path, name: str, text_key: str
                      ) -> Iterator[tuple[str, list[str] | BadInput]]:
    """(split key, [text]) per row of a Parquet file's `text_key` column (the key by its `id`
    column where it has one), or (name:ROW, a BadInput)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install "
                        "'llama_jax[data]'") from None
    table = pq.ParquetFile(path)
    if text_key not in table.schema_arrow.names:
        raise DataError(f"{path}: no column {text_key!r} (columns: "
                        f"{', '.join(table.schema_arrow.names)}); choose one with --text-key")
    ids = "id" in table.schema_arrow.names and text_key != "id"
    row = 0
    for batch in table.iter_batches(columns=[text_key, "id"] if ids else [text_key],
                                    batch_size=1024):
        texts = batch.column(0).to_pylist()
        for text, record_id in zip(texts, batch.column(1).to_pylist() if ids else
                                   [None] * len(texts)):
            row += 1
            where = f"{name}:{row}"
            if not isinstance(text, str):
                yield where, BadInput(
                    "no_text", f"{path}: row {row}: {text_key!r} is not a string")
            else:
                yield record_key(record_id, text), [text]


def unit_documents(unit: dict, text_key: str) -> Iterator[tuple[str, object]]:
    """(split key, pieces or BadInput) of every document of a unit, in order."""
    for entry in unit["files"]:
        path, name = Path(entry["path"]), entry["name"]
        if unit["kind"] == "jsonl":
            yield from jsonl_documents(path, name, text_key)
        elif unit["kind"] == "parquet":
            yield from parquet_documents(path, name, text_key)
        else:
            yield name, text_pieces(path, name)
