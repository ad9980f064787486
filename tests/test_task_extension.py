"""A task kind added from outside the package, the way a user adds one: this file registers a
toy kind, `multi_label`, in `HEADS` (one `Head` with its `Task`) and nothing in llama_jax names
it. A fine-tuning run trains it through the trainer — its examples read, batched and shaped from
the kind's target field, shape and dtype, its loss and validation metrics the kind's — and
predict prints its lines and its metrics: what the task data, the trainer and predict ask of a
task kind is the `Task` and nothing more.

The toy is multi-label classification (transformers' `problem_type:
multi_label_classification`): one logit per label from the pooled state, each label present or
not on its own (JSONL `tags`: one number per label, 1 when present), binary cross-entropy summed
over the labels, and as metric the share of labels predicted right.

The checks run in a fresh process (`python tests/test_task_extension.py`): a kind registered
here stays registered, and would otherwise be a choice in the other tests' configs."""

import contextlib
import io
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml

import llama_jax
from llama_jax.config import ModelConfig
from llama_jax.data import tasks as task_data
from llama_jax.data.tokenizer import train_sentencepiece
from llama_jax.eval import predict
from llama_jax.nn.heads import HEADS, Head, Task, pool, real_tokens
from llama_jax.nn.ops import einsum_f32
from llama_jax.spec import weight
from llama_jax.training import finetune, tasks, trainer
from fresh_process import passes_alone

TAGS = ["apple", "banana", "cherry"]
FILLER = "the a of to in is was for on with as by at from this that it we you they".split()


def tags_specs(config: ModelConfig) -> dict:
    return {"head": {"w": weight(config.dims, "DO", ("embed", "labels"))}}


def tags_apply(config: ModelConfig, params: dict, h_BTD, tokens_BT):
    pooled_BD = pool(config, h_BTD, real_tokens(config, tokens_BT))
    return einsum_f32("BD,DO->BO", pooled_BD, params["head"]["w"].astype(h_BTD.dtype))


def tags_sums(config: ModelConfig, logits_BO, batch: dict) -> dict:
    """Binary cross-entropy per label, summed over the labels; labels predicted right."""
    tags_BO, weight_B = batch["tags"], batch["weight"]
    bce_BO = jnp.logaddexp(0.0, logits_BO) - logits_BO * tags_BO
    right_BO = (logits_BO > 0) == (tags_BO > 0.5)
    return {"loss_sum": jnp.sum(bce_BO.sum(-1) * weight_B), "count": jnp.sum(weight_B),
            "right": jnp.sum(right_BO * weight_B[:, None]),
            "scored": jnp.sum(weight_B) * config.n_labels}


def tags_metrics(sums: dict) -> dict[str, float]:
    return {"label_accuracy": float(sums["right"]) / max(float(sums["scored"]), 1.0)}


def tags_describe(config: ModelConfig, example: dict, logits_O: np.ndarray) -> dict:
    names = config.names_of_labels
    return {"tags": [n for n, logit in zip(names, logits_O) if logit > 0]}


def register_multi_label():
    HEADS.register("multi_label", Head(
        tags_specs, tags_apply, lambda config: config.dim * config.n_labels, pooled=True,
        min_labels=1,
        task=Task("tags", "O", np.float32, tags_sums, tags_metrics, tags_describe)))


def write_task(path: Path, n: int, seed: int) -> Path:
    """Filler words with a random subset of the tags among them."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        present = rng.random(len(TAGS)) < 0.5
        words = list(rng.choice(FILLER, 4)) + [t for t, p in zip(TAGS, present) if p]
        rng.shuffle(words)
        lines.append(json.dumps({"text": " ".join(words), "tags": present.astype(int).tolist()}))
    path.write_text("\n".join(lines) + "\n")
    return path


def pretrained(root: Path) -> Path:
    """A random language model with a SentencePiece tokenizer: what init_from reads."""
    config = ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         ffn_dim=64, max_seq_len=64, init_std=0.1)
    llama_jax.save_native(config, llama_jax.init_params(config, jax.random.key(0)), root)
    text = [" ".join(FILLER + TAGS)] * 30 + ["Numbers and words: 12 34 the cat sat."] * 10
    (root / "tokenizer.model").write_bytes(train_sentencepiece(text, 300))
    return root


def check_it_trains(root: Path):
    """A run of the toy kind: its batches have the kind's shapes (the compiled step's), the
    validation loss falls, and its metrics are printed with the loss."""
    tree = {"init_from": str(pretrained(root / "lm")),
            "task": {"kind": "multi_label", "train": str(write_task(root / "train.jsonl", 96, 0)),
                     "val": str(write_task(root / "val.jsonl", 24, 1)), "labels": TAGS,
                     "pooling": "mean"},
            "train": {"seq_len": 16, "batch_size": 16, "steps": 30, "learning_rate": 1e-2,
                      "warmup_steps": 2, "log_every": 15, "eval_every": 15,
                      "checkpoint_every": 30}}
    (root / "task.yaml").write_text(yaml.safe_dump(tree))
    run = finetune.load_run_config(root / "task.yaml")
    tokenizer = llama_jax.load_tokenizer(root / "lm")
    examples = task_data.read_examples(root / "val.jsonl", run.task, run.model, tokenizer, 16)
    [batch] = task_data.val_batches(examples, "multi_label", 16, run.model.pad_id, 24)
    abstract = tasks.abstract_batch(run)
    assert batch["tags"].shape == (24, 3) and batch["tags"].dtype == np.float32
    assert {k: v.dtype for k, v in abstract.items()} == {k: v.dtype for k, v in batch.items()}
    assert abstract["tags"].shape == (16, 3)
    lines = []
    outcome = trainer.train(run, root / "run", log=lines.append, progress=False)
    evaluations = [line for line in lines if line.startswith("step ") and
                   "val_label_accuracy" in line]
    assert len(evaluations) == 2, lines
    assert any(line.startswith("before training: val_loss") for line in lines), lines
    assert set(outcome.val_metrics) == {"val_loss", "val_label_accuracy"}
    first_loss = float(evaluations[0].split("val_loss ")[1].split()[0])
    assert outcome.val_loss < first_loss, evaluations
    return examples, outcome


def check_it_predicts(root: Path, examples: list, outcome):
    """predict's lines are the kind's `describe` of the checkpoint's outputs, and its metrics
    (every example carries `tags`) are the run's validation metrics: the same sums."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        predict.main(["--checkpoint", str(root / "run"), "--input", str(root / "val.jsonl"),
                      "--max-len", "16"])
    config, params = llama_jax.load_checkpoint(root / "run")
    forward = jax.jit(llama_jax.forward, static_argnums=0)  # once per example length
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == len(examples)
    for line, example in zip(lines, examples):
        logits_O = np.asarray(forward(config, params, example["tokens"][None]))[0]
        assert line == {"tags": [t for t, logit in zip(TAGS, logits_O) if logit > 0]}
    expected = (f"loss {outcome.val_metrics['val_loss']:.4f} label_accuracy "
                f"{outcome.val_metrics['val_label_accuracy']:.4f}")
    assert err.getvalue().startswith(expected), (err.getvalue(), expected)


def main():
    register_multi_label()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        examples, outcome = check_it_trains(root)
        check_it_predicts(root, examples, outcome)
    print("ok")


def test_a_task_kind_registered_from_outside_trains_and_predicts():
    passes_alone(__file__)


if __name__ == "__main__":
    main()
