"""The training and evaluation steps as pure functions of (state, batch).

Loss (`objective`): for language modelling, next-token cross-entropy in fp32 averaged over the
scored tokens of the whole batch (a target that begins the next packed document is not scored;
in a chat task's rows, only the assistant's tokens are; the logits computed whole or a piece at
a time, cross_entropy.py),
plus an optional z-loss `z · mean(log Z)²` (PaLM) that keeps the softmax normaliser near 1; for
a downstream task, its loss (tasks.py). Either is a sum with its count, so the step divides
once by the whole batch's count.

Gradient accumulation: the batch is split into `micro_batches` parts run one after another by
`lax.scan`, each giving the gradient of its *summed* loss; the sums are divided by the token
count of the whole batch once at the end, so m micro-batches give the gradient of one big batch
(up to float summation order) and activation memory is that of one part.

LoRA (a `lora:` section): the state's parameters are the adapters alone (nn/lora.py) and the
frozen base model is a further argument of the step, neither donated nor updated: the loss is
differentiated by the adapters only, so no gradient, optimizer state or update exists for the
base.

Mixed precision: the parameters (and optimizer moments, unless `train.mu_dtype` stores the
first in bf16) stay in `param_dtype` (fp32 masters);
the model casts weights to `compute_dtype` inside its matmuls, so gradients arrive in fp32.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from llama_jax.training import tasks
from llama_jax.training.cross_entropy import log_z_and_target, scored_log_z_and_target
from llama_jax.config import LoraConfig, ModelConfig, RunConfig, TrainConfig
from llama_jax.config.run import CHAT
from llama_jax.data.batches import Features, features
from llama_jax.model.transformer import apply, aux_loss, aux_metrics, update_outside_gradient
from llama_jax.model.params import Params, init_params
from llama_jax.nn.lora import with_adapters


# (params, batch) -> (the objective's sum, ({loss_sum, count, statistics...}, aux outputs))
LossFn = Callable[[Params, Any], tuple[jax.Array, tuple[dict, tuple]]]


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
              z_loss: float) -> tuple[jax.Array, tuple[dict, tuple]]:
    """Language modelling on packed windows `[B, T + 1]`: `lm_sums` of their features."""
    return lm_sums(config, params, features(window_BT1, bos_id), z_loss)


def lm_sums(config: ModelConfig, params: Params, f: Features | dict, z_loss: float,
            frozen: bool = False, scored_only: bool = False
            ) -> tuple[jax.Array, tuple[dict, tuple]]:
    """Language modelling on inputs and weighted targets (`Features`, or a dict of its fields:
    a chat batch, data/chat_rows.py): (cross-entropy + z-loss + the blocks' auxiliary
    losses, summed over scored tokens), ({loss_sum: the cross-entropy sum, count}, the
    blocks' auxiliary outputs). Auxiliary losses (per-token means) are scaled by the count so
    that dividing the sum by it gives `mean CE + aux`. `frozen`: the gradient stops at the
    final hidden states (`train.freeze: backbone` trains the head alone). `scored_only`: the
    LM head runs over the scored positions alone (`cross_entropy.scored_log_z_and_target`;
    for rows whose weights are sparse, as a conversation's are)."""
    f = f if isinstance(f, Features) else Features(**f)
    out = apply(config, params, f.inputs_BT, positions_BT=f.positions_BT,
                segment_ids_BT=f.segment_ids_BT)
    hidden_BTD = jax.lax.stop_gradient(out.hidden_BTD) if frozen else out.hidden_BTD
    if scored_only:
        log_z_BT, target_logit_BT, weights_BT = scored_log_z_and_target(
            config, params, hidden_BTD, f.targets_BT, f.weights_BT)
    else:
        log_z_BT, target_logit_BT = log_z_and_target(config, params, hidden_BTD, f.targets_BT)
        weights_BT = f.weights_BT
    ce_sum = jnp.sum((log_z_BT - target_logit_BT) * weights_BT)
    count = jnp.sum(weights_BT)
    total = ce_sum + z_loss * jnp.sum(jnp.square(log_z_BT) * weights_BT)
    total += aux_loss(out.aux) * count
    return total, ({"loss_sum": ce_sum, "count": count}, out.aux)


def objective(run: RunConfig, bos_id: int) -> LossFn:
    """The run's loss: language modelling on packed windows, or on a chat task's rows, or its
    task head's (tasks.py)."""
    frozen = run.train.freeze == "backbone"
    if run.task is None:
        return functools.partial(loss_sums, run.model, bos_id=bos_id, z_loss=run.train.z_loss)
    if run.task.kind == CHAT:
        return functools.partial(lm_sums, run.model, z_loss=run.train.z_loss, frozen=frozen,
                                 scored_only=True)
    return functools.partial(tasks.loss_sums, run.model, frozen)


def adapted(loss_fn: LossFn, base: Params | None, lora: LoraConfig | None,
            key: jax.Array | None = None) -> LossFn:
    """The loss as a function of what trains: the parameters (`base` None), or a LoRA run's
    adapters on the frozen `base` (dropping the adapters' inputs with `key`'s masks)."""
    if base is None:
        return loss_fn
    return lambda adapters, batch: loss_fn(
        with_adapters(base, adapters, lora.scale, lora.dropout, key), batch)


def train_step(config: ModelConfig, train: TrainConfig, optimizer: optax.GradientTransformation,
               loss_fn: LossFn, state: TrainState, batch, base: Params | None = None, *,
               lora: LoraConfig | None = None) -> tuple[TrainState, dict]:
    """One optimizer step on a batch (packed windows `[B, T + 1]`, or a task's dict of
    arrays, every leaf `[B, ...]`); returns the new state and this step's metrics (loss = the
    mean loss before the update). A LoRA run's state holds its adapters, `base` the model."""
    step_key = jax.random.fold_in(jax.random.key(train.seed), state.step)  # LoRA's dropout

    def grad_of_sums(params, part, index):
        loss = adapted(loss_fn, base, lora, jax.random.fold_in(step_key, index))
        return jax.grad(loss, has_aux=True)(params, part)

    if train.micro_batches == 1:
        grad_sums, (sums, aux) = grad_of_sums(state.params, batch, 0)
    else:
        parts = jax.tree.map(lambda x: x.reshape(train.micro_batches, -1, *x.shape[1:]), batch)

        def accumulate(carry, part_and_index):
            return jax.tree.map(jnp.add, carry, grad_of_sums(state.params,
                                                             *part_and_index)), None

        # The carry's structure (gradients, sums, auxiliary outputs) is the first part's.
        shapes = jax.eval_shape(grad_of_sums, state.params,
                                jax.tree.map(lambda x: x[0], parts), 0)
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), shapes)
        (grad_sums, (sums, aux)), _ = jax.lax.scan(
            accumulate, zeros, (parts, jnp.arange(train.micro_batches)))
    count = jnp.maximum(sums["count"], 1.0)
    grads = jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grad_sums, state.params)
    with jax.named_scope("optimizer"):  # profiles (bench/profile_step.py) group by it
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
    metrics = {"loss": sums["loss_sum"] / count, "grad_norm": optax.tree.norm(grads),
               "nonfinite_in_row": opt_state.notfinite_count,
               "nonfinite_total": opt_state.total_notfinite, **aux_metrics(aux)}
    if train.freeze == "backbone" or base is not None:
        # nothing of a frozen backbone (or base) changes, by rule either
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics
    # Rule-based updates (the MoE selection bias) are skipped with the step when it was not
    # finite, so such a step changes nothing.
    ruled = update_outside_gradient(config, params, aux)
    params = jax.tree.map(lambda new, old: new if new is old else jnp.where(
        opt_state.last_finite, new, old), ruled, params)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics


def eval_sums(loss_fn: LossFn, params: Params, batch, base: Params | None = None, *,
              lora: LoraConfig | None = None) -> tuple[dict, tuple]:
    """(the loss's sums — loss_sum, count and a task's statistics —, auxiliary outputs) of one
    validation batch: sums to add over batches (`aux_metrics` turns the last into scalars). A
    LoRA run's `params` are its adapters on `base`."""
    _, sums = adapted(loss_fn, base, lora)(params, batch)
    return sums
