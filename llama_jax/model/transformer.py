"""The decoder-only Transformer as pure functions over a parameter tree (params.py).

LLaMA by default (Touvron et al. 2023a/b, Grattafiori et al. 2024; Meta's reference `model.py`):
token embedding → L pre-norm blocks `h = x + Attn(RMSNorm(x)); out = h + SwiGLU(RMSNorm(h))`
→ final RMSNorm → LM head (untied, or tied to the embedding as in LLaMA 3.2 1B/3B), RoPE on q
and k. The config swaps components (nn/): LayerNorm, post-norm blocks `x = Norm(x + f(x))` with
no final norm (Vaswani et al. 2017), absolute positions added to the embedding, plain or gated
MLPs, biases, and a task head in place of the LM head (nn/heads.py).

`block` is the one block function: it serves the training forward, prefill and decode (the KV
cache is an optional input and output) and returns auxiliary outputs: a dict with the weighted
losses to add to the objective under "loss" and statistics of a component under its name (the
MoE's routing loads, nn/moe.py); empty for dense blocks. They come back per group, stacked over
its layers (`Output.aux`); `aux_loss`, `aux_metrics` and `update_outside_gradient` read them.
Layers run group by group (`layer_groups`):

- stacked weights `[L, ...]` run under one `lax.scan` per group, so compile time does not grow
  with depth; a stacked cache rides in the carry and is updated in place (passing it as scanned
  inputs/outputs would make XLA copy it). `scan_layers=False` unrolls the training loop.
- unstacked weights (a tuple of per-layer trees, `unstack_layers`) run an unrolled loop with a
  per-layer cache: the decoder's choice on CPU and GPU (`decode_impl="unrolled"`), where it
  measured faster (XLA:CPU copies each layer's weights out of the stacked arrays at every
  scan step).

`config.remat` wraps the block in `jax.checkpoint` with a named policy in training.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from llama_jax.config import ModelConfig
from llama_jax.model.kv_cache import KVCache
from llama_jax.nn.attention.context import Context
from llama_jax.nn.attention.dot_product import ATTENTION_NAMES, Mask
from llama_jax.nn.heads import apply_head, is_task_head, padding_layout
from llama_jax.nn.attention.mixers import mixer_of
from llama_jax.nn.mlp import apply_mlp
from llama_jax.nn.moe import apply_moe, moe_metrics, update_selection_bias
from llama_jax.nn.norms import apply_norm
from llama_jax.nn.ops import lookup
from llama_jax.nn.positions import add_positions, rotation
from llama_jax.nn.rope import ROTATED_NAME
from llama_jax.model.params import LayerGroup, Params, layer_groups
from llama_jax.parallel.sharding import constrain

_policies = jax.checkpoint_policies
# Attention's inputs (q, k, v after RoPE), output and log-sum-exp (nn/attention/), which a
# blockwise backward pass needs to skip the forward's rerun; cuDNN's forward call, whose
# outputs (the attention output and its softmax statistics) JAX's wrapper does not name, is
# matched by its primitive.
_ATTENTION = _policies.save_from_both_policies(
    _policies.save_only_these_names(*ATTENTION_NAMES),
    lambda prim, *_, **__: prim.name == "dot_product_attention_fwd_wrapper")
# Besides the projections: RoPE's outputs, the rotated queries and keys, kept in place of their
# projections (not beside them: the backward pass needs only one), so that it does not rotate
# them again. LLaMA-3 8B saving projections on XLA:TPU's clock: 17 ms a step.
_ROTATED = _policies.save_only_these_names(ROTATED_NAME)
_DOTS_NO_BATCH = _policies.save_from_both_policies(
    _policies.checkpoint_dots_with_no_batch_dims, _ROTATED)
REMAT_POLICY_FNS = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "dots": _policies.save_from_both_policies(_policies.checkpoint_dots, _ROTATED),
    "dots_no_batch": _DOTS_NO_BATCH,
    # attention is not recomputed, the rest of the block (norms, projections, MLP) is
    "attention": _ATTENTION,
    # the weight matmuls and attention are not recomputed: only elementwise work is
    "dots_with_attention": _policies.save_from_both_policies(_DOTS_NO_BATCH, _ATTENTION),
}


class Output(NamedTuple):
    hidden_BTD: jax.Array  # final hidden states (after the final norm of pre-norm models)
    cache: KVCache | None  # the cache with the new tokens' K/V written, when one was given
    aux: tuple  # per layer group: the blocks' auxiliary outputs, stacked over its layers


def forward(config: ModelConfig, params: Params, tokens_BT: jax.Array, *,
            positions_BT: jax.Array | None = None,
            segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """The head's fp32 outputs for int32 tokens `[B, T]`: next-token logits `[B, T, V]`, or a
    task head's (`[B, C]` pooled, `[B, T, C]` per token; nn/heads.py).

    positions default to 0..T-1 per row; with `segment_ids_BT` (packed documents) tokens attend
    only within their own segment, and positions should restart at each document. A task
    head's rows may be padded with `config.pad_id` (on either side): by default its padding is
    kept apart (`heads.padding_layout`).
    """
    if is_task_head(config) and positions_BT is None and segment_ids_BT is None:
        positions_BT, segment_ids_BT = padding_layout(config, tokens_BT)
    out = apply(config, params, tokens_BT, positions_BT=positions_BT,
                segment_ids_BT=segment_ids_BT)
    return apply_head(config, params, out.hidden_BTD, tokens_BT)


def hidden_states(config: ModelConfig, params: Params, tokens_BT: jax.Array, *,
                  positions_BT: jax.Array | None = None,
                  segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """Final hidden states `[B, T, D]` (what the LM head and task heads consume)."""
    return apply(config, params, tokens_BT, positions_BT=positions_BT,
                 segment_ids_BT=segment_ids_BT).hidden_BTD


def apply(config: ModelConfig, params: Params, tokens_BT: jax.Array, *,
          positions_BT: jax.Array | None = None, segment_ids_BT: jax.Array | None = None,
          cache: KVCache | None = None) -> Output:
    """The model up to the final hidden states. With a `cache`, the T tokens are the next ones
    of each row: their K/V are written at slots `cache.end ..` and they attend to the cache;
    positions and the mask then come from the cache (see kv_cache.py)."""
    B, T = tokens_BT.shape
    if cache is None:
        context = Context(Mask.causal(B, T, segment_ids_BT))
        if positions_BT is None:
            positions_BT = context.mask.q_index_BT
    else:
        if positions_BT is not None or segment_ids_BT is not None:
            raise ValueError("with a cache, positions and the mask come from the cache's slots; "
                             "positions_BT and segment_ids_BT must be None")
        positions_BT, mask = cache.positions_and_mask(T)
        context = Context(mask, end=cache.end, pages=cache.pages)
    context = context.replace(rotation=rotation(config, positions_BT))
    x_BTD = embed(config, params, tokens_BT, positions_BT)
    x_BTD, groups, aux = run_layers(config, params["groups"], x_BTD, context,
                                    None if cache is None else cache.groups)
    if config.norm_position == "pre":
        x_BTD = apply_norm(config, params["final_norm"], x_BTD)
    return Output(x_BTD, None if cache is None else cache.advance(groups, T), aux)


def embed(config: ModelConfig, params: Params, tokens_BT: jax.Array,
          positions_BT: jax.Array) -> jax.Array:
    """Token embeddings (times √D with `embed_scale`, as the original Transformer does so that
    they are not drowned by the unit-amplitude sinusoids) plus absolute positions."""
    x_BTD = lookup(params["embed"]["table"], tokens_BT, config.compute_dtype)
    if config.embed_scale:
        x_BTD = x_BTD * jnp.asarray(config.dim ** 0.5, x_BTD.dtype)
    return add_positions(config, params.get("positions", {}), x_BTD, positions_BT)


def block(config: ModelConfig, group: LayerGroup, p: Params, x_BTD: jax.Array,
          context: Context, kv=None):
    """One block of `group` on one layer's (unstacked) weights: `(x_BTD, kv, aux)`.

    pre-norm:  h = x + Attn(Norm(x));  out = h + MLP(Norm(h))
    post-norm: h = Norm(x + Attn(x));  out = Norm(h + MLP(h))
    """
    x_BTD = constrain(x_BTD, ("batch", "residual_seq", "embed"))
    pre = config.norm_position == "pre"
    attn_in = apply_norm(config, p["attn_norm"], x_BTD) if pre else x_BTD
    attn_BTD, kv = mixer_of(config).apply(config, p["attn"], attn_in, context, kv)
    h_BTD = x_BTD + attn_BTD
    if not pre:
        h_BTD = apply_norm(config, p["attn_norm"], h_BTD)
    mlp_in = apply_norm(config, p["mlp_norm"], h_BTD) if pre else h_BTD
    if group.moe:  # the cached decoder (kv given) never drops tokens: see nn/moe.py
        mlp_BTD, aux = apply_moe(config, p["mlp"], mlp_in, drop=kv is None)
    else:
        mlp_BTD, aux = apply_mlp(config, p["mlp"], mlp_in), {}
    out_BTD = h_BTD + mlp_BTD
    if not pre:
        out_BTD = apply_norm(config, p["mlp_norm"], out_BTD)
    return constrain(out_BTD, ("batch", "residual_seq", "embed")), kv, aux


def run_layers(config: ModelConfig, groups: tuple, x_BTD: jax.Array, context: Context,
               caches: tuple | None = None):
    """Every layer group in order: `(x_BTD, caches, aux)`, aux per group stacked over layers."""
    new_caches, aux = [], []
    for group, p_group, kv in zip(layer_groups(config), groups,
                                  caches if caches is not None else [None] * len(groups)):
        step = functools.partial(block, config, group)
        if config.remat != "none" and kv is None:
            # A scan's body cannot be merged with the backward pass, so CSE is safe to allow
            # there (and avoids the barriers it costs); an unrolled loop needs the barrier, or
            # XLA merges the recomputed forward with the saved one and remat saves nothing.
            unrolled = isinstance(p_group, tuple) or not config.scan_layers
            step = jax.checkpoint(step, policy=REMAT_POLICY_FNS[config.remat],
                                  prevent_cse=unrolled)
        x_BTD, kv, group_aux = _run_group(step, p_group, group.n_layers, x_BTD, context, kv,
                                          config.scan_layers)
        new_caches.append(kv)
        aux.append(group_aux)
    return x_BTD, tuple(new_caches), tuple(aux)


def _run_group(step, p_group, n_layers: int, x_BTD, context: Context, kv, scan: bool):
    unstacked = isinstance(p_group, tuple)
    if unstacked or (kv is None and not scan):
        # An unrolled loop: over unstacked weights with per-layer caches (the CPU decoder), or
        # over slices of the stacked weights (training with scan_layers=False).
        layers = p_group if unstacked else [jax.tree.map(lambda w, i=i: w[i], p_group)
                                            for i in range(n_layers)]
        kvs = list(kv) if kv is not None else [None] * n_layers
        auxes = []
        for i, p_layer in enumerate(layers):
            x_BTD, kvs[i], layer_aux = step(p_layer, x_BTD, context, kvs[i])
            auxes.append(layer_aux)
        return x_BTD, None if kv is None else tuple(kvs), jax.tree.map(
            lambda *a: jnp.stack(a), *auxes)

    def layer_step(carry, xs):
        x_BTD, kv = carry
        p_layer, i = xs
        x_BTD, kv, layer_aux = step(p_layer, x_BTD, context.replace(layer=i), kv)
        return (x_BTD, kv), layer_aux

    layer_ids = jnp.arange(n_layers, dtype=jnp.int32)
    (x_BTD, kv), aux_L = jax.lax.scan(layer_step, (x_BTD, kv), (p_group, layer_ids))
    return x_BTD, kv, aux_L


def aux_loss(aux: tuple) -> jax.Array:
    """The blocks' weighted auxiliary losses, summed over layers and groups (a scalar)."""
    return sum((jnp.sum(group["loss"]) for group in aux if "loss" in group), jnp.zeros(()))


def aux_metrics(aux: tuple) -> dict[str, jax.Array]:
    """Scalars to log from auxiliary statistics (summed over batches): the MoE's loads."""
    moe = [group["moe"] for group in aux if "moe" in group]
    if not moe:
        return {}
    return moe_metrics(jax.tree.map(lambda *a: jnp.concatenate(a), *moe))


def update_outside_gradient(config: ModelConfig, params: Params, aux: tuple) -> Params:
    """Parameters updated by rules rather than gradients, from a step's auxiliary statistics:
    the sigmoid router's selection bias (DeepSeek-V3's loss-free balancing)."""
    groups = list(params["groups"])
    for g, (group, group_aux) in enumerate(zip(layer_groups(config), aux)):
        if group.moe and "selection_bias" in groups[g]["mlp"] and config.moe.bias_update_rate:
            mlp = update_selection_bias(config, groups[g]["mlp"], group_aux["moe"]["load_E"])
            groups[g] = {**groups[g], "mlp": mlp}
    return {**params, "groups": tuple(groups)}


def unstack_layers(params: Params) -> Params:
    """The same parameters with each group as a tuple of per-layer trees (a copy): the weights
    the unrolled decoder reads, each exactly once per step."""
    def unstack(group):
        n_layers = jax.tree.leaves(group)[0].shape[0]
        return tuple(jax.tree.map(lambda w: w[i], group) for i in range(n_layers))
    return {**params, "groups": tuple(unstack(g) for g in params["groups"])}
