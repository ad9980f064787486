"""The optimizer: optax AdamW with a warmup schedule, global-norm clipping, no weight decay on
norm gains and biases, and skipping of non-finite updates.

Schedules (all warm up linearly from 0 over `warmup_steps`):
- cosine: cosine decay to `min_lr_ratio · learning_rate` at `steps` (LLaMA 1-3's schedule);
- wsd: warmup, stable at the peak, then linear decay to the minimum over the last
  `decay_fraction` of the steps (Hu et al. 2024, "MiniCPM"): a run can be extended from any
  checkpoint taken before the decay;
- constant: warmup, then the peak.

With `train.freeze: backbone` (fine-tuning, finetune.py) the chain applies to the task head
alone (`optax.multi_transform`); every other tensor gets a zero update and keeps no moments.

With `train.mu_dtype: bfloat16` AdamW's first moment is stored in bf16 between steps, half
its memory and traffic: each update computes it in the parameters' dtype from the stored
value, as AdamW without it would, and only the value kept for the next step is rounded
(relative error ≤ 2⁻⁸). optax's own `mu_dtype` is not used: it also runs the decay in bf16,
which rounds b1 = 0.9 to 0.8984.

`optax.apply_if_finite` wraps the chain: a step whose gradients hold a NaN or Inf leaves the
parameters and the optimizer state (moments, schedule count) untouched and counts it; the
training loop stops after `max_nonfinite` such steps in a row, before optax's own limit would
let a non-finite update through.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from llama_jax.config import ModelConfig, TrainConfig
from llama_jax.spec import is_spec, map_specs
from llama_jax.model.params import Params, param_specs

# apply_if_finite applies updates anyway after this many non-finite steps in a row; the loop
# stops long before (train.max_nonfinite), so this limit is never reached.
_NEVER = 2 ** 30


def learning_rate_schedule(train: TrainConfig) -> optax.Schedule:
    peak, floor = train.learning_rate, train.learning_rate * train.min_lr_ratio
    warmup = min(train.warmup_steps, train.steps)
    if train.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(train.steps, warmup + 1),
                                                  end_value=floor)
    if train.schedule == "constant":
        return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup),
                                     optax.constant_schedule(peak)], [warmup])
    decay = max(1, round(train.decay_fraction * train.steps))
    decay_start = max(warmup, train.steps - decay)
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup),
                                 optax.constant_schedule(peak),
                                 optax.linear_schedule(peak, floor, train.steps - decay_start)],
                                [warmup, decay_start])


def weight_decay_mask(config: ModelConfig, specs: Params | None = None) -> Params:
    """True for tensors that decay (their description says so): matrices and embedding tables,
    not norm gains and biases. `specs`: what trains, when not the model's parameters (a LoRA
    run's adapters)."""
    return map_specs(lambda spec: spec.decay, param_specs(config) if specs is None else specs)


def trainable(config: ModelConfig, freeze: str) -> Params:
    """"train" or "frozen" per tensor: with `freeze: backbone`, everything but the task head
    is frozen."""
    def label(path, spec) -> str:
        return "train" if freeze == "none" or path[0].key == "head" else "frozen"
    return jax.tree_util.tree_map_with_path(label, param_specs(config), is_leaf=is_spec)


def make_optimizer(config: ModelConfig, train: TrainConfig,
                   specs: Params | None = None) -> optax.GradientTransformation:
    """The run's optimizer for the model's parameters, or for `specs` (the TensorSpecs of
    what trains instead: a LoRA run's adapters)."""
    chain = [optax.clip_by_global_norm(train.clip_norm)] if train.clip_norm > 0 else []
    adamw = optax.adamw(learning_rate_schedule(train), b1=train.b1, b2=train.b2, eps=train.eps,
                        weight_decay=train.weight_decay, mask=weight_decay_mask(config, specs))
    if train.mu_dtype is not None:
        adamw = first_moment_stored_as(adamw, jnp.dtype(train.mu_dtype))
    chain.append(adamw)
    optimizer = optax.chain(*chain)
    if train.freeze != "none":  # frozen tensors get zero updates and no optimizer state
        optimizer = optax.multi_transform({"train": optimizer, "frozen": optax.set_to_zero()},
                                          trainable(config, train.freeze))
    return optax.apply_if_finite(optimizer, max_consecutive_errors=_NEVER)


def first_moment_stored_as(adam: optax.GradientTransformation,
                           dtype: jnp.dtype) -> optax.GradientTransformation:
    """`adam` with the first moment of its Adam state kept in `dtype` between updates, and
    updated in the dtype of the second moment (the parameters')."""
    def cast(state, dtype_of):
        def one(s):
            if not isinstance(s, optax.ScaleByAdamState):
                return s
            return s._replace(mu=jax.tree.map(lambda m, like: m.astype(dtype_of(like)), s.mu,
                                              s.nu))
        return jax.tree.map(one, state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))

    def init(params):
        return cast(adam.init(params), lambda _: dtype)

    def update(updates, state, params=None):
        updates, state = adam.update(updates, cast(state, lambda nu: nu.dtype), params)
        return updates, cast(state, lambda _: dtype)

    return optax.GradientTransformation(init, update)
