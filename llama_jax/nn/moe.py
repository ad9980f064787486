"""Mixture-of-Experts FFN pieces: routing, the two dispatch implementations, and the router
losses. (The `mlp: moe` component that puts them in a block comes with its config section.)

Letters besides the model's: X tokens (B·T flattened), E experts, R routed choices per token
(top_k), A = X·R assignments, C slots per expert (capacity).

Routing (`route`): router logits `[X, E]` in fp32 become scores — softmax over the experts
(Switch, GShard, Mixtral) or independent sigmoids (DeepSeek-V3). Each token picks its top_k
experts by score plus an optional selection-only bias (DeepSeek-V3's load-balancing bias: it
changes which experts are chosen, never the weights), optionally only within its top_k_groups
of n_groups expert groups (group-limited routing, DeepSeek-V2/V3; a group's score is its best
expert's for softmax, its two best experts' sum for sigmoid, as those papers do). The chosen
scores are the combine weights, renormalised to sum to 1 with `normalize_top_k` (Mixtral,
DeepSeek-V3), times `routed_scaling`.

Dispatch, one interface (`apply_experts`), two implementations of the same function (the
capacity factor, not the implementation, decides what is dropped):
- "capacity" (GShard, Switch): each expert has C = ceil(A/E · capacity_factor) slots, filled in
  priority order — every token's first choice before any second choice, tokens in order within
  a choice — by a cumulative sum; assignments beyond C are dropped (the token keeps only its
  other experts, or the residual alone). One-hot dispatch/combine tensors `[X, E, C]` feed
  batched expert matmuls `[E, C, D]`.
- "dropless" (MegaBlocks-style): assignments sorted by expert, the experts' matmuls as grouped
  matmuls over the sorted rows (`jax.lax.ragged_dot`), unsorted and weighted; with a capacity
  factor, the assignments the capacity path would drop get weight zero.

Losses: the load-balancing loss E · Σ_e f_e · P_e, with f_e the fraction of the A assignments
that go to expert e and P_e the mean score of expert e over tokens (Switch's, extended to top_k
by counting every assignment; 1 under uniform routing); the router z-loss
mean_x(logsumexp_e(logits)²) (ST-MoE).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from llama_jax.nn.mlp import ACTIVATIONS
from llama_jax.nn.ops import einsum_f32

ROUTERS = ("softmax", "sigmoid")
DISPATCHES = ("capacity", "dropless")


@struct.dataclass
class Routing:
    experts_XR: jax.Array  # int32: the chosen experts, best first
    weights_XR: jax.Array  # fp32 combine weights
    scores_XE: jax.Array  # fp32 router scores of every expert (for the losses and metrics)


def route(logits_XE: jax.Array, *, top_k: int, router: str = "softmax",
          normalize_top_k: bool = True, routed_scaling: float = 1.0, n_groups: int = 1,
          top_k_groups: int = 1, selection_bias_E: jax.Array | None = None) -> Routing:
    """Each token's top_k experts and their combine weights (see the module docstring)."""
    logits_XE = logits_XE.astype(jnp.float32)
    X, E = logits_XE.shape
    scores_XE = (jax.nn.softmax(logits_XE, axis=-1) if router == "softmax"
                 else jax.nn.sigmoid(logits_XE))
    choice_XE = scores_XE if selection_bias_E is None else scores_XE + selection_bias_E
    if n_groups > 1:
        grouped_XGe = choice_XE.reshape(X, n_groups, E // n_groups)
        group_XG = (grouped_XGe.max(-1) if router == "softmax"
                    else jax.lax.top_k(grouped_XGe, 2)[0].sum(-1))
        _, best_groups = jax.lax.top_k(group_XG, top_k_groups)
        keep_XG = jnp.zeros((X, n_groups), bool).at[jnp.arange(X)[:, None], best_groups].set(True)
        choice_XE = jnp.where(jnp.repeat(keep_XG, E // n_groups, axis=1), choice_XE, -jnp.inf)
    _, experts_XR = jax.lax.top_k(choice_XE, top_k)
    weights_XR = jnp.take_along_axis(scores_XE, experts_XR, axis=-1)
    if normalize_top_k:
        weights_XR = weights_XR / weights_XR.sum(-1, keepdims=True)
    return Routing(experts_XR.astype(jnp.int32), weights_XR * routed_scaling, scores_XE)


def load_balancing_loss(routing: Routing) -> jax.Array:
    """E · Σ_e f_e · P_e: 1 when routing is uniform, E when every token picks one expert."""
    E = routing.scores_XE.shape[-1]
    f_E = jnp.zeros(E).at[routing.experts_XR.reshape(-1)].add(1.0) / routing.experts_XR.size
    return E * jnp.sum(f_E * routing.scores_XE.mean(axis=0))


def router_z_loss(logits_XE: jax.Array) -> jax.Array:
    return jnp.mean(jax.nn.logsumexp(logits_XE.astype(jnp.float32), axis=-1) ** 2)


def capacity(n_assignments: int, n_experts: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(A/E · capacity_factor)."""
    return math.ceil(n_assignments / n_experts * capacity_factor)


def slot_positions(routing: Routing, n_experts: int) -> jax.Array:
    """`[X, R]`: each assignment's position among its expert's assignments, in priority order
    (every token's first choice, then every second choice, ...; tokens in order within one)."""
    onehot_AE = jax.nn.one_hot(routing.experts_XR.T.reshape(-1), n_experts, dtype=jnp.int32)
    position_A = ((jnp.cumsum(onehot_AE, axis=0) - 1) * onehot_AE).sum(-1)
    return position_A.reshape(routing.experts_XR.shape[::-1]).T


def capacity_slots(routing: Routing, n_experts: int, slots: int):
    """`(dispatch_XEC bool, combine_XEC fp32, dropped)`: where each kept assignment sits in its
    expert's buffer of `slots`; assignments past it are dropped."""
    position_XR = slot_positions(routing, n_experts)
    kept_XR = position_XR < slots
    slot_XREC = (jax.nn.one_hot(routing.experts_XR, n_experts, dtype=bool)[..., None]
                 & jax.nn.one_hot(position_XR, slots, dtype=bool)[:, :, None, :]
                 & kept_XR[:, :, None, None])
    combine_XEC = jnp.einsum("XREC,XR->XEC", slot_XREC.astype(jnp.float32), routing.weights_XR)
    return slot_XREC.any(axis=1), combine_XEC, routing.experts_XR.size - kept_XR.sum()


def apply_experts(p: dict, x_XD: jax.Array, routing: Routing, *, mlp: str, dispatch: str,
                  capacity_factor: float | None = None) -> tuple[jax.Array, jax.Array]:
    """Σ_r weight_r · Expert_{e_r}(x) per token, `[X, D]` in x's dtype, and the number of
    dropped assignments. `p`: the experts' stacked MLP weights `w_up, w_down[, w_gate]`
    (`[E, D, F]`, `[E, F, D]`) of MLP kind `mlp`.

    `capacity_factor` decides which assignments are dropped (None: none), `dispatch` only how
    the experts' matmuls are laid out: both drop the same assignments and compute the same
    function (with None, the capacity buffers hold every token: C = X)."""
    E = p["w_up"].shape[0]
    X, R = routing.experts_XR.shape
    slots = X if capacity_factor is None else capacity(X * R, E, capacity_factor)
    if dispatch == "capacity":
        dispatch_XEC, combine_XEC, dropped = capacity_slots(routing, E, slots)
        in_ECD = jnp.einsum("XEC,XD->ECD", dispatch_XEC.astype(x_XD.dtype), x_XD)
        out_ECD = _expert_mlp(p, in_ECD, mlp, lambda x, w: einsum_f32("ECI,EIO->ECO", x, w))
        y_XD = einsum_f32("XEC,ECD->XD", combine_XEC, out_ECD)
        return y_XD.astype(x_XD.dtype), dropped
    kept_XR = slot_positions(routing, E) < slots
    experts_A = routing.experts_XR.reshape(-1)
    order_A = jnp.argsort(experts_A, stable=True)
    rows_AD = x_XD[order_A // R]
    sizes_E = jnp.zeros(E, jnp.int32).at[experts_A].add(1)

    def grouped(x_AD, w_EDF):
        return jax.lax.ragged_dot(x_AD.astype(jnp.float32), w_EDF.astype(jnp.float32), sizes_E)
    out_AD = _expert_mlp(p, rows_AD, mlp, grouped)
    unsorted_XRD = jnp.zeros_like(out_AD).at[order_A].set(out_AD).reshape(X, R, -1)
    # Dropped assignments are computed (the grouped matmuls have no fixed buffers to overflow)
    # and weighted by zero, so the function is the capacity path's.
    y_XD = jnp.einsum("XRD,XR->XD", unsorted_XRD, jnp.where(kept_XR, routing.weights_XR, 0.0))
    return y_XD.astype(x_XD.dtype), X * R - kept_XR.sum()


def _expert_mlp(p: dict, x, mlp: str, matmul):
    """One MLP of kind `mlp` per expert, its matmuls by `matmul(x, w)` (batched or grouped;
    I and O: a matmul's input and output widths)."""
    up = matmul(x, p["w_up"])
    hidden = ACTIVATIONS[mlp](matmul(x, p["w_gate"])) * up if "w_gate" in p else (
        ACTIVATIONS[mlp](up))
    return matmul(hidden.astype(x.dtype), p["w_down"])
