"""Prepare: a corpus tokenized once, on many cores and many hosts, into token shards that
training memory-maps.

    python -m llama_jax.data.prepare INPUT... --tokenizer tokenizer.model --out DIR
        [--workers N] [--shard i/n] [--text-key text] [--val-fraction 0.05] [--skip-bad]
    python -m llama_jax.data.prepare chats.jsonl.gz... --chat CHECKPOINT --out DIR [...]

INPUTs are directories (every file below them, hidden ones skipped), globs or files:
`.jsonl`, `.jsonl.gz`, `.jsonl.zst` (one document per line, its text under `--text-key`),
`.parquet` (one per row of the `--text-key` column; pyarrow, the `data` extra), anything else
one UTF-8 document per file (data/documents.py: kinds, units of work, bounded pieces, the
split). Everything a unit of work writes depends only on its files and the tokenizer
(data/shards.py: the layout), so the output is the same byte for byte for any `--workers` and
any `--shard i/n`: host i of n prepares units i, i+n, ..., and n hosts sharing DIR together
write exactly what one would. Besides the shards and ledgers, DIR holds `plan.json` (the units,
their files and sizes, the tokenizer's hash and the settings: a prepare into a DIR planned from
other inputs or settings is refused) and, once every unit is done, `meta.json` and a copy of
the tokenizer. Rerunning an interrupted prepare redoes exactly the units without a ledger or
whose shards do not match it. Bad input is an error naming the file and line, or with
`--skip-bad` skipped and counted in meta.json.

With `--chat CHECKPOINT` the inputs are chat JSONL (`{"messages": [...]}` per line, as a chat
run's `task.train`): each conversation is rendered by the checkpoint's chat template (ChatML
when it has none), encoded with its tokenizer (or `--tokenizer`) and written with the
assistant's tokens marked (data/conversations.py), its split keyed by its `id`, else its
messages. A chat run reads DIR as `task: {kind: chat, train: DIR}` (data/chat_rows.py); a line
that is not a conversation is named, or skipped and counted (`skipped_bad_chat`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from llama_jax.cli import user_errors_exit
from llama_jax.data.documents import BAD_KINDS, input_files, plan_units, unit_files
from llama_jax.data.chat_template import CHAT_TEMPLATE_FILE, ChatTemplate
from llama_jax.data.conversations import chat_template_for
from llama_jax.data.shards import (FORMAT_VERSION, SPLITS, Settings, prepare_unit_job,
                                   sha256, token_dtype, unit_done)
from llama_jax.data.tokenizer import (TOKENIZER_FILE, Tokenizer, has_tokenizer, load_tokenizer,
                                      tokenizer_files, tokenizer_sha256)
from llama_jax.errors import CheckpointError, DataError
from llama_jax.files import write_atomically


def prepare(inputs: list[str], tokenizer: str | Path | None, out: str | Path, *,
            workers: int = 1, shard: tuple[int, int] = (0, 1), text_key: str = "text",
            val_fraction: float = 0.05, skip_bad: bool = False, chat: str | Path | None = None,
            log: Callable[[str], None] = print, progress: bool = True) -> dict | None:
    """Prepares this host's units (`shard` = (i, n): units i, i+n, ...) of `inputs` into
    `out` with `workers` processes, skipping units already done; returns meta.json's content
    once every unit of every host is done (this call's or another's), else None. With `chat`
    (a checkpoint), the inputs are chat JSONL, encoded with its chat template and (unless
    `tokenizer` is given) its tokenizer."""
    i, n = shard
    if not (n >= 1 and 0 <= i < n) or workers < 1 or not 0 <= val_fraction < 1:
        raise DataError(f"--shard {i}/{n} needs 0 <= i < n; --workers {workers} >= 1; "
                        f"--val-fraction {val_fraction} in [0, 1)")
    source = _Source.of(tokenizer, chat)
    settings = Settings(source.sha256, text_key, val_fraction, skip_bad)
    out = Path(out)
    units = plan_units(input_files(inputs))
    if chat is not None:
        _check_chat_units(units)
    _keep_plan(out, units, settings, source.template)
    mine = [u for u in range(i, len(units), n) if not unit_done(out, u, units[u])]
    log(f"preparing {len(mine)} of {len(units)} units into {out} with {workers} worker(s)")
    jobs = [(u, units[u], source.path, str(out), settings, source.template) for u in mine]
    bar = _progress_bar(sum(f["bytes"] for u in mine for f in units[u]["files"]), progress)
    tokens, start = 0, time.perf_counter()
    with bar:
        for ledger in _run(jobs, workers):
            tokens += sum(ledger[s]["tokens"] for s in SPLITS)
            bar.update(sum(f["bytes"] for f in ledger["files"]))
            rate = tokens / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(tokens=f"{tokens:,}", tokens_per_s=f"{rate:,.0f}", refresh=False)
    if not all(unit_done(out, u, units[u]) for u in range(len(units))):
        log(f"{out}: this host's units are done; meta.json follows the last host's")
        return None
    meta = _meta(out, units, settings, source)
    # the tokenizer (and template) travel with the tokens: a run reading `out` needs no other
    # copy of them
    for name, content in source.files().items():
        write_atomically(out / name, content)
    write_atomically(out / "meta.json", json.dumps(meta, indent=1).encode())
    return meta


@dataclasses.dataclass(frozen=True)
class _Source:
    """What a prepare encodes with: the tokenizer (`path`, what workers load; `sha256`, its
    identity) and a chat dataset's template."""

    path: str
    sha256: str
    tokenizer: Tokenizer
    template: ChatTemplate | None = None

    @classmethod
    def of(cls, tokenizer: str | Path | None, chat: str | Path | None) -> _Source:
        """--tokenizer (a file; for chat data also a checkpoint), else --chat's checkpoint's."""
        if chat is not None and not Path(chat).expanduser().exists():
            raise DataError(f"--chat {chat}: no such checkpoint")
        given = tokenizer if tokenizer is not None else chat
        if given is None:
            raise DataError("--tokenizer is needed (a tokenizer.model), or --chat CHECKPOINT "
                            "for conversations")
        path = Path(given).expanduser()
        if not (path.is_file() or chat is not None and has_tokenizer(path)):
            raise DataError(f"--tokenizer {given}: no such file" if tokenizer is not None else
                            f"--chat {chat}: the checkpoint has no tokenizer (give --tokenizer)")
        try:
            loaded = load_tokenizer(path)
        except CheckpointError as e:
            raise DataError(f"tokenizer {given}: {e}") from None
        if chat is None:  # a text corpus's tokenizer is its file, as a run's data.tokenizer is
            return cls(str(path), sha256(path), loaded)
        return cls(str(path), tokenizer_sha256(loaded), loaded, chat_template_for([chat]))

    def files(self) -> dict[str, bytes]:
        """The copies kept beside the tokens."""
        if self.template is None:
            return {TOKENIZER_FILE: Path(self.path).read_bytes()}
        return {**tokenizer_files(self.tokenizer), CHAT_TEMPLATE_FILE: self.template.text.encode()}


def _check_chat_units(units: list[dict]) -> None:
    for unit in units:
        if unit["kind"] != "jsonl":
            raise DataError(f"{unit['files'][0]['path']}: conversations are read from JSONL "
                            "(.jsonl, .jsonl.gz, .jsonl.zst), one {\"messages\": [...]} per line")


def _run(jobs: list[tuple], workers: int) -> Iterator[dict]:
    """The units' ledgers as they finish: here, or in `workers` fresh processes (spawned: the
    caller may hold JAX's threads, which a fork would copy mid-flight)."""
    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            yield prepare_unit_job(job)
        return
    with _main_module_hidden():  # the pool starts its workers here
        pool = multiprocessing.get_context("spawn").Pool(min(workers, len(jobs)))
    with pool:
        yield from pool.imap_unordered(prepare_unit_job, jobs)


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Spawned processes run the parent's main module before any work (multiprocessing's
    preparation): a training script's or a benchmark's imports (JAX, the model) cost each
    worker seconds, more than the demo's corpus takes to tokenize. The workers need only
    data/shards.py, so the main module's name and file are hidden while they start."""
    main = sys.modules["__main__"]
    spec, file = getattr(main, "__spec__", None), main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = spec
        if file is not None:
            main.__file__ = file


def _progress_bar(total_bytes: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not enabled,
                desc="prepare", file=sys.stderr)


def _keep_plan(out: Path, units: list[dict], settings: Settings,
               template: ChatTemplate | None) -> None:
    """Writes plan.json, or checks that the one there is this plan: a DIR holds one dataset."""
    plan = {"version": FORMAT_VERSION, "settings": dataclasses.asdict(settings),
            "units": [{"kind": u["kind"], "files": unit_files(u)} for u in units]}
    if template is not None:
        plan["chat_template_sha256"] = template.sha256()
    path = out / "plan.json"
    if path.is_file():
        if json.loads(path.read_text()) != plan:
            raise DataError(f"{out}: prepared from other inputs, tokenizer or settings "
                            f"(its plan.json differs): remove it or choose another --out")
        return
    (out / "shards").mkdir(parents=True, exist_ok=True)
    (out / "ledger").mkdir(exist_ok=True)
    write_atomically(path, json.dumps(plan, indent=1).encode())


def _meta(out: Path, units: list[dict], settings: Settings, source: _Source) -> dict:
    """meta.json from the ledgers: nothing in it depends on how the work was spread."""
    ledgers = [json.loads((out / "ledger" / f"{u:05d}.json").read_text())
               for u in range(len(units))]
    totals = {split: {key: sum(led[split][key] for led in ledgers)
                      for key in ("tokens", "documents")} for split in SPLITS}
    counted = ["empty_documents", *(f"skipped_{k}" for k in BAD_KINDS)]
    kind = {"kind": "text"} if source.template is None else {
        "kind": "chat", "chat_template_sha256": source.template.sha256(),
        "chat_template_source": source.template.source}
    vocab_size = source.tokenizer.vocab_size
    return {"version": FORMAT_VERSION, **kind, "tokenizer_sha256": settings.tokenizer_sha256,
            "vocab_size": vocab_size, "dtype": token_dtype(vocab_size).name,
            "text_key": settings.text_key, "val_fraction": settings.val_fraction,
            "split_key": settings.split_key, "files": sum(len(u["files"]) for u in units), **totals,
            **{key: sum(led.get(key, 0) for led in ledgers) for key in counted},
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
    parser.add_argument("--tokenizer", help="a SentencePiece tokenizer.model (with --chat: "
                        "default the checkpoint's tokenizer)")
    parser.add_argument("--chat", metavar="CHECKPOINT",
                        help="the inputs are chat JSONL ({\"messages\": [...]} per line), "
                             "encoded with this checkpoint's chat template (ChatML when it has "
                             "none) and tokenizer, the assistant's tokens marked")
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
                   val_fraction=args.val_fraction, skip_bad=args.skip_bad, chat=args.chat,
                   log=lambda line: print(line, file=sys.stderr), progress=not args.no_progress)
    if meta is not None:
        what = "conversations" if args.chat else "documents"
        print(f"{args.out}: {meta['train']['tokens']:,} training and {meta['val']['tokens']:,} "
              f"validation tokens ({meta['train']['documents']:,} and "
              f"{meta['val']['documents']:,} {what}) in {len(meta['shards'])} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
