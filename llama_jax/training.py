"""The training and evaluation steps as pure functions of (state, batch).

Loss: next-token cross-entropy in fp32 averaged over the scored tokens of the whole batch (a
target that begins the next packed document is not scored), plus an optional z-loss
`z · mean(log Z)²` (PaLM) that keeps the softmax normaliser near 1.

Gradient accumulation: the batch is split into `micro_batches` parts run one after another by
`lax.scan`, each giving the gradient of its *summed* loss; the sums are divided by the token
count of the whole batch once at the end, so m micro-batches give the gradient of one big batch
(up to float summation order) and activation memory is that of one part.

Mixed precision: the parameters (and optimizer moments) stay in `param_dtype` (fp32 masters);
the model casts weights to `compute_dtype` inside its matmuls, so gradients arrive in fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import struct

from llama_jax.config import ModelConfig, TrainConfig
from llama_jax.data import features
from llama_jax.model import apply, aux_loss, aux_metrics, lm_head, update_outside_gradient
from llama_jax.params import Params, init_params


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 []: steps taken, skipped (non-finite) ones included
    params: Params
    opt_state: optax.OptState


def init_state(config: ModelConfig, optimizer: optax.GradientTransformation,
               key: jax.Array) -> TrainState:
    params = init_params(config, key)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params))


def loss_sums(config: ModelConfig, params: Params, window_BT1: jax.Array, bos_id: int,
              z_loss: float) -> tuple[jax.Array, tuple[jax.Array, jax.Array, tuple]]:
    """(cross-entropy + z-loss + the blocks' auxiliary losses, summed over scored tokens),
    with (cross-entropy sum, count, the blocks' auxiliary outputs). Auxiliary losses
    (per-token means) are scaled by the count so that dividing the sum by it gives
    `mean CE + aux`."""
    f = features(window_BT1, bos_id)
    out = apply(config, params, f.inputs_BT, positions_BT=f.positions_BT,
                segment_ids_BT=f.segment_ids_BT)
    logits_BTV = lm_head(config, params, out.hidden_BTD)
    log_z_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits_BTV, f.targets_BT[..., None], axis=-1)[..., 0]
    ce_sum = jnp.sum((log_z_BT - target_logit_BT) * f.weights_BT)
    count = jnp.sum(f.weights_BT)
    total = ce_sum + z_loss * jnp.sum(jnp.square(log_z_BT) * f.weights_BT)
    total += aux_loss(out.aux) * count
    return total, (ce_sum, count, out.aux)


def train_step(config: ModelConfig, train: TrainConfig, optimizer: optax.GradientTransformation,
               bos_id: int, state: TrainState, window_BT1: jax.Array) -> tuple[TrainState, dict]:
    """One optimizer step on a batch of packed windows `[B, T + 1]`; returns the new state and
    this step's metrics (loss = mean cross-entropy before the update)."""
    grad_of_sums = jax.grad(functools.partial(loss_sums, config), has_aux=True)
    if train.micro_batches == 1:
        grad_sums, (ce_sum, count, aux) = grad_of_sums(state.params, window_BT1, bos_id,
                                                       train.z_loss)
    else:
        B = window_BT1.shape[0]
        parts_MBT1 = window_BT1.reshape(train.micro_batches, B // train.micro_batches, -1)

        def accumulate(carry, part_BT1):
            part = grad_of_sums(state.params, part_BT1, bos_id, train.z_loss)
            return jax.tree.map(jnp.add, carry, part), None

        # The carry's structure (gradients, sums, auxiliary outputs) is the first part's.
        shapes = jax.eval_shape(grad_of_sums, state.params, parts_MBT1[0], bos_id, train.z_loss)
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), shapes)
        (grad_sums, (ce_sum, count, aux)), _ = jax.lax.scan(accumulate, zeros, parts_MBT1)
    count = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grad_sums, state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    metrics = {"loss": ce_sum / count, "grad_norm": optax.tree.norm(grads),
               "nonfinite_in_row": opt_state.notfinite_count,
               "nonfinite_total": opt_state.total_notfinite, **aux_metrics(aux)}
    params = optax.apply_updates(state.params, updates)
    # Rule-based updates (the MoE selection bias) are skipped with the step when it was not
    # finite, so such a step changes nothing.
    ruled = update_outside_gradient(config, params, aux)
    params = jax.tree.map(lambda new, old: new if new is old else jnp.where(
        opt_state.last_finite, new, old), ruled, params)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics


def eval_sums(config: ModelConfig, bos_id: int, params: Params,
              window_BT1: jax.Array) -> tuple[jax.Array, jax.Array, tuple]:
    """(cross-entropy sum, scored-token count, auxiliary outputs) of one validation batch:
    sums to add over batches (`aux_metrics` turns the last into scalars)."""
    _, sums = loss_sums(config, params, window_BT1, bos_id, 0.0)
    return sums
