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
- regression: `{"target": [value per output]}`;
each the `describe` of the head's task (nn/heads.py). When every input line carries the task's
target field, its metrics (accuracy and macro-F1, or RMSE) over the file go to stderr.
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

from llama_jax.nn.heads import HEADS, is_task_head, task_metrics
from llama_jax.data import tasks as task_data
from llama_jax.formats.checkpoint import load_checkpoint
from llama_jax.cli import user_errors_exit
from llama_jax.config import DTYPES, ModelConfig, TaskConfig
from llama_jax.errors import ConfigError
from llama_jax.shapes import bucket
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
    if not is_task_head(config):
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


def scores(config: ModelConfig, examples: list[dict[str, Any]],
           outputs: list[np.ndarray]) -> dict[str, float]:
    """The task's metrics of the predictions: the sums validation adds up (training/tasks.py)
    over every example at once, as one batch; per-token outputs are padded to its length with
    zeros, which are not scored."""
    T = max(len(e["tokens"]) for e in examples)
    [batch] = task_data.val_batches(examples, config.head, T, pad_id=0, batch_size=len(examples))
    outputs = np.stack([np.pad(o, [(0, T - len(o)), (0, 0)]) if o.ndim == 2 else o
                        for o in outputs])
    sums = HEADS[config.head].task.sums(config, jnp.asarray(outputs), batch)
    return task_metrics(config.head, jax.device_get(sums))


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
    head_task = HEADS[config.head].task
    for example, output in zip(examples, outputs):
        print(json.dumps(head_task.describe(config, example, output)))
    if all(head_task.field in e for e in examples):
        print(" ".join(f"{k} {v:.4f}" for k, v in scores(config, examples, outputs).items()),
              f"({len(examples)} examples)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
