"""Predict with a fine-tuned task model: one JSON line per input line.

    python -m llama_jax.eval.predict --checkpoint DIR --input file.jsonl [--batch-size 32]
                                [--max-len N] [--dtype float32] [--tokenizer tokenizer.model]

The checkpoint is any directory `load_checkpoint` reads whose model has a task head (a
fine-tuning run's workdir, a native checkpoint, an HF `LlamaForSequenceClassification` /
`LlamaForTokenClassification`); the input is JSONL with `text` (labels may be present and are
then scored). Output, per line:
- sequence_classification: `{"label": NAME, "probabilities": {NAME: p, ...}}`;
- token_classification: `{"labels": [NAME per word], "probabilities": [[p per label] per
  word]}` (each word's prediction is its first token's);
- regression: `{"target": [value per output]}`.
When every input line carries the task's target field, the metrics (accuracy and macro-F1, or
RMSE) over the file go to stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.nn import heads
from llama_jax.training import tasks
from llama_jax.data import tasks as task_data
from llama_jax.formats.checkpoint import load_checkpoint
from llama_jax.cli import user_errors_exit
from llama_jax.config import DTYPES, ModelConfig, TaskConfig
from llama_jax.errors import ConfigError
from llama_jax.decode.generate import bucket
from llama_jax.model.transformer import forward
from llama_jax.data.tokenizer import load_tokenizer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a checkpoint with a task head")
    parser.add_argument("--input", required=True, help="a JSONL file with `text` per line")
    parser.add_argument("--tokenizer", help="tokenizer.model (default: the checkpoint's)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=None,
                        help="tokens read per input, the rest cut (default: the model's "
                             "max_seq_len; a run's train.seq_len reproduces its evaluation)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="parameter and compute dtype (default: as stored)")
    return parser.parse_args(argv)


def task_of(config: ModelConfig, input_path: str) -> TaskConfig:
    """The task a model's head serves, reading `input_path`."""
    if not heads.is_task_head(config):
        raise ConfigError("the checkpoint has the LM head, not a task head: sample from it "
                          "with sample.py, or fine-tune it on a task (train.py with `task:`)")
    return TaskConfig(kind=config.head, train=input_path,
                      labels=config.label_names or config.n_labels,
                      pooling=config.pooling or "last")


def predict(config: ModelConfig, params, examples: list[dict[str, Any]],
            batch_size: int) -> list[np.ndarray]:
    """The head's fp32 outputs per example (`[O]`, or `[T, O]` over its tokens), in batches
    padded to a power-of-two length (few compiled shapes). A model without a pad id (an HF
    checkpoint without `pad_token_id`) would read padding as text: each example then runs
    alone, unpadded."""
    run = jax.jit(functools.partial(forward, config))
    padded = config.pad_id is not None
    batch_size = batch_size if padded else 1
    outputs = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        longest = max(len(e["tokens"]) for e in chunk)
        T = min(bucket(longest), config.max_seq_len) if padded else longest
        tokens_BT = np.full((batch_size, T), config.pad_id if padded else 0, np.int32)
        for i, e in enumerate(chunk):
            tokens_BT[i, :len(e["tokens"])] = e["tokens"]
        out = np.asarray(run(params, jnp.asarray(tokens_BT)))
        outputs += [out[i] if out.ndim == 2 else out[i, :len(e["tokens"])]
                    for i, e in enumerate(chunk)]
    return outputs


def describe(config: ModelConfig, example: dict[str, Any], output: np.ndarray) -> dict:
    """One output line (see the module docstring)."""
    names = config.names_of_labels
    if config.head == "regression":
        return {"target": [float(v) for v in output]}
    probabilities = np.asarray(jax.nn.softmax(output, axis=-1))
    if config.head == "sequence_classification":
        return {"label": names[int(np.argmax(output))],
                "probabilities": {n: round(float(p), 6) for n, p in zip(names, probabilities)}}
    first = [i for i in example["first_token"] if i < len(output)]  # words past truncation
    return {"labels": [names[int(np.argmax(output[i]))] for i in first],
            "probabilities": [[round(float(p), 6) for p in probabilities[i]] for i in first]}


def scores(config: ModelConfig, examples: list[dict[str, Any]],
           outputs: list[np.ndarray]) -> dict[str, float]:
    """The task's metrics of the predictions: the sums validation adds up (tasks.py) over
    every example (or every scored token) at once."""
    field = task_data.TARGET_FIELD[config.head]
    if config.head == "regression":
        target_BO = np.stack([e[field] for e in examples])
        sums = heads.regression_sums(np.stack(outputs), target_BO, np.ones(len(examples)))
    else:  # rows X: the examples, or their tokens (-1: a token without a word's label)
        rows = [(np.atleast_1d(e[field]), np.reshape(o, (-1, config.n_labels)))
                for e, o in zip(examples, outputs)]
        label_X = np.concatenate([labels for labels, _ in rows])
        logits_XO = np.concatenate([logits[:len(labels)] for labels, logits in rows])
        sums = heads.classification_sums(logits_XO, label_X, (label_X >= 0).astype(np.float32))
    return tasks.metrics(jax.device_get(sums))


@user_errors_exit
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size}: must be a positive integer")
    config, params = load_checkpoint(args.checkpoint, args.dtype)
    max_len = config.max_seq_len if args.max_len is None else args.max_len
    if not 0 < max_len <= config.max_seq_len:
        raise ConfigError(f"--max-len {max_len}: must be in [1, max_seq_len="
                          f"{config.max_seq_len}]")
    task = task_of(config, args.input)
    tokenizer = load_tokenizer(args.tokenizer or args.checkpoint)
    examples = task_data.read_examples(args.input, task, config, tokenizer, max_len,
                                       targets=False)
    outputs = predict(config, params, examples, args.batch_size)
    for example, output in zip(examples, outputs):
        print(json.dumps(describe(config, example, output)))
    if all(task_data.TARGET_FIELD[config.head] in e for e in examples):
        print(" ".join(f"{k} {v:.4f}" for k, v in scores(config, examples, outputs).items()),
              f"({len(examples)} examples)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
