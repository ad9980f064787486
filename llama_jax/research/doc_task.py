"""The demo downstream task: which part of the Python documentation a paragraph comes from.

    python -m llama_jax.research.doc_task build [--corpus DIR] [--out runs/doc_task/data]
    python -m llama_jax.research.doc_task baselines [--data runs/doc_task/data]

`build` reads the documentation sources (Debian's python3.11-doc, the demo corpus) and writes
`train.jsonl` and `val.jsonl`: one line per prose paragraph (at least `MIN_WORDS` words; code,
directives and headings are skipped) with its part — the top-level directory it sits under,
one of `PARTS` — as the label. Documents are split by a hash of their path, so every
paragraph of a document is on the same side and the model is judged on documents it has not
been fine-tuned on. `baselines` scores the two references a fine-tuned model must beat on
the validation split: the majority class of the training split, and a bag-of-words logistic
regression (scikit-learn, installed with the dev extra).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

from llama_jax.cli import user_errors_exit
from llama_jax.config import DEFAULT_CORPUS
from llama_jax.data.corpus import read_document
from llama_jax.data.documents import unit_hash
from llama_jax.errors import DataError

PARTS = ("library", "c-api", "reference", "tutorial", "howto", "whatsnew", "faq")
MIN_WORDS = 20
VAL_FRACTION = 0.2
HEADING_CHARS = set("=-~^*#+'`\"")


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a reStructuredText source, each joined into one line: blocks
    of at least MIN_WORDS words that are not a directive, a literal (code) block — the
    indented blocks after a `::` or a directive —, a heading or an interactive session."""
    out, literal_indent = [], None
    for block in re.split(r"\n[ \t]*\n", text):
        lines = [line for line in block.split("\n") if line.strip()]
        if not lines:
            continue
        indent = len(lines[0]) - len(lines[0].lstrip())
        if literal_indent is not None and indent > literal_indent:
            continue
        literal_indent = None
        first = lines[0].strip()
        if first.startswith("..") or block.rstrip().endswith("::"):
            literal_indent = indent
            if first.startswith(".."):
                continue
        if ">>>" in block or any(set(line.strip()) <= HEADING_CHARS for line in lines):
            continue
        paragraph = " ".join(line.strip() for line in lines)
        if len(paragraph.split()) >= MIN_WORDS:
            out.append(paragraph)
    return out


def build(corpus: Path, out: Path, val_fraction: float = VAL_FRACTION) -> dict[str, dict]:
    """Writes out/train.jsonl and out/val.jsonl; returns the paragraph count per split and
    part."""
    missing = [part for part in PARTS if not (corpus / part).is_dir()]
    if missing:
        raise DataError(f"corpus {corpus}: no {', '.join(missing)} director(y/ies): expected "
                        "the Python documentation sources (Debian's python3.11-doc)")
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, collections.Counter] = {"train": collections.Counter(),
                                              "val": collections.Counter()}
    files = {name: (out / f"{name}.jsonl").open("w") for name in counts}
    with files["train"], files["val"]:
        for part in PARTS:
            for path in sorted(p for p in (corpus / part).rglob("*") if p.is_file()):
                document = path.relative_to(corpus).as_posix()
                split = "val" if unit_hash(document) < val_fraction else "train"
                for paragraph in paragraphs(read_document(path)):
                    files[split].write(json.dumps({"text": paragraph, "label": part,
                                                   "group": document}) + "\n")
                    counts[split][part] += 1
    return {name: dict(counter) for name, counter in counts.items()}


def read(path: Path) -> tuple[list[str], list[str]]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["text"] for r in records], [r["label"] for r in records]


def baselines(data: Path) -> dict[str, dict[str, float]]:
    """Accuracy and macro-F1 on the validation split of the majority class and of a
    bag-of-words (unigram and bigram counts, TF-IDF) logistic regression."""
    try:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression
        from sklearn.metrics import accuracy_score, f1_score
    except ImportError:
        raise DataError("the baselines need scikit-learn (pip install scikit-learn, or the "
                        "dev extra)") from None
    train_text, train_label = read(data / "train.jsonl")
    val_text, val_label = read(data / "val.jsonl")
    majority = collections.Counter(train_label).most_common(1)[0][0]
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    classifier = LogisticRegression(max_iter=2000, C=10.0)
    classifier.fit(vectorizer.fit_transform(train_text), train_label)
    predictions = {"majority class": [majority] * len(val_label),
                   "bag-of-words logistic regression": list(
                       classifier.predict(vectorizer.transform(val_text)))}
    return {name: {"accuracy": accuracy_score(val_label, guess),
                   "macro_f1": f1_score(val_label, guess, average="macro", labels=list(PARTS),
                                        zero_division=0)}
            for name, guess in predictions.items()}


@user_errors_exit
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("build", help="write train.jsonl and val.jsonl")
    make.add_argument("--corpus", default=DEFAULT_CORPUS)
    make.add_argument("--out", default="runs/doc_task/data")
    score = commands.add_parser("baselines", help="majority class and bag-of-words scores")
    score.add_argument("--data", default="runs/doc_task/data")
    args = parser.parse_args(argv)
    if args.command == "build":
        counts = build(Path(args.corpus), Path(args.out))
        for split, parts in counts.items():
            print(f"{split}: {sum(parts.values())} paragraphs "
                  + ", ".join(f"{part} {parts.get(part, 0)}" for part in PARTS))
    else:
        for name, scores in baselines(Path(args.data)).items():
            print(f"{name}: accuracy {scores['accuracy']:.4f} macro_f1 {scores['macro_f1']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
