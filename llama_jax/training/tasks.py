"""Downstream tasks' losses and metrics, as pure functions of (params, batch).

- sequence_classification: cross-entropy of the pooled head's logits `[B, O]`;
- token_classification: cross-entropy per scored token (label >= 0) of `[B, T, O]`;
- regression: squared error of `[B, O]`, averaged over the O targets (MSE);
each the `sums` of its head kind (nn/heads.py).
Losses are sums over the scored rows (or tokens) with their count, like the language-modelling
loss (step.py), so micro-batches and validation batches add up. Validation adds the
statistics the metrics need, also as sums: the confusion matrix for classification (accuracy
and macro-F1 follow from it, over any number of batches) and the squared error per target for
regression (RMSE).

With `train.freeze: backbone` the gradient stops at the final hidden states: only the head's
backward pass runs (the optimizer also leaves the backbone untouched, optim.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.config import ModelConfig, RunConfig
from llama_jax.model.transformer import apply, aux_loss
from llama_jax.nn.heads import HEADS, apply_head, padding_layout
from llama_jax.model.params import Params


def abstract_batch(run: RunConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of a task's batch (data/tasks.py)."""
    B, T, O = run.train.batch_size, run.train.seq_len, run.model.n_labels
    targets = {"sequence_classification": ("label", (B,), jnp.int32),
               "token_classification": ("labels", (B, T), jnp.int32),
               "regression": ("target", (B, O), jnp.float32)}
    name, shape, dtype = targets[run.task.kind]
    return {"tokens": jax.ShapeDtypeStruct((B, T), jnp.int32),
            "weight": jax.ShapeDtypeStruct((B,), jnp.float32),
            name: jax.ShapeDtypeStruct(shape, dtype)}


def loss_sums(config: ModelConfig, frozen: bool, params: Params, batch: dict
              ) -> tuple[jax.Array, tuple[dict, tuple]]:
    """(the objective summed over scored rows or tokens, with the blocks' auxiliary losses
    scaled by their count), ({loss_sum, count, statistics...}, the blocks' auxiliary
    outputs)."""
    tokens_BT = batch["tokens"]
    positions_BT, segment_ids_BT = padding_layout(config, tokens_BT)
    out = apply(config, params, tokens_BT, positions_BT=positions_BT,
                segment_ids_BT=segment_ids_BT)
    h_BTD = jax.lax.stop_gradient(out.hidden_BTD) if frozen else out.hidden_BTD
    outputs = apply_head(config, params, h_BTD, tokens_BT)
    sums = HEADS[config.head].sums(config, outputs, batch)
    total = sums["loss_sum"] + (0.0 if frozen else aux_loss(out.aux) * sums["count"])
    return total, (sums, out.aux)


def metrics(sums: dict[str, np.ndarray]) -> dict[str, float]:
    """Validation metrics from sums over batches: the mean loss, and accuracy and macro-F1
    (classification) or RMSE (regression)."""
    count = max(float(sums["count"]), 1e-12)
    out = {"loss": float(sums["loss_sum"]) / count}
    if "confusion_OO" in sums:
        out.update(accuracy=accuracy(sums["confusion_OO"]),
                   macro_f1=macro_f1(sums["confusion_OO"]))
    else:
        out["rmse"] = math.sqrt(float(np.sum(sums["squared_error_O"]))
                                / (count * len(sums["squared_error_O"])))
    return out


def accuracy(confusion_OO: np.ndarray) -> float:
    confusion_OO = np.asarray(confusion_OO, np.float64)
    return float(np.trace(confusion_OO) / max(confusion_OO.sum(), 1e-12))


def macro_f1(confusion_OO: np.ndarray) -> float:
    """The mean over classes of F1 = 2·TP / (2·TP + FP + FN), over the classes that occur as
    a label or a prediction (scikit-learn's `f1_score(average="macro")`)."""
    confusion_OO = np.asarray(confusion_OO, np.float64)
    tp_O = np.diag(confusion_OO)
    true_O, predicted_O = confusion_OO.sum(axis=1), confusion_OO.sum(axis=0)
    present_O = (true_O + predicted_O) > 0
    f1_O = 2 * tp_O / np.maximum(true_O + predicted_O, 1e-12)
    return float(f1_O[present_O].mean()) if present_O.any() else 0.0
