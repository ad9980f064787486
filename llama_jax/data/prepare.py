"""Prepared token shards: a corpus tokenized once, on many cores and many hosts, into flat token
files that training memory-maps.

    python -m llama_jax.data.prepare INPUT... --tokenizer tokenizer.model --out DIR
        [--workers N] [--shard i/n] [--text-key text] [--val-fraction 0.05] [--skip-bad]

INPUTs are directories (every file below them, hidden ones skipped), globs or files:
- `.jsonl`, `.jsonl.gz`, `.jsonl.zst`: one document per line, its text under `--text-key`;
- `.parquet`: one document per row of the `--text-key` column (pyarrow: the `data` extra);
- anything else: one UTF-8 document per file (`.txt`, `.md`, the demo's corpus).

The files, sorted by name, are cut into units of work: each JSONL or Parquet file is one, and
consecutive text files are grouped into units of about UNIT_BYTES. Everything a unit writes
depends only on its files and the tokenizer, so the output is the same byte for byte for any
`--workers` and any `--shard i/n` (host i of n prepares units i, i+n, ...; n hosts sharing DIR
together write exactly what one would). DIR holds:
- `plan.json`: the units, their files and sizes, the tokenizer's hash and the settings; a
  prepare into a DIR planned from other inputs or settings is refused;
- `shards/NNNNN.SPLIT.bin`: the unit's documents of that split (train, val), `BOS doc EOS`
  each, as uint16 tokens (uint32 for a vocabulary over 65,536), and `.idx`: the uint64 offset
  of each document's first token, then the total;
- `ledger/NNNNN.json`: written last for a finished unit, with its counts and its files' sizes
  and hashes: an interrupted prepare redoes exactly the units without a ledger, or whose
  shards do not match it (a truncated shard of a killed run);
- `meta.json`: written once every unit is done: the tokenizer, the dtype, tokens and documents
  per split and per shard, and what was skipped or empty. Opening the dataset reads this file.

A document goes to the validation split by a hash of its name (its path relative to its input,
with `:LINE` or `:ROW` inside a JSONL or Parquet file), as the raw corpus reader splits it. A
document is read and encoded in pieces of about PIECE_BYTES cut at line ends, so memory does
not grow with a document's size (each piece is encoded on its own: a document over PIECE_BYTES
may tokenize slightly differently at the cuts than whole). Bad input — a line that is not JSON,
or has no string under the text key, or text that is not UTF-8 — is an error naming the file
and line, or with `--skip-bad` is skipped and counted in meta.json; empty documents are
counted, not written.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import hashlib
import io
import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from llama_jax.cli import user_errors_exit
from llama_jax.data.corpus import unit_hash
from llama_jax.data.tokenizer import load_tokenizer
from llama_jax.errors import DataError
from llama_jax.files import write_atomically

FORMAT_VERSION = 1
UNIT_BYTES = 1 << 20  # text files are grouped into units of work of about this size
PIECE_BYTES = 1 << 20  # documents are read and encoded in pieces of about this size
SPLITS = ("train", "val")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
BAD_KINDS = ("not_json", "no_text", "not_utf8")  # what --skip-bad skips, by kind


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the prepared tokens depend on besides the files."""

    tokenizer_sha256: str
    text_key: str = "text"
    val_fraction: float = 0.05
    skip_bad: bool = False


# ------------------------------------------------------------------------------------ inputs

def input_files(inputs: list[str]) -> list[tuple[Path, str]]:
    """(path, name) of every file the inputs name, sorted by name: a file's name is its path
    relative to its input (a directory, a glob's common directory, a file's directory)."""
    found: dict[str, Path] = {}
    for spec in inputs:
        path = Path(spec).expanduser()
        if path.is_dir():
            root = path
            files = [f for f in path.rglob("*") if f.is_file() and not any(
                part.startswith(".") for part in f.relative_to(path).parts)]
        elif path.is_file():
            root, files = path.parent, [path]
        elif glob.has_magic(spec):
            files = [Path(f) for f in glob.glob(os.path.expanduser(spec), recursive=True)
                     if Path(f).is_file()]
            root = Path(os.path.commonpath([f.parent for f in files])) if files else path
        else:
            raise DataError(f"input {spec!r}: no such file or directory")
        if not files:
            raise DataError(f"input {spec!r}: no files")
        for f in files:
            found.setdefault(f.relative_to(root).as_posix(), f)
    return sorted(((path, name) for name, path in found.items()), key=lambda pn: pn[1])


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


# --------------------------------------------------------------------------------- documents

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


def jsonl_documents(path: Path, name: str, text_key: str
                    ) -> Iterator[tuple[str, list[str] | BadInput]]:
    """(name:LINE, [text]) per line of a JSONL file, or a BadInput for a bad line."""
    with _open_text(path) as f:
        line_no = 0
        while True:
            line_no += 1
            try:
                line = f.readline()
            except UnicodeDecodeError as e:
                yield f"{name}:{line_no}", BadInput(
                    "not_utf8", f"{path}: line {line_no}: not UTF-8 ({e.reason})")
                return  # the decoder cannot go on past it
            if not line:
                return
            if not line.strip():
                continue
            try:
                text = json.loads(line)[text_key]
                if not isinstance(text, str):
                    raise TypeError(type(text).__name__)
            except json.JSONDecodeError as e:
                yield f"{name}:{line_no}", BadInput(
                    "not_json", f"{path}: line {line_no}: not valid JSON ({e.msg})")
                continue
            except (KeyError, TypeError) as e:
                yield f"{name}:{line_no}", BadInput(
                    "no_text", f"{path}: line {line_no}: no string under {text_key!r} ({e})")
                continue
            yield f"{name}:{line_no}", [text]


def parquet_documents(path: Path, name: str, text_key: str
                      ) -> Iterator[tuple[str, list[str] | BadInput]]:
    """(name:ROW, [text]) per row of a Parquet file's `text_key` column."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install "
                        "'llama_jax[data]'") from None
    table = pq.ParquetFile(path)
    if text_key not in table.schema_arrow.names:
        raise DataError(f"{path}: no column {text_key!r} (columns: "
                        f"{', '.join(table.schema_arrow.names)}); choose one with --text-key")
    row = 0
    for batch in table.iter_batches(columns=[text_key], batch_size=1024):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                yield f"{name}:{row}", BadInput(
                    "no_text", f"{path}: row {row}: {text_key!r} is not a string")
            else:
                yield f"{name}:{row}", [text]


def unit_documents(unit: dict, text_key: str) -> Iterator[tuple[str, object]]:
    """(name, pieces or BadInput) of every document of a unit, in order."""
    for entry in unit["files"]:
        path, name = Path(entry["path"]), entry["name"]
        if unit["kind"] == "jsonl":
            yield from jsonl_documents(path, name, text_key)
        elif unit["kind"] == "parquet":
            yield from parquet_documents(path, name, text_key)
        else:
            yield name, text_pieces(path, name)


# -------------------------------------------------------------------------------- one unit

def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class _SplitWriter:
    """One split's shard of a unit: tokens appended document by document, and their offsets,
    written beside their final names and renamed into place when closed."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype = path, dtype  # the tokens' final path; the offsets' is .idx
        self.file = _partial(path).open("wb")
        self.offsets = [0]

    def begin(self) -> None:
        self.start = self.offsets[-1]

    def write(self, ids: list[int]) -> None:
        np.asarray(ids, self.dtype).tofile(self.file)

    def end(self) -> None:
        self.offsets.append(self.file.tell() // self.dtype.itemsize)

    def drop(self) -> None:
        """Takes back the document begun last (it was bad)."""
        self.file.seek(self.start * self.dtype.itemsize)
        self.file.truncate()

    def close(self) -> dict:
        """Renames the shard into place; its counts, and each file's size and hash."""
        self.file.close()
        index = self.path.with_suffix(".idx")
        np.asarray(self.offsets, np.uint64).tofile(_partial(index))
        record = {"tokens": self.offsets[-1], "documents": len(self.offsets) - 1}
        for path in (self.path, index):
            os.replace(_partial(path), path)
            record[path.suffix[1:]] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        return record


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def shard_paths(out: Path, index: int) -> dict[str, Path]:
    return {split: out / "shards" / f"{index:05d}.{split}.bin" for split in SPLITS}


def prepare_unit(index: int, unit: dict, tokenizer_path: str, out: str,
                 settings: Settings) -> dict:
    """Tokenizes one unit into its shards and writes its ledger; returns the ledger."""
    out_dir = Path(out)
    tokenizer = load_tokenizer(tokenizer_path)
    dtype = token_dtype(tokenizer.vocab_size)
    paths = shard_paths(out_dir, index)
    writers = {split: _SplitWriter(path, dtype) for split, path in paths.items()}
    counts = {"empty_documents": 0, **{f"skipped_{k}": 0 for k in BAD_KINDS}}
    for name, pieces in unit_documents(unit, settings.text_key):
        writer = writers["val" if unit_hash(name) < settings.val_fraction else "train"]
        writer.begin()
        try:
            if isinstance(pieces, BadInput):
                raise pieces
            written = _write_document(writer, pieces, tokenizer)
        except BadInput as bad:
            if not settings.skip_bad:
                raise DataError(f"{bad} (or pass --skip-bad to skip and count such "
                                "documents)") from None
            writer.drop()
            counts[f"skipped_{bad.kind}"] += 1
            continue
        if written:
            writer.end()
        else:
            counts["empty_documents"] += 1
    ledger = {"unit": index, "files": [{k: f[k] for k in ("name", "bytes")}
                                        for f in unit["files"]], **counts}
    for split, writer in writers.items():
        ledger[split] = writer.close()
    write_atomically(out_dir / "ledger" / f"{index:05d}.json",
                     json.dumps(ledger, indent=1).encode())
    return ledger


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


def _sha256(path: Path) -> str:
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
    if ledger["files"] != [{k: f[k] for k in ("name", "bytes")} for f in unit["files"]]:
        return False
    for split, path in shard_paths(out, index).items():
        for suffix in ("bin", "idx"):
            shard = path.with_suffix("." + suffix)
            if not shard.is_file() or shard.stat().st_size != ledger[split][suffix]["bytes"]:
                return False
    return True


# ------------------------------------------------------------------------------ the dataset

def prepare(inputs: list[str], tokenizer: str | Path, out: str | Path, *, workers: int = 1,
            shard: tuple[int, int] = (0, 1), text_key: str = "text",
            val_fraction: float = 0.05, skip_bad: bool = False,
            log: Callable[[str], None] = print, progress: bool = True) -> dict | None:
    """Prepares this host's units (`shard` = (i, n): units i, i+n, ...) of `inputs` into
    `out` with `workers` processes, skipping units already done; returns meta.json's content
    once every unit of every host is done (this call's or another's), else None."""
    i, n = shard
    if not (n >= 1 and 0 <= i < n) or workers < 1 or not 0 <= val_fraction < 1:
        raise DataError(f"--shard {i}/{n} needs 0 <= i < n; --workers {workers} >= 1; "
                        f"--val-fraction {val_fraction} in [0, 1)")
    tokenizer_path = Path(tokenizer).expanduser()
    if not tokenizer_path.is_file():
        raise DataError(f"--tokenizer {tokenizer}: no such file")
    settings = Settings(_sha256(tokenizer_path), text_key, val_fraction, skip_bad)
    out = Path(out)
    units = plan_units(input_files(inputs))
    _keep_plan(out, units, settings)
    mine = [u for u in range(i, len(units), n) if not unit_done(out, u, units[u])]
    log(f"preparing {len(mine)} of {len(units)} units into {out} with {workers} worker(s)")
    jobs = [(u, units[u], str(tokenizer_path), str(out), settings) for u in mine]
    bar = _progress_bar(sum(f["bytes"] for u in mine for f in units[u]["files"]), progress)
    with bar:
        for ledger in _run(jobs, workers):
            bar.update(sum(f["bytes"] for f in ledger["files"]))
            bar.set_postfix(tokens=sum(ledger[s]["tokens"] for s in SPLITS), refresh=False)
    if not all(unit_done(out, u, units[u]) for u in range(len(units))):
        log(f"{out}: this host's units are done; meta.json follows the last host's")
        return None
    meta = _meta(out, units, settings, load_tokenizer(tokenizer_path).vocab_size)
    write_atomically(out / "meta.json", json.dumps(meta, indent=1).encode())
    return meta


def _run(jobs: list[tuple], workers: int) -> Iterator[dict]:
    """The units' ledgers as they finish: here, or in `workers` fresh processes (spawned: the
    caller may hold JAX's threads, which a fork would copy mid-flight)."""
    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            yield prepare_unit(*job)
        return
    with multiprocessing.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        yield from pool.imap_unordered(_prepare_job, jobs)


def _prepare_job(job: tuple) -> dict:
    return prepare_unit(*job)


def _progress_bar(total_bytes: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not enabled,
                desc="prepare", file=sys.stderr)


def _keep_plan(out: Path, units: list[dict], settings: Settings) -> None:
    """Writes plan.json, or checks that the one there is this plan: a DIR holds one dataset."""
    plan = {"version": FORMAT_VERSION, "settings": dataclasses.asdict(settings),
            "units": [{"kind": u["kind"], "files": [{k: f[k] for k in ("name", "bytes")}
                                                    for f in u["files"]]} for u in units]}
    path = out / "plan.json"
    if path.is_file():
        if json.loads(path.read_text()) != plan:
            raise DataError(f"{out}: prepared from other inputs, tokenizer or settings "
                            f"(its plan.json differs): remove it or choose another --out")
        return
    (out / "shards").mkdir(parents=True, exist_ok=True)
    (out / "ledger").mkdir(exist_ok=True)
    write_atomically(path, json.dumps(plan, indent=1).encode())


def _meta(out: Path, units: list[dict], settings: Settings, vocab_size: int) -> dict:
    """meta.json from the ledgers: nothing in it depends on how the work was spread."""
    ledgers = [json.loads((out / "ledger" / f"{u:05d}.json").read_text())
               for u in range(len(units))]
    totals = {split: {key: sum(led[split][key] for led in ledgers)
                      for key in ("tokens", "documents")} for split in SPLITS}
    counted = ["empty_documents", *(f"skipped_{k}" for k in BAD_KINDS)]
    return {"version": FORMAT_VERSION, "tokenizer_sha256": settings.tokenizer_sha256,
            "vocab_size": vocab_size, "dtype": token_dtype(vocab_size).name,
            "text_key": settings.text_key, "val_fraction": settings.val_fraction,
            "files": sum(len(u["files"]) for u in units), **totals,
            **{key: sum(led[key] for led in ledgers) for key in counted},
            "shards": [{"unit": led["unit"], **{split: {k: led[split][k] for k in
                                                       ("tokens", "documents")}
                                               for split in SPLITS}} for led in ledgers]}


# ------------------------------------------------------------------------------------ CLI

def parse_shard(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit()):
        raise DataError(f"--shard {text!r}: expected i/n, e.g. 0/4")
    return int(i), int(n)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m llama_jax.data.prepare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="directories, globs or files (.txt/.md, .jsonl[.gz|.zst], .parquet)")
    parser.add_argument("--tokenizer", required=True, help="a SentencePiece tokenizer.model")
    parser.add_argument("--out", required=True, help="the prepared dataset's directory")
    parser.add_argument("--workers", type=int, default=1, help="processes that tokenize")
    parser.add_argument("--shard", default="0/1",
                        help="i/n: this host prepares every n-th unit from the i-th")
    parser.add_argument("--text-key", default="text",
                        help="the JSONL key or Parquet column holding the text")
    parser.add_argument("--val-fraction", type=float, default=0.05,
                        help="share of documents held out for validation")
    parser.add_argument("--skip-bad", action="store_true",
                        help="skip bad lines and non-UTF-8 text (counted in meta.json) "
                             "instead of stopping")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


@user_errors_exit
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    meta = prepare(args.inputs, args.tokenizer, args.out, workers=args.workers,
                   shard=parse_shard(args.shard), text_key=args.text_key,
                   val_fraction=args.val_fraction, skip_bad=args.skip_bad,
                   log=lambda line: print(line, file=sys.stderr), progress=not args.no_progress)
    if meta is not None:
        print(f"{args.out}: {meta['train']['tokens']:,} training and {meta['val']['tokens']:,} "
              f"validation tokens in {len(meta['shards'])} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
