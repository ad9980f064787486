"""The LM head's next-token log-normaliser and target logit per position, for the loss.

Dense (`config.loss_chunk` null): the head's fp32 logits `[B, T, V]` of the whole batch, a
run of positions at a time, kept shifted by their maximum for the backward pass in the compute
dtype (`nn.heads.lm_head_log_z_and_target`): in bf16, 2·V bytes per token, which at V = 128K
and T = 8K is 2 GiB a row, as much as LLaMA-3 8B's 32 layers keep under full remat.

Chunked (`loss_chunk: C`): the positions of every row are taken C at a time by a `lax.scan`
whose body is rematerialised (`jax.checkpoint`), so only one piece's logits `[B, C, V]` ever
exist, in the forward pass and again in the backward one, which recomputes them from the
piece's hidden states. The cost is one more head matmul per token (2·D·V FLOPs, the forward
one repeated); the values are the dense ones up to summation order. Pieces run along T, not
over flattened tokens, so that rows keep their batch sharding.

Scored positions only (`scored_log_z_and_target`, chat fine-tuning): a conversation's loss
counts the assistant's tokens, often under half of a row, and none of a padded row's tail. So
each row's positions are first reordered, scored ones first (a stable sort of the weights,
then a gather of the hidden states: cheap next to the head), and the head runs over pieces of
C positions (`loss_chunk`, else SCORED_PIECE) under a `lax.cond` that skips a piece no row
scores in: its logits, softmax and their gradients are never computed. Pieces are
rematerialised as `loss_chunk`'s are: on the 2-core CPU, recomputing a piece's logits in the
backward pass is faster than writing and reading them back (4.9 against 5.2 s a step of the
LoRA benchmark, bench/finetune.py) and holds 0.6 GiB less. The sums are the dense ones up to
summation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from llama_jax.config import ModelConfig
from llama_jax.nn.heads import lm_head_log_z_and_target

# Positions per piece of the scored-only head when `loss_chunk` is not set: small enough that
# the skipped tail of a row is most of what is unscored, large enough for the head's matmul
SCORED_PIECE = 64


def log_z_and_target(config: ModelConfig, params: dict, h_BTD: jax.Array,
                     targets_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp32 `(log Z, logit of the target)`, each `[B, T]`: the cross-entropy of a position is
    their difference."""
    with jax.named_scope("loss"):  # profiles (bench/profile_step.py) group by it
        return _log_z_and_target(config, params, h_BTD, targets_BT)


def _log_z_and_target(config: ModelConfig, params: dict, h_BTD: jax.Array,
                      targets_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    T = h_BTD.shape[1]
    if config.loss_chunk is None or config.loss_chunk >= T:
        return lm_head_log_z_and_target(config, params, h_BTD, targets_BT)
    C = config.loss_chunk
    n = -(-T // C)
    pad = n * C - T  # the last piece is padded with zero states, and its padding dropped
    h_nBCD = _pieces(jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0))), n)
    targets_nBC = _pieces(jnp.pad(targets_BT, ((0, 0), (0, pad))), n)

    @jax.checkpoint
    def piece(_, xs):
        return None, lm_head_log_z_and_target(config, params, *xs)

    _, (log_z_nBC, target_nBC) = jax.lax.scan(piece, None, (h_nBCD, targets_nBC))
    return _joined(log_z_nBC, T), _joined(target_nBC, T)


def scored_log_z_and_target(config: ModelConfig, params: dict, h_BTD: jax.Array,
                            targets_BT: jax.Array, weights_BT: jax.Array
                            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`log_z_and_target` where only positions of weight > 0 matter (see the module doc):
    `(log Z, target logit, weight)`, each `[B, T]` with every row's positions reordered,
    scored first; unscored positions have weight 0 and may hold anything."""
    with jax.named_scope("loss"):
        order_BT = jnp.argsort(weights_BT <= 0, axis=1, stable=True)
        h_BTD = jnp.take_along_axis(h_BTD, order_BT[..., None], axis=1)
        targets_BT, weights_BT = (jnp.take_along_axis(x, order_BT, axis=1)
                                  for x in (targets_BT, weights_BT))
        T = h_BTD.shape[1]
        C = min(config.loss_chunk or SCORED_PIECE, T)
        n = -(-T // C)
        pad = n * C - T
        h_nBCD = _pieces(jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0))), n)
        targets_nBC, weights_nBC = (_pieces(jnp.pad(x, ((0, 0), (0, pad))), n)
                                    for x in (targets_BT, weights_BT))

        @jax.checkpoint  # a piece's logits are recomputed, not kept (see the module doc)
        def piece(_, xs):
            h_BCD, targets_BC, weights_BC = xs
            skipped = (jnp.zeros(targets_BC.shape, jnp.float32),) * 2
            return None, jax.lax.cond(jnp.any(weights_BC > 0), functools.partial(
                lm_head_log_z_and_target, config, params), lambda *_: skipped, h_BCD,
                targets_BC)

        _, (log_z_nBC, target_nBC) = jax.lax.scan(piece, None, (h_nBCD, targets_nBC,
                                                                weights_nBC))
        return _joined(log_z_nBC, T), _joined(target_nBC, T), weights_BT


def _pieces(x_BT: jax.Array, n: int) -> jax.Array:
    """`[B, n·C, ...]` -> `[n, B, C, ...]`: the scan runs over the leading axis."""
    B, T = x_BT.shape[:2]
    return jnp.moveaxis(x_BT.reshape(B, n, T // n, *x_BT.shape[2:]), 1, 0)


def _joined(x_nBC: jax.Array, T: int) -> jax.Array:
    """`[n, B, C]` -> `[B, T]`, without the padding."""
    n, B, C = x_nBC.shape
    return jnp.moveaxis(x_nBC, 0, 1).reshape(B, n * C)[:, :T]
