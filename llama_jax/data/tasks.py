"""A downstream task's data: JSONL files → tokenized, labelled examples → padded batches.

One JSON object per line with `text` and the target field of the task's kind, read as the
kind's target shape says (`Task`, nn/heads.py):
- one class (sequence_classification's `label`): a class name of `task.labels` or its index;
- per token (token_classification's `labels`): a class per word, where `text` is a list of
  words or a string split at whitespace; each word is tokenized on its own (after a space, as
  it appears in running text) and its label goes to its first token, the others are not scored
  (as transformers' token-classification recipe does);
- O values (regression's `target`): a number or a list of `task.labels` numbers.
An optional `group` (any JSON value) keeps examples together when the validation split is held
out of the training file: by a hash of the group (else of the text), so the split is stable
and, say, paragraphs of one document never straddle it.

Every example is tokenized with BOS, truncated to `train.seq_len` tokens and padded on the
right with the model's pad id, so every batch has one shape (one compiled step). Batches are
dicts of arrays: `tokens [B, T]`, the targets under their field (`label [B]`, `labels [B, T]`
with -1 where not scored, `target [B, O]`) and `weight [B]` (0 for the rows that fill the last
validation batch). Training order is grain's, shuffled by seed and checkpointed with the run,
as for pretraining (batches.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import grain
import numpy as np

from llama_jax.config import ModelConfig, TaskConfig
from llama_jax.data.batches import shuffled_batches
from llama_jax.data.documents import held_out_keys, jsonl_records
from llama_jax.errors import DataError
from llama_jax.data.tokenizer import Tokenizer
from llama_jax.nn.heads import HEADS

IGNORED = -1  # a token or row label that is not scored


def read_examples(path: str | Path, task: TaskConfig, model: ModelConfig, tokenizer: Tokenizer,
                  seq_len: int, targets: bool = True) -> list[dict[str, Any]]:
    """Every line of a JSONL file as `{tokens, <target>, group, truncated}` (unpadded; without
    `targets`, the target only where a line has one, and `words` for token classification);
    an error naming the file, line and field for the first bad one."""
    examples = [_example(record, where, task, model, tokenizer, seq_len, targets)
                for where, record in jsonl_records(path, "task")]
    if not examples:
        raise DataError(f"task file {path}: no examples")
    return examples


def _example(record: Any, where: str, task: TaskConfig, model: ModelConfig,
             tokenizer: Tokenizer, seq_len: int, targets: bool) -> dict[str, Any]:
    head_task = HEADS[task.kind].task
    field = head_task.field
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for name in ("text", field) if targets else ("text",):
        if name not in record:
            raise DataError(f"{where}: missing field {name!r} (a {task.kind} example has "
                            f"'text' and {field!r})")
    text, example = record["text"], {}
    if head_task.target == "T":  # per token: the words, a target on each one's first token
        words = _words(text, where)
        tokens, first = _word_tokens(words, tokenizer)
        example["first_token"] = first
        if field in record:
            example[field] = _word_labels(record[field], first, where, task)[:seq_len]
    else:
        if not isinstance(text, str):
            raise DataError(f"{where}: 'text' must be a string, got {type(text).__name__}")
        tokens = tokenizer.encode(text, bos=True)
        if field in record:
            example[field] = (_target(record[field], where, task) if head_task.target == "O"
                              else _label(record[field], where, field, task))
    example["truncated"] = len(tokens) > seq_len
    tokens = np.asarray(tokens[:seq_len], np.int32)
    if model.pad_id is not None and np.any(tokens == model.pad_id):
        raise DataError(f"{where}: the text encodes to the pad id {model.pad_id}, which would "
                        "be read as padding; choose another model.pad_id")
    group = json.dumps(record.get("group", text), sort_keys=True)
    return {**example, "tokens": tokens, "group": group}


def _label(value: Any, where: str, field: str, task: TaskConfig) -> int:
    """A class index from its name or index, checked against the head's range."""
    names = task.label_names or ()
    if isinstance(value, str) and value in names:
        return names.index(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < task.n_labels:
        return value
    known = f"one of {list(names)} or an index" if names else "an index"
    raise DataError(f"{where}: {field} {value!r} is outside the head's {task.n_labels} labels "
                    f"(expected {known} in [0, {task.n_labels}))")


def _target(value: Any, where: str, task: TaskConfig) -> np.ndarray:
    values = value if isinstance(value, list) else [value]
    if len(values) != task.n_labels or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in values):
        raise DataError(f"{where}: target {value!r} must be {task.n_labels} finite number(s)")
    return np.asarray(values, np.float32)


def _words(text: Any, where: str) -> list[str]:
    words = text.split() if isinstance(text, str) else text
    if not isinstance(words, list) or not words or not all(isinstance(w, str) and w
                                                          for w in words):
        raise DataError(f"{where}: 'text' must be a string or a list of non-empty words")
    return words


def _word_tokens(words: list[str], tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """BOS and each word's tokens, and the index of each word's first token."""
    tokens, first = [tokenizer.bos_id], []
    for i, word in enumerate(words):
        first.append(len(tokens))
        tokens += tokenizer.encode(word if i == 0 else " " + word, bos=False)
    return tokens, first


def _word_labels(labels: Any, first: list[int], where: str, task: TaskConfig) -> np.ndarray:
    """Per token: each word's label on its first token, IGNORED elsewhere."""
    if not isinstance(labels, list) or len(labels) != len(first):
        raise DataError(f"{where}: 'labels' must be a list of one label per word "
                        f"({len(first)} words)")
    target = np.full(first[-1] + 1, IGNORED, np.int32) if first else np.zeros(0, np.int32)
    for index, label in zip(first, labels):
        target[index] = _label(label, where, "labels", task)
    return target


def split(examples: list[dict[str, Any]], val_fraction: float
          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, validation): a group goes to validation when its hash is below val_fraction;
    at least one group on each side."""
    held_out = held_out_keys((e["group"] for e in examples), val_fraction)
    if held_out is None:
        groups = len({e["group"] for e in examples})
        raise DataError(f"{len(examples)} example(s) in {groups} group: need at least two "
                        "to hold one out for validation (or give task.val)")
    return ([e for e in examples if e["group"] not in held_out],
            [e for e in examples if e["group"] in held_out])


def padded(example: dict[str, Any], kind: str, seq_len: int, pad_id: int,
           weight: float = 1.0) -> dict[str, np.ndarray]:
    """One example as fixed-shape arrays: tokens (and per-token labels) padded to seq_len."""
    n = len(example["tokens"])
    tokens = np.full(seq_len, pad_id, np.int32)
    tokens[:n] = example["tokens"]
    head_task = HEADS[kind].task
    target = np.asarray(example[head_task.field], head_task.dtype)
    if head_task.target == "T":  # past the last word's first token: not scored
        target = np.concatenate([target, np.full(seq_len - len(target), IGNORED,
                                                 head_task.dtype)])
    return {"tokens": tokens, "weight": np.float32(weight), head_task.field: target}


class _Padded:
    """Random-access source of padded examples (grain's MapDataset reads it)."""

    def __init__(self, examples: list[dict[str, Any]], kind: str, seq_len: int, pad_id: int):
        self.examples, self.kind, self.seq_len, self.pad_id = examples, kind, seq_len, pad_id

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return padded(self.examples[i], self.kind, self.seq_len, self.pad_id)


def train_batches(examples: list[dict[str, Any]], kind: str, seq_len: int, pad_id: int,
                  batch_size: int, seed: int, process_index: int = 0,
                  process_count: int = 1) -> grain.DatasetIterator:
    """Endless shuffled batches, reshuffled every epoch; this process's rows of each (as
    data.train_batches)."""
    if len(examples) < batch_size:
        raise DataError(f"the training split has {len(examples)} examples: fewer than one "
                        f"batch of {batch_size}; lower train.batch_size")
    return shuffled_batches(_Padded(examples, kind, seq_len, pad_id), batch_size, seed,
                            process_index, process_count)


def val_batches(examples: list[dict[str, Any]], kind: str, seq_len: int, pad_id: int,
                batch_size: int, process_index: int = 0,
                process_count: int = 1) -> list[dict[str, np.ndarray]]:
    """Every validation example once, in file order; the last batch filled with weight-0
    copies of the first example; this process's rows of each batch."""
    n_batches = -(-len(examples) // batch_size)
    rows = [padded(e, kind, seq_len, pad_id) for e in examples]
    rows += [padded(examples[0], kind, seq_len, pad_id, weight=0.0)
             for _ in range(n_batches * batch_size - len(examples))]
    return [{name: np.stack([rows[b * batch_size + i][name]
                             for i in range(process_index, batch_size, process_count)])
             for name in rows[0]}
            for b in range(n_batches)]
