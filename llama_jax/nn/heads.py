"""Heads: what the final hidden states feed, selected by `config.head`.

- lm: next-token logits `[B, T, V]`, through the untied `lm_head` or the embedding table (tied).
- sequence_classification: `[B, O]` class logits of one pooled hidden state per sequence, as
  transformers' `LlamaForSequenceClassification` (a Linear without bias, called `score`).
- regression: the same pooled head with O real-valued targets (transformers: the same model with
  `problem_type: regression`).
- token_classification: `[B, T, O]` logits per token, with a bias (`LlamaForTokenClassification`).

A task head replaces the LM head. Its batches are padded with `config.pad_id`: padding tokens
form a segment of their own and real tokens take positions 0, 1, ... from their first one
(`padding_layout`), so a row's outputs are those of the row alone whether it is padded on the
right or on the left. Pooling takes the last real token's state (`last`: the last position whose
token is not the pad id, transformers' rule) or the mean over the real tokens (`mean`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llama_jax.config import POOLED_HEADS, ModelConfig
from llama_jax.nn.ops import einsum_f32
from llama_jax.nn.spec import bias, weight
from llama_jax.sharding import constrain


def head_specs(config: ModelConfig) -> dict:
    """The head's top-level entries of the parameter tree: `lm_head` (untied LM head), or
    `head` (a task head's `w: [D, O]`, and `b: [O]` for token classification)."""
    dims = config.dims
    if config.head == "lm":
        return {} if config.tie_embeddings else {
            "lm_head": {"w": weight(dims, "DV", ("embed", "vocab"))}}
    head = {"w": weight(dims, "DO", ("embed", "labels"))}
    if config.head == "token_classification":
        head["b"] = bias(dims, "O", ("labels",))
    return {"head": head}


def head_matmul_size(config: ModelConfig) -> int:
    """Elements of the head's matrix each token multiplies (the LM head's V·D even when tied;
    a pooled head's D·O is used once per sequence and counted as per token, an upper bound)."""
    return config.dim * (config.vocab_size if config.head == "lm" else config.n_labels)


def apply_head(config: ModelConfig, params: dict, h_BTD: jax.Array,
               tokens_BT: jax.Array) -> jax.Array:
    """The head's fp32 outputs: `[B, T, V]` (lm), `[B, T, O]` (token classification) or
    `[B, O]` (pooled heads); `tokens_BT` locate the padding."""
    if config.head == "lm":
        return lm_head(config, params, h_BTD)
    p = params["head"]
    if config.head in POOLED_HEADS:
        pooled_BD = pool(config, h_BTD, real_tokens(config, tokens_BT))
        return einsum_f32("BD,DO->BO", pooled_BD, p["w"].astype(h_BTD.dtype))
    logits_BTO = einsum_f32("BTD,DO->BTO", h_BTD, p["w"].astype(h_BTD.dtype))
    return logits_BTO + p["b"].astype(jnp.float32)


def lm_head(config: ModelConfig, params: dict, h_BTD: jax.Array) -> jax.Array:
    """fp32 logits: the loss and sampling want them in full precision."""
    if config.tie_embeddings:
        table_VD = params["embed"]["table"].astype(h_BTD.dtype)
        logits_BTV = einsum_f32("BTD,VD->BTV", h_BTD, table_VD)
    else:
        logits_BTV = einsum_f32("BTD,DV->BTV", h_BTD, params["lm_head"]["w"].astype(h_BTD.dtype))
    return constrain(logits_BTV, ("batch", "seq", "vocab"))


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
