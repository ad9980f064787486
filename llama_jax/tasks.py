"""Downstream tasks' losses and metrics, as pure functions of (params, batch).

- sequence_classification: cross-entropy of the pooled head's logits `[B, C]`;
- token_classification: cross-entropy per scored token (label >= 0) of `[B, T, C]`;
- regression: squared error of `[B, C]`, averaged over the C targets (MSE).
Losses are sums over the scored rows (or tokens) with their count, like the language-modelling
loss (training.py), so micro-batches and validation batches add up. Validation adds the
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
from llama_jax.model import apply, aux_loss
from llama_jax.nn.heads import apply_head, padding_layout
from llama_jax.params import Params


def abstract_batch(run: RunConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of a task's batch (task_data.py)."""
    B, T, C = run.train.batch_size, run.train.seq_len, run.model.n_labels
    targets = {"sequence_classification": ("label", (B,), jnp.int32),
               "token_classification": ("labels", (B, T), jnp.int32),
               "regression": ("target", (B, C), jnp.float32)}
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
    if config.head == "regression":
        sums = _regression_sums(outputs, batch["target"], batch["weight"])
    elif config.head == "sequence_classification":
        sums = _classification_sums(outputs, batch["label"], batch["weight"])
    else:
        weight_BT = batch["weight"][:, None] * (batch["labels"] >= 0)
        sums = _classification_sums(outputs.reshape(-1, config.n_labels),
                                    batch["labels"].reshape(-1), weight_BT.reshape(-1))
    total = sums["loss_sum"] + (0.0 if frozen else aux_loss(out.aux) * sums["count"])
    return total, (sums, out.aux)


def _classification_sums(logits_XC: jax.Array, label_X: jax.Array, weight_X: jax.Array
                         ) -> dict[str, jax.Array]:
    """Over rows X: weighted cross-entropy sum, weight sum, and the weighted confusion matrix
    `[true C, predicted C]`."""
    C = logits_XC.shape[-1]
    label_X = jnp.maximum(label_X, 0)  # unscored labels (-1) have weight 0
    log_z_X = jax.nn.logsumexp(logits_XC, axis=-1)
    label_logit_X = jnp.take_along_axis(logits_XC, label_X[:, None], axis=-1)[:, 0]
    true_XC = jax.nn.one_hot(label_X, C) * weight_X[:, None]
    predicted_XC = jax.nn.one_hot(jnp.argmax(logits_XC, axis=-1), C)
    return {"loss_sum": jnp.sum((log_z_X - label_logit_X) * weight_X),
            "count": jnp.sum(weight_X),
            "confusion_CC": jnp.einsum("XC,XP->CP", true_XC, predicted_XC,  # P: predicted
                                       precision=jax.lax.Precision.HIGHEST)}


def _regression_sums(predicted_BC: jax.Array, target_BC: jax.Array, weight_B: jax.Array
                     ) -> dict[str, jax.Array]:
    """Weighted sums of the per-row MSE and of the squared error per target."""
    squared_BC = jnp.square(predicted_BC - target_BC) * weight_B[:, None]
    return {"loss_sum": jnp.sum(jnp.mean(squared_BC, axis=-1)), "count": jnp.sum(weight_B),
            "squared_error_C": jnp.sum(squared_BC, axis=0)}


def metrics(sums: dict[str, np.ndarray]) -> dict[str, float]:
    """Validation metrics from sums over batches: the mean loss, and accuracy and macro-F1
    (classification) or RMSE (regression)."""
    count = max(float(sums["count"]), 1e-12)
    out = {"loss": float(sums["loss_sum"]) / count}
    if "confusion_CC" in sums:
        out.update(accuracy=accuracy(sums["confusion_CC"]),
                   macro_f1=macro_f1(sums["confusion_CC"]))
    else:
        out["rmse"] = math.sqrt(float(np.sum(sums["squared_error_C"]))
                                / (count * len(sums["squared_error_C"])))
    return out


def accuracy(confusion_CC: np.ndarray) -> float:
    confusion_CC = np.asarray(confusion_CC, np.float64)
    return float(np.trace(confusion_CC) / max(confusion_CC.sum(), 1e-12))


def macro_f1(confusion_CC: np.ndarray) -> float:
    """The mean over classes of F1 = 2·TP / (2·TP + FP + FN), over the classes that occur as
    a label or a prediction (scikit-learn's `f1_score(average="macro")`)."""
    confusion_CC = np.asarray(confusion_CC, np.float64)
    tp_C = np.diag(confusion_CC)
    true_C, predicted_C = confusion_CC.sum(axis=1), confusion_CC.sum(axis=0)
    present_C = (true_C + predicted_C) > 0
    f1_C = 2 * tp_C / np.maximum(true_C + predicted_C, 1e-12)
    return float(f1_C[present_C].mean()) if present_C.any() else 0.0
