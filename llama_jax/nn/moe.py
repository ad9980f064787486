"""The Mixture-of-Experts MLP (`mlp: moe`, the `moe:` config section): a router, E routed
expert MLPs of which each token uses top_k, optional always-on shared experts, the router
losses and the load statistics.

Letters besides the model's: X tokens (B·T flattened), E experts, R routed choices per token
(top_k), A = X·R (or T·R) assignments, C slots per expert and sequence (capacity), M an
expert's hidden width, U the shared experts' (n_shared_experts · M, one MLP as DeepSeek does).

Routing (`route`): router logits `[X, E]` in fp32 become scores by the router kind (`ROUTERS`,
`moe.router`) — softmax over the experts (Switch, GShard, Mixtral) or independent sigmoids
(DeepSeek-V3). Each token picks its top_k
experts by score plus an optional selection-only bias (DeepSeek-V3's load-balancing bias: it
changes which experts are chosen, never the weights), optionally only within its top_k_groups
of n_groups expert groups (group-limited routing, DeepSeek-V2/V3; a group's score is its best
expert's for softmax, its two best experts' sum for sigmoid, as those papers do). The chosen
scores are the combine weights, renormalised to sum to 1 with `normalize_top_k` (Mixtral,
DeepSeek-V3), times `routed_scaling`.

Dispatch, one interface (`apply_experts`), two implementations of the same function (the
capacity factor, not the implementation, decides what is dropped). Each sequence is a dispatch
group (GShard's groups): its T·R assignments compete for C = ceil(T·R/E · capacity_factor)
slots per expert, filled in priority order — every token's first choice before any second
choice, tokens in order within a choice — by a cumulative sum; assignments beyond C are
dropped (the token keeps only its other experts, or the residual alone). Rows never compete,
so a row computes the same alone as in any batch, and a data-parallel batch's buffers stay on
the devices of its rows.
- "capacity" (GShard, Switch): tokens are scattered into `[B, E, C, D]` buffers by slot index
  (GShard's one-hot dispatch/combine einsums would cost T·E·C·D per row, more than the
  experts themselves at these sizes), the experts run as batched matmuls, and the outputs are
  gathered back by the same indices. Under expert parallelism the buffers move from the batch
  axis to the expert axis (an all-to-all XLA inserts) and back.
- "dropless" (MegaBlocks-style): assignments sorted by expert, the experts' matmuls as grouped
  matmuls over the sorted rows (`jax.lax.ragged_dot`), unsorted and weighted; the assignments
  a capacity factor drops get weight zero. XLA cannot partition the sort, so on a mesh each
  device runs its own rows (`sharding.per_shard`) with every expert's weights gathered: no
  expert parallelism for this path yet (that needs a ragged all-to-all).

Capacity applies where tokens are processed as a batch (training, evaluation, `forward`); the
KV-cached decoder never drops, so a token's output does not depend on which other rows happen
to be decoded beside it (with capacity_factor null, cached decode == full forward exactly).
The router runs in fp32 (its logits decide discrete choices).

Losses: the load-balancing loss E · Σ_e f_e · P_e, with f_e the fraction of the A assignments
that go to expert e and P_e the mean score of expert e over tokens (Switch's, extended to top_k
by counting every assignment; 1 under uniform routing); the router z-loss
mean_x(logsumexp_e(logits)²) (ST-MoE), each per MoE layer, times its weight, summed over
layers. Other codebases: HF's Mixtral loss (`load_balancing_loss_func`) is
E · Σ_e (fraction of tokens with e among their top_k) · P_e — top_k times ours, k under uniform
routing — over all layers' router logits at once (an average over layers, where we sum), so
its `router_aux_loss_coef` c is about our aux_loss_weight = k·c / L. MaxText's
(`load_balance_loss`) is also k times ours (f normalised by tokens, not assignments; per
sequence, then averaged), added per layer: its weight w is our k·w.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
from flax import struct

from llama_jax.nn.mlp import apply_mlp, ffn, ffn_specs
from llama_jax.nn.ops import einsum_f32, grouped_f32, matmul_precision
from llama_jax.nn.registry import Registry
from llama_jax.parallel.sharding import constrain, per_shard
from llama_jax.spec import bias, map_specs, weight

if TYPE_CHECKING:
    from llama_jax.config import ModelConfig

DISPATCHES = ("capacity", "dropless")


@dataclasses.dataclass(frozen=True)
class Router:
    """A router kind: the scores of router logits `[X, E]` (fp32), a group's score for
    group-limited routing from its experts' choice scores `[X, G, E/G]` (which needs
    `min_group_size` experts per group), and whether it keeps a selection-only bias `[E]`
    (DeepSeek-V3's, updated outside the gradient: `update_selection_bias`)."""

    scores: Callable[[jax.Array], jax.Array]
    group_score: Callable[[jax.Array], jax.Array]
    min_group_size: int = 1
    selection_bias: bool = False


ROUTERS: Registry[Router] = Registry("moe.router")
ROUTERS.register("softmax", Router(lambda logits_XE: jax.nn.softmax(logits_XE, axis=-1),
                                   lambda grouped_XGe: grouped_XGe.max(-1)))
ROUTERS.register("sigmoid", Router(jax.nn.sigmoid,
                                   lambda grouped_XGe: jax.lax.top_k(grouped_XGe, 2)[0].sum(-1),
                                   min_group_size=2, selection_bias=True))


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
    kind = ROUTERS[router]
    scores_XE = kind.scores(logits_XE)
    choice_XE = scores_XE if selection_bias_E is None else scores_XE + selection_bias_E
    if n_groups > 1:
        grouped_XGe = choice_XE.reshape(X, n_groups, E // n_groups)
        group_XG = kind.group_score(grouped_XGe)
        _, best_groups = jax.lax.top_k(group_XG, top_k_groups)
        keep_XG = jnp.zeros((X, n_groups), bool).at[jnp.arange(X)[:, None], best_groups].set(True)
        choice_XE = jnp.where(jnp.repeat(keep_XG, E // n_groups, axis=1), choice_XE, -jnp.inf)
    _, experts_XR = jax.lax.top_k(choice_XE, top_k)
    weights_XR = jnp.take_along_axis(scores_XE, experts_XR, axis=-1)
    if normalize_top_k:
        weights_XR = weights_XR / weights_XR.sum(-1, keepdims=True)
    return Routing(experts_XR.astype(jnp.int32), weights_XR * routed_scaling, scores_XE)


def load_balancing_loss(routing: Routing) -> jax.Array:
    """E · Σ_e f_e · P_e: 1 when routing is uniform, E when every token picks one expert.
    P_e averages the scores normalised per token (the softmax's already are; sigmoid scores
    are normalised as in DeepSeek-V3's balance loss)."""
    E = routing.scores_XE.shape[-1]
    f_E = jnp.zeros(E).at[routing.experts_XR.reshape(-1)].add(1.0) / routing.experts_XR.size
    return E * jnp.sum(f_E * normalized_scores(routing).mean(axis=0))


def normalized_scores(routing: Routing) -> jax.Array:
    return routing.scores_XE / routing.scores_XE.sum(-1, keepdims=True)


def router_z_loss(logits_XE: jax.Array) -> jax.Array:
    return jnp.mean(jax.nn.logsumexp(logits_XE.astype(jnp.float32), axis=-1) ** 2)


def capacity(n_assignments: int, n_experts: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(A/E · capacity_factor)."""
    return math.ceil(n_assignments / n_experts * capacity_factor)


def slot_positions(experts_XR: jax.Array, n_experts: int) -> jax.Array:
    """`[X, R]`: each assignment's position among its expert's assignments, in priority order
    (every token's first choice, then every second choice, ...; tokens in order within one)."""
    onehot_AE = jax.nn.one_hot(experts_XR.T.reshape(-1), n_experts, dtype=jnp.int32)
    position_A = ((jnp.cumsum(onehot_AE, axis=0) - 1) * onehot_AE).sum(-1)
    return position_A.reshape(experts_XR.shape[::-1]).T


def capacity_slots(experts_XR: jax.Array, n_experts: int, slots: int):
    """`(slot_XR, kept_XR)`: each assignment's row in the experts' buffers flattened to
    `[E · slots]` (expert · slots + its position), kept when its position is below `slots`.
    Dropped assignments point one past the buffers (row E · slots)."""
    position_XR = slot_positions(experts_XR, n_experts)
    kept_XR = position_XR < slots
    return jnp.where(kept_XR, experts_XR * slots + position_XR, n_experts * slots), kept_XR


def apply_experts(p: dict, x_BTD: jax.Array, experts_BTR: jax.Array, weights_BTR: jax.Array,
                  *, mlp: str, dispatch: str, capacity_factor: float | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """Σ_r weight_r · Expert_{e_r}(x) per token, `[B, T, D]` in x's dtype, and the number of
    dropped assignments. `p`: the experts' stacked MLP weights `w_up, w_down[, w_gate]`
    (`[E, D, M]`, `[E, M, D]`) of MLP kind `mlp`.

    Each sequence is one dispatch group (GShard's groups): its T·R assignments compete for
    C = ceil(T·R/E · capacity_factor) slots per expert, so a row's drops never depend on the
    other rows of the batch, and the buffers of a data-parallel batch stay on the devices of
    its rows. `capacity_factor` decides which assignments are dropped (None: none),
    `dispatch` only how the experts' matmuls are laid out: both drop the same assignments and
    compute the same function (with None, the capacity buffers hold every token: C = T)."""
    E = p["w_up"].shape[0]
    B, T, R = experts_BTR.shape
    slots = T if capacity_factor is None else capacity(T * R, E, capacity_factor)
    slot_BTR, kept_BTR = jax.vmap(capacity_slots, in_axes=(0, None, None))(experts_BTR, E, slots)
    weights_BTR = jnp.where(kept_BTR, weights_BTR, 0.0)
    dropped = B * T * R - kept_BTR.sum()
    if dispatch == "capacity":
        y_BTD = _capacity_experts(p, x_BTD, slot_BTR, weights_BTR, mlp, E, slots)
    else:
        # Sorting and grouped matmuls cannot be partitioned by XLA: each device runs its rows.
        # The weights go in as their arrays (an int8 weight's two, a LoRA weight's base and
        # adapters), whole on every device.
        leaves, weights_def = jax.tree.flatten(p)
        y_BTD = per_shard(functools.partial(_dropless_experts, weights_def=weights_def,
                                            mlp=mlp),
                          in_axes=[(None,) * leaf.ndim for leaf in leaves]
                          + [("batch", None, None)] * 3,
                          out_axes=("batch", None, None))(*leaves, x_BTD, experts_BTR,
                                                          weights_BTR)
    return y_BTD.astype(x_BTD.dtype), dropped


def _capacity_experts(p, x_BTD, slot_BTR, weights_BTR, mlp, E, slots):
    """Tokens scattered into their slots of `[B, E, C, D]` buffers (the dropped ones into a
    spare row, cut off), batched expert matmuls, outputs gathered back by the same slots."""
    B, T, R = slot_BTR.shape
    D = x_BTD.shape[-1]
    # One flat scatter: row b's slots are rows b·(E·C + 1) + slot of all rows' buffers.
    flat_BTR = slot_BTR + (E * slots + 1) * jnp.arange(B, dtype=slot_BTR.dtype)[:, None, None]
    rows_BTRD = jnp.broadcast_to(x_BTD[:, :, None], (B, T, R, D))
    buffers = jnp.zeros((B * (E * slots + 1), D), x_BTD.dtype).at[flat_BTR.reshape(-1)].add(
        rows_BTRD.reshape(-1, D)).reshape(B, E * slots + 1, D)
    # The expert axis moves from the batch to the experts here (an all-to-all under EP).
    in_BECD = constrain(buffers[:, :-1].reshape(B, E, slots, D),
                        ("expert_batch", "experts", None, None))
    out_BECD = ffn(mlp, p, in_BECD,
                   lambda x_BECD, w_EDM, _: einsum_f32("BECD,EDM->BECM", x_BECD, w_EDM),
                   lambda h_BECM, w_EMD, _: einsum_f32("BECM,EMD->BECD", h_BECM, w_EMD))
    out_rows = jnp.concatenate([out_BECD.reshape(B, E * slots, D),
                                jnp.zeros((B, 1, D), out_BECD.dtype)], axis=1)
    gathered_BTRD = out_rows.reshape(-1, D)[flat_BTR]
    return jnp.einsum("BTRD,BTR->BTD", gathered_BTRD, weights_BTR,
                      precision=matmul_precision(gathered_BTRD, weights_BTR))


def _dropless_experts(*arrays, weights_def, mlp: str):
    """Assignments sorted by expert, grouped matmuls over the sorted rows, unsorted; dropped
    assignments (weight zero) are computed too — grouped matmuls have no buffers to overflow.
    `arrays`: the leaves of the weights' tree (`weights_def`), then the tokens."""
    p = jax.tree.unflatten(weights_def, arrays[:weights_def.num_leaves])
    x_BTD, experts_BTR, weights_BTR = arrays[weights_def.num_leaves:]
    B, T, R = experts_BTR.shape
    E = p["w_up"].shape[0]
    experts_A = experts_BTR.reshape(-1)
    order_A = jnp.argsort(experts_A, stable=True)
    rows_AD = x_BTD.reshape(B * T, -1)[order_A // R]
    sizes_E = jnp.zeros(E, jnp.int32).at[experts_A].add(1)

    def grouped(rows, w, _):
        return grouped_f32(rows, w, sizes_E)
    out_AD = ffn(mlp, p, rows_AD, grouped, grouped)
    unsorted_BTRD = jnp.zeros_like(out_AD).at[order_A].set(out_AD).reshape(B, T, R, -1)
    return jnp.einsum("BTRD,BTR->BTD", unsorted_BTRD, weights_BTR,
                      precision=matmul_precision(unsorted_BTRD, weights_BTR))


def moe_specs(config: ModelConfig, residual_scale: float) -> dict:
    """The router `[D, E]`, the routed experts (`[E, D, M]`, `[E, M, D]`), a selection bias
    `[E]` with the sigmoid router, and the shared experts (`[D, U]`, `[U, D]`)."""
    dims, m = config.dims, config.moe
    experts = ffn_specs(dims, m.expert_mlp, "M", residual_scale, lead=(("E", "experts"),))
    specs = {"router": weight(dims, "DE", ("embed", "experts")),
             "experts": map_specs(lambda s: dataclasses.replace(s, used=m.top_k / m.n_experts),
                                  experts)}
    if ROUTERS[m.router].selection_bias:
        specs["selection_bias"] = bias(dims, "E", ("experts",))
    if m.n_shared_experts:
        specs["shared"] = ffn_specs(dims, m.expert_mlp, "U", residual_scale)
    return specs


def dispatch_of(config: ModelConfig, drop: bool) -> str:
    """auto: fixed capacity buffers where a capacity factor bounds them, else dropless
    (capacity buffers without one would hold every token for every expert)."""
    if config.moe_dispatch != "auto":
        return config.moe_dispatch
    return "capacity" if drop and config.moe.capacity_factor is not None else "dropless"


def apply_moe(config: ModelConfig, p: dict, x_BTD: jax.Array, *, drop: bool = True):
    """`(y_BTD, aux)`: the routed experts' weighted sum plus the shared experts, and
    `{"loss": weighted router losses, "moe": load statistics}` (sums, see `moe_metrics`).
    `drop=False` ignores the capacity factor (the cached decoder)."""
    m = config.moe
    B, T, D = x_BTD.shape
    x_XD = x_BTD.reshape(B * T, D)
    logits_XE = einsum_f32("XD,DE->XE", x_XD.astype(jnp.float32), p["router"])
    bias_E = p.get("selection_bias")
    routing = route(logits_XE, top_k=m.top_k, router=m.router, normalize_top_k=m.normalize_top_k,
                    routed_scaling=m.routed_scaling, n_groups=m.n_groups,
                    top_k_groups=m.top_k_groups,
                    selection_bias_E=None if bias_E is None else jax.lax.stop_gradient(bias_E))
    y_BTD, dropped = apply_experts(p["experts"], x_BTD, routing.experts_XR.reshape(B, T, -1),
                                   routing.weights_XR.reshape(B, T, -1), mlp=m.expert_mlp,
                                   dispatch=dispatch_of(config, drop),
                                   capacity_factor=m.capacity_factor if drop else None)
    if "shared" in p:
        y_BTD = y_BTD + apply_mlp(config, p["shared"], x_BTD)
    balance, z = load_balancing_loss(routing), router_z_loss(logits_XE)
    probs_XE = normalized_scores(routing)
    tokens = jnp.float32(B * T)
    stats = {"load_E": jnp.zeros(m.n_experts).at[routing.experts_XR.reshape(-1)].add(1.0),
             "dropped": dropped.astype(jnp.float32), "tokens": tokens,
             "entropy": -jnp.sum(probs_XE * jnp.log(jnp.maximum(probs_XE, 1e-30))),
             "balance": balance * tokens, "z": z * tokens}
    return y_BTD, {"loss": m.aux_loss_weight * balance + m.router_z_loss_weight * z,
                   "moe": stats}


def moe_metrics(stats: dict) -> dict[str, jax.Array]:
    """Scalars from load statistics summed over batches, each leaf with a leading axis over
    the MoE layers: the dropped fraction of assignments, the most and least loaded expert's
    share of its layer's assignments (1/E when balanced), the mean router entropy (nats, of
    the scores normalised per token) and the mean unweighted router losses."""
    tokens = stats["tokens"].sum()
    load_LE = stats["load_E"]
    share_LE = load_LE / jnp.maximum(load_LE.sum(-1, keepdims=True), 1.0)
    return {"moe_dropped_fraction": stats["dropped"].sum() / jnp.maximum(load_LE.sum(), 1.0),
            "moe_max_load_share": share_LE.max(), "moe_min_load_share": share_LE.min(),
            "moe_router_entropy": stats["entropy"].sum() / tokens,
            "moe_load_balancing_loss": stats["balance"].sum() / tokens,
            "moe_router_z_loss": stats["z"].sum() / tokens}


def update_selection_bias(config: ModelConfig, p_L: dict, load_LE: jax.Array) -> dict:
    """DeepSeek-V3's auxiliary-loss-free balancing, outside the gradient: each layer's
    selection bias moves by bias_update_rate towards its mean load (up for underloaded
    experts, down for overloaded ones). `p_L`: the MoE parameters of a group, stacked."""
    bias_LE = p_L["selection_bias"]
    error_LE = load_LE.mean(-1, keepdims=True) - load_LE
    step_LE = config.moe.bias_update_rate * jnp.sign(error_LE)
    return {**p_L, "selection_bias": (bias_LE + step_LE).astype(bias_LE.dtype)}
