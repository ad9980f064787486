"""The chat fine-tuning recipe's data (`make chat-tune`): questions about the modules of Python's
standard library, each answered by the first paragraph of the module's page in the Python
documentation (the demo corpus).

    python -m llama_jax.research.module_chats build [--corpus DIR] [--out runs/module_chats]
    python -m llama_jax.research.module_chats answers CHECKPOINT [--data DIR] [--n 3]

`build` writes `train.jsonl` and `val.jsonl`, one conversation per module page
(`library/NAME.rst.txt` with a `.. module::` directive): the user asks about the module (one of
`QUESTIONS`, chosen by the module's name), the assistant answers with the page's first prose
paragraph, its reStructuredText markup reduced to plain text and cut after `MAX_SENTENCES`
sentences. Each record's `id` is the module's name, which decides its split
(`documents.held_out_keys`), so the validation modules are ones the run never trains on.
`answers` prints a checkpoint's greedy answers to the first validation questions, with the
documentation's, as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from llama_jax.cli import user_errors_exit
from llama_jax.config import DEFAULT_CORPUS
from llama_jax.data.corpus import read_document
from llama_jax.data.documents import held_out_keys, unit_hash
from llama_jax.errors import DataError
from llama_jax.research.doc_task import paragraphs

QUESTIONS = ("What is the Python module {name} for?", "What does the {name} module do?",
             "Tell me about Python's {name} module.", "When would I use {name} in Python?")
MAX_SENTENCES = 2
VAL_FRACTION = 0.1
DATA = Path("runs/module_chats")
# reStructuredText inline markup -> its text: roles (:mod:`json`, :func:`~os.path.join`,
# :rfc:`7159`), links (`text <url>`_), literals (``x``), emphasis, footnote references
_ROLE = re.compile(r":(\w+)(?::\w+)?:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`__?")
_LIST_ITEM = re.compile(r"([*+-]|#\.|\d+\.)\s")  # a paragraph that is a list's item
_MARKUP = re.compile(r"``|\*\*|(?<!\w)\*(?=\S)|(?<=\S)\*(?!\w)|\s*\[#[^\]]*\]_|`_?")


def plain(text: str) -> str:
    """A paragraph's reStructuredText markup reduced to the text a reader sees."""
    text = _ROLE.sub(lambda m: ("RFC " if m.group(1) == "rfc" else
                                "PEP " if m.group(1) == "pep" else "") + m.group(2), text)
    text = _MARKUP.sub("", _LINK.sub(r"\1", text)).replace("\\", "")
    return re.sub(r"\s+", " ", text).strip()


def first_sentences(text: str, n: int = MAX_SENTENCES) -> str:
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z(])", text)
    return " ".join(sentences[:n])


def conversation(name: str, answer: str) -> dict:
    question = QUESTIONS[int(unit_hash(name) * len(QUESTIONS))].format(name=name)
    return {"id": name, "messages": [{"role": "user", "content": question},
                                     {"role": "assistant", "content": answer}]}


def module_conversations(corpus: Path) -> list[dict]:
    """One conversation per documented module that has a prose paragraph (not a list item or
    a table), by module name."""
    library = corpus / "library"
    if not library.is_dir():
        raise DataError(f"corpus {corpus}: no library/ directory: expected the Python "
                        "documentation sources (Debian's python3.11-doc)")
    out = {}
    for path in sorted(library.glob("*.rst.txt")):
        text = read_document(path)
        module = re.search(r"^\.\. module:: ([\w.]+)", text, re.M)
        prose = [p for p in paragraphs(text) if not _LIST_ITEM.match(p) and "===" not in p]
        if module and prose and module.group(1) not in out:
            out[module.group(1)] = conversation(module.group(1), first_sentences(plain(prose[0])))
    return list(out.values())


def build(corpus: Path, out: Path, val_fraction: float = VAL_FRACTION) -> dict[str, int]:
    """Writes out/train.jsonl and out/val.jsonl; returns the conversations in each."""
    records = module_conversations(corpus)
    held_out = held_out_keys([r["id"] for r in records], val_fraction) or set()
    splits = {"train": [r for r in records if r["id"] not in held_out],
              "val": [r for r in records if r["id"] in held_out]}
    out.mkdir(parents=True, exist_ok=True)
    for name, split in splits.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split))
    return {name: len(split) for name, split in splits.items()}


def answers(checkpoint: str, data: Path, n: int, max_new_tokens: int = 96) -> list[dict]:
    """The checkpoint's greedy answers to the first `n` validation questions."""
    import llama_jax
    from llama_jax.data.chat import chat_format

    records = [json.loads(line) for line in (data / "val.jsonl").read_text().splitlines()][:n]
    tokenizer = llama_jax.load_tokenizer(checkpoint)
    config, params = llama_jax.load_checkpoint(checkpoint)
    render = chat_format(checkpoint, tokenizer)
    prompts = [render(r["messages"][:1]) for r in records]
    generated = llama_jax.generate(config, params, prompts, max_new_tokens)
    return [{"question": r["messages"][0]["content"], "answer": tokenizer.decode(tokens),
             "documentation": r["messages"][1]["content"]}
            for r, tokens in zip(records, generated)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m llama_jax.research.module_chats",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build", help="write train.jsonl and val.jsonl")
    build_cmd.add_argument("--corpus", default=DEFAULT_CORPUS)
    build_cmd.add_argument("--out", default=str(DATA))
    answer_cmd = commands.add_parser("answers", help="a checkpoint's answers to validation "
                                                     "questions")
    answer_cmd.add_argument("checkpoint")
    answer_cmd.add_argument("--data", default=str(DATA))
    answer_cmd.add_argument("--n", type=int, default=3)
    return parser.parse_args(argv)


@user_errors_exit
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "build":
        counts = build(Path(args.corpus), Path(args.out))
        print(f"wrote {args.out}: {counts['train']} training and {counts['val']} validation "
              "conversations")
        return 0
    for record in answers(args.checkpoint, Path(args.data), args.n):
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
