"""Heads: what the final hidden states feed, registered in `HEADS` and chosen by `config.head`.

- lm: next-token logits `[B, T, V]`, through the untied `lm_head` or the embedding table (tied).
- sequence_classification: `[B, O]` class logits of one pooled hidden state per sequence, as
  transformers' `LlamaForSequenceClassification` (a Linear without bias, called `score`);
  cross-entropy, accuracy and macro-F1.
- regression: the same pooled head with O real-valued targets (transformers: the same model with
  `problem_type: regression`); squared error averaged over the O targets (MSE), RMSE.
- token_classification: `[B, T, O]` logits per token, with a bias (`LlamaForTokenClassification`);
  cross-entropy per scored token (a word's first), accuracy and macro-F1 over them.

A task head replaces the LM head. Its batches are padded with `config.pad_id`: padding tokens
form a segment of their own and real tokens take positions 0, 1, ... from their first one
(`padding_layout`), so a row's outputs are those of the row alone whether it is padded on the
right or on the left. Pooling takes the last real token's state (`last`: the last position whose
token is not the pad id, transformers' rule) or the mean over the real tokens (`mean`).

A task head's kind also carries its task (`Task`): its targets' field, shape and dtype, which
the task data (data/tasks.py) and the batch shapes (training/tasks.py) are derived from, its
objective's sums, its metrics and its prediction lines (eval/predict.py). A new task kind is one
`HEADS.register`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.nn.ops import cast_weight, einsum_f32, einsum_f32_grads, row_tiled
from llama_jax.nn.registry import Registry
from llama_jax.quant import is_int8
from llama_jax.parallel.sharding import constrain
from llama_jax.spec import bias, weight

if TYPE_CHECKING:
    from llama_jax.config import ModelConfig

# Positions per run of the LM head's forward pass in training (`lm_head_log_z_and_target`): a
# run's fp32 logits at V = 128K take 1 GiB a row, half the whole shifted logits kept in bf16 at 8K
LOSS_RUN = 2048


@dataclasses.dataclass(frozen=True)
class Task:
    """What a task head's data, training and evaluation need of its kind.

    - field: the JSONL field of the targets, their batch key and a prediction line's key;
    - target: a target's shape per example, in letters, which also says how data/tasks.py
      reads it: "" (one class: a label name or index), "O" (the head's n_labels numbers) or
      "T" (per token: a class per word, on the word's first token and -1 elsewhere);
    - dtype: the targets' dtype in batches;
    - sums(config, outputs, batch): the objective's additive sums over a batch: `loss_sum`,
      `count` and the statistics the metrics are computed from;
    - metrics(sums): the metrics besides the mean loss, from sums over any number of batches;
    - describe(config, example, output): a prediction's output line (eval/predict.py), from an
      example as data/tasks.py reads it and the head's outputs for it."""

    field: str
    target: str
    dtype: type
    sums: Callable[[ModelConfig, jax.Array, dict], dict]
    metrics: Callable[[dict], dict[str, float]]
    describe: Callable[[ModelConfig, dict, np.ndarray], dict]


@dataclasses.dataclass(frozen=True)
class Head:
    """A head kind: its entries of the parameter tree (`specs(config)`), its fp32 outputs
    (`apply(config, params, h_BTD, tokens_BT)`), the matrix elements each token multiplies
    (`matmul_size(config)`: FLOPs), whether it pools one row per sequence, and for a task head
    (n_labels, pooling, pad_id and label_names apply) its task and the output count it needs."""

    specs: Callable[[ModelConfig], dict]
    apply: Callable[[ModelConfig, dict, jax.Array, jax.Array], jax.Array]
    matmul_size: Callable[[ModelConfig], int]
    task: Task | None = None
    pooled: bool = False
    min_labels: int = 0


HEADS: Registry[Head] = Registry("head")


def head_specs(config: ModelConfig) -> dict:
    """The head's top-level entries of the parameter tree: `lm_head` (untied LM head), or
    `head` (a task head's `w: [D, O]`, and `b: [O]` for token classification)."""
    return HEADS[config.head].specs(config)


def head_matmul_size(config: ModelConfig) -> int:
    """Elements of the head's matrix each token multiplies (the LM head's V·D even when tied;
    a pooled head's D·O is used once per sequence and counted as per token, an upper bound)."""
    return HEADS[config.head].matmul_size(config)


def apply_head(config: ModelConfig, params: dict, h_BTD: jax.Array,
               tokens_BT: jax.Array) -> jax.Array:
    """The head's fp32 outputs: `[B, T, V]` (lm), `[B, T, O]` (token classification) or
    `[B, O]` (pooled heads); `tokens_BT` locate the padding."""
    return HEADS[config.head].apply(config, params, h_BTD, tokens_BT)


def is_task_head(config: ModelConfig) -> bool:
    return HEADS[config.head].task is not None


def task_metrics(kind: str, sums: dict) -> dict[str, float]:
    """A task's metrics from its sums over batches (`Task.sums`, added up): the mean loss and
    its kind's metrics."""
    return {"loss": float(sums["loss_sum"]) / _count(sums), **HEADS[kind].task.metrics(sums)}


def _count(sums: dict) -> float:
    return max(float(sums["count"]), 1e-12)  # no scored row: a loss of 0, not a division by 0


def lm_head(config: ModelConfig, params: dict, h_BTD: jax.Array) -> jax.Array:
    """fp32 logits: sampling and scoring want them in full precision. (Training's loss runs
    the same matmul under a backward rule of its own: `lm_head_log_z_and_target`.)"""
    equation, w = lm_head_matmul(config, params, h_BTD.dtype)
    logits_BTV = row_tiled(lambda h: einsum_f32(equation, h, w), h_BTD, 1)  # `ops.MIN_ROWS`
    return constrain(logits_BTV, ("batch", "seq", "vocab"))


def lm_head_matmul(config: ModelConfig, params: dict, dtype) -> tuple[str, jax.Array]:
    """The LM head's einsum and its weight in the compute `dtype`: the untied head, or the
    embedding table (tied)."""
    if config.tie_embeddings:
        return "BTD,VD->BTV", cast_weight(params["embed"]["table"], dtype)
    return "BTD,DV->BTV", cast_weight(params["lm_head"]["w"], dtype)


def lm_head_log_z_and_target(config: ModelConfig, params: dict, h_BTD: jax.Array,
                             targets_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp32 `(log Z, target logit)` `[B, T]` of the LM head's fp32 logits, for the loss.

    The forward pass computes the logits LOSS_RUN positions at a time (a loop over runs), so
    that one run's fp32 logits exist beside the whole shifted logits `s = logits − max`, which
    the backward pass keeps in the compute dtype: it takes the softmax as `exp(s − log Σ e^s)`.
    Every s lies in [log p, 0] (s = log p + log Σ e^s, a sum of at least e^0), so bf16 puts it
    off by at most 2^-9·|log p| and p by 2^-9 of p·|log p| <= 2^-9/e an entry, what rounding
    the logits' gradient to bf16 (for the head's two bf16 backward matmuls) costs anyway. Not
    the logits themselves in bf16: their rounding grows with their size, and a softmax near 1
    would lose its gradient. Shifting, not normalising, lets one pass over a run's logits
    both sum e^s and write s. LLaMA-3 8B at 8K tokens a chip on XLA:TPU's clock: 6.9 GiB
    peak, where keeping the fp32 logits took 9.3. A frozen int8 head has no weight gradient:
    its logits are differentiated as they are."""
    equation, w = lm_head_matmul(config, params, h_BTD.dtype)
    if is_int8(w):
        logits_BTV = lm_head(config, params, h_BTD)
        target_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits_BTV, axis=-1), target_BT
    runs = max(1, h_BTD.shape[1] // LOSS_RUN)
    return _log_z_and_target(equation, runs, h_BTD, w, targets_BT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _log_z_and_target(equation: str, runs: int, h_BTD: jax.Array, w: jax.Array,
                      targets_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _loss_forward(equation, runs, h_BTD, w, targets_BT)[0]


def _loss_forward(equation, runs, h_BTD, w, targets_BT):
    """One run of C positions after another, each writing its part of the whole-length
    results in place (a last run that would overhang the end starts earlier, recomputing a
    few positions: the same values). The runs cover every position, so the results start
    uninitialised (`lax.empty`): XLA:TPU prices zero-filling the bf16 `[T, V]` at 7.5 ms at 8K
    tokens (a broadcast, at 0.28 TB/s), more than the passes that write it."""
    B, T, _ = h_BTD.shape
    C = -(-T // runs)
    w_letters = equation.split("->")[0].split(",")[1]  # "DV", or "VD" (tied)
    # gathered whole (over FSDP) once, not once per run
    w = constrain(w, tuple("vocab" if c == "V" else None for c in w_letters))

    def run(i, outs):
        start = jnp.minimum(i * C, T - C)
        h_BCD = jax.lax.dynamic_slice_in_dim(h_BTD, start, C, axis=1)
        targets_BC = jax.lax.dynamic_slice_in_dim(targets_BT, start, C, axis=1)
        logits_BCV = constrain(einsum_f32(equation, h_BCD, w), ("batch", "seq", "vocab"))
        max_BC = jnp.max(logits_BCV, axis=-1)
        shifted_BCV = logits_BCV - max_BC[..., None]
        log_sum_BC = jnp.log(jnp.sum(jnp.exp(shifted_BCV), axis=-1))
        target_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
        parts = (log_sum_BC, max_BC + log_sum_BC, target_BC, shifted_BCV.astype(h_BTD.dtype))
        return tuple(jax.lax.dynamic_update_slice_in_dim(whole, part, start, axis=1)
                     for whole, part in zip(outs, parts))

    V = w.shape[w_letters.index("V")]
    outs = (*(jax.lax.empty((B, T), jnp.float32) for _ in range(3)),
            constrain(jax.lax.empty((B, T, V), h_BTD.dtype), ("batch", "seq", "vocab")))
    log_sum_BT, log_z_BT, target_BT, shifted_BTV = jax.lax.fori_loop(0, runs, run, outs)
    return (log_z_BT, target_BT), (h_BTD, w, shifted_BTV, log_sum_BT, targets_BT)


def _loss_backward(equation, runs, residuals, cotangents):
    h_BTD, w, shifted_BTV, log_sum_BT, targets_BT = residuals
    d_log_z_BT, d_target_BT = cotangents
    vocab_V = jnp.arange(shifted_BTV.shape[-1])
    d_sum_BT = jnp.exp(-log_sum_BT) * d_log_z_BT
    d_logits_BTV = (jnp.exp(shifted_BTV.astype(jnp.float32)) * d_sum_BT[..., None]
                    + jnp.where(vocab_V == targets_BT[..., None], d_target_BT[..., None], 0))
    d_logits_BTV = constrain(d_logits_BTV.astype(h_BTD.dtype), ("batch", "seq", "vocab"))
    d_h_BTD, d_w = einsum_f32_grads(equation, h_BTD, w, d_logits_BTV)
    return d_h_BTD, d_w, None


_log_z_and_target.defvjp(_loss_forward, _loss_backward)


def real_tokens(config: ModelConfig, tokens_BT: jax.Array) -> jax.Array:
    """bool `[B, T]`: the tokens that are not padding (all of them without a pad id)."""
    if config.pad_id is None:
        return jnp.ones(tokens_BT.shape, bool)
    return tokens_BT != config.pad_id


def padding_layout(config: ModelConfig, tokens_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(positions_BT, segment_ids_BT) that keep each row's real tokens to themselves: padding
    is segment 0 and real tokens segment 1, and real tokens count positions from 0, so left
    padding shifts nothing and right padding is never attended (causal)."""
    real_BT = real_tokens(config, tokens_BT)
    positions_BT = jnp.maximum(jnp.cumsum(real_BT, axis=1, dtype=jnp.int32) - 1, 0)
    return positions_BT, real_BT.astype(jnp.int32)


def pool(config: ModelConfig, h_BTD: jax.Array, real_BT: jax.Array) -> jax.Array:
    """`[B, D]`: the state at the last real token (a row of padding only: position 0), or the
    mean over the real tokens."""
    if config.pooling == "mean":
        weights_BT = real_BT.astype(jnp.float32)
        total_BD = einsum_f32("BTD,BT->BD", h_BTD, weights_BT)
        mean_BD = total_BD / jnp.maximum(jnp.sum(weights_BT, axis=1), 1.0)[:, None]
        return mean_BD.astype(h_BTD.dtype)
    T = h_BTD.shape[1]
    last_B = jnp.argmax(jnp.where(real_BT, jnp.arange(T), -1), axis=1)
    return jnp.take_along_axis(h_BTD, last_B[:, None, None], axis=1)[:, 0]


# ------------------------------------------------------------------------------ the kinds

def _lm_specs(config: ModelConfig) -> dict:
    return {} if config.tie_embeddings else {
        "lm_head": {"w": weight(config.dims, "DV", ("embed", "vocab"), contract="D")}}


def _task_specs(config: ModelConfig, with_bias: bool) -> dict:
    head = {"w": weight(config.dims, "DO", ("embed", "labels"))}
    if with_bias:
        head["b"] = bias(config.dims, "O", ("labels",))
    return {"head": head}


def _pooled(config: ModelConfig, params: dict, h_BTD: jax.Array,
            tokens_BT: jax.Array) -> jax.Array:
    pooled_BD = pool(config, h_BTD, real_tokens(config, tokens_BT))
    return einsum_f32("BD,DO->BO", pooled_BD, params["head"]["w"].astype(h_BTD.dtype))


def _per_token(config: ModelConfig, params: dict, h_BTD: jax.Array,
               tokens_BT: jax.Array) -> jax.Array:
    p = params["head"]
    logits_BTO = einsum_f32("BTD,DO->BTO", h_BTD, p["w"].astype(h_BTD.dtype))
    return logits_BTO + p["b"].astype(jnp.float32)


def classification_sums(logits_XO: jax.Array, label_X: jax.Array, weight_X: jax.Array
                        ) -> dict[str, jax.Array]:
    """Over rows X: weighted cross-entropy sum, weight sum, and the weighted confusion matrix
    `[true O, predicted O]`."""
    O = logits_XO.shape[-1]
    label_X = jnp.maximum(label_X, 0)  # unscored labels (-1) have weight 0
    log_z_X = jax.nn.logsumexp(logits_XO, axis=-1)
    label_logit_X = jnp.take_along_axis(logits_XO, label_X[:, None], axis=-1)[:, 0]
    true_XO = jax.nn.one_hot(label_X, O) * weight_X[:, None]
    predicted_XO = jax.nn.one_hot(jnp.argmax(logits_XO, axis=-1), O)
    return {"loss_sum": jnp.sum((log_z_X - label_logit_X) * weight_X),
            "count": jnp.sum(weight_X),
            "confusion_OO": jnp.einsum("XO,XP->OP", true_XO, predicted_XO,  # P: predicted
                                       precision=jax.lax.Precision.HIGHEST)}


def regression_sums(predicted_BO: jax.Array, target_BO: jax.Array, weight_B: jax.Array
                    ) -> dict[str, jax.Array]:
    """Weighted sums of the per-row MSE and of the squared error per target."""
    squared_BO = jnp.square(predicted_BO - target_BO) * weight_B[:, None]
    return {"loss_sum": jnp.sum(jnp.mean(squared_BO, axis=-1)), "count": jnp.sum(weight_B),
            "squared_error_O": jnp.sum(squared_BO, axis=0)}


def _token_classification_sums(config: ModelConfig, logits_BTO: jax.Array,
                               batch: dict) -> dict:
    """Cross-entropy over the tokens that carry a label (-1: none, e.g. a word's later
    tokens)."""
    weight_BT = batch["weight"][:, None] * (batch["labels"] >= 0)
    return classification_sums(logits_BTO.reshape(-1, config.n_labels),
                               batch["labels"].reshape(-1), weight_BT.reshape(-1))


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


def _classification_metrics(sums: dict) -> dict[str, float]:
    return {"accuracy": accuracy(sums["confusion_OO"]), "macro_f1": macro_f1(sums["confusion_OO"])}


def _regression_metrics(sums: dict) -> dict[str, float]:
    """RMSE over every target of every row."""
    squared_error_O = sums["squared_error_O"]
    return {"rmse": math.sqrt(float(np.sum(squared_error_O))
                              / (_count(sums) * len(squared_error_O)))}


def _rounded(probabilities_O: np.ndarray) -> list[float]:
    return [round(float(p), 6) for p in probabilities_O]


def _describe_class(config: ModelConfig, example: dict, logits_O: np.ndarray) -> dict:
    """`{"label": NAME, "probabilities": {NAME: p, ...}}`."""
    names = config.names_of_labels
    probabilities_O = np.asarray(jax.nn.softmax(logits_O, axis=-1))
    return {"label": names[int(np.argmax(logits_O))],
            "probabilities": dict(zip(names, _rounded(probabilities_O)))}


def _describe_words(config: ModelConfig, example: dict, logits_TO: np.ndarray) -> dict:
    """`{"labels": [NAME per word], "probabilities": [[p per label] per word]}`: a word's
    prediction is its first token's."""
    names = config.names_of_labels
    probabilities_TO = np.asarray(jax.nn.softmax(logits_TO, axis=-1))
    first = [i for i in example["first_token"] if i < len(logits_TO)]  # words past truncation
    return {"labels": [names[int(np.argmax(logits_TO[i]))] for i in first],
            "probabilities": [_rounded(probabilities_TO[i]) for i in first]}


def _describe_values(config: ModelConfig, example: dict, values_O: np.ndarray) -> dict:
    """`{"target": [value per output]}`."""
    return {"target": [float(v) for v in values_O]}


def _labels_matmul(config: ModelConfig) -> int:
    return config.dim * config.n_labels


def _pooled_head(min_labels: int, task: Task) -> Head:
    """A task head on one pooled state per sequence, without a bias (transformers' `score`)."""
    return Head(lambda config: _task_specs(config, with_bias=False), _pooled, _labels_matmul,
                pooled=True, min_labels=min_labels, task=task)


HEADS.register("lm", Head(_lm_specs, lambda config, params, h_BTD, tokens_BT: lm_head(
    config, params, h_BTD), lambda config: config.dim * config.vocab_size))
HEADS.register("sequence_classification", _pooled_head(min_labels=2, task=Task(
    "label", "", np.int32, lambda config, logits_BO, batch: classification_sums(
        logits_BO, batch["label"], batch["weight"]), _classification_metrics, _describe_class)))
HEADS.register("token_classification", Head(
    lambda config: _task_specs(config, with_bias=True), _per_token, _labels_matmul,
    min_labels=2, task=Task("labels", "T", np.int32, _token_classification_sums,
                            _classification_metrics, _describe_words)))
HEADS.register("regression", _pooled_head(min_labels=1, task=Task(
    "target", "O", np.float32, lambda config, predicted_BO, batch: regression_sums(
        predicted_BO, batch["target"], batch["weight"]), _regression_metrics, _describe_values)))
