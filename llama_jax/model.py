"""The LLaMA decoder as pure functions over a `Params` pytree.

Architecture (Touvron et al. 2023a/b, Grattafiori et al. 2024; Meta's reference `model.py`):
token embedding → L pre-norm blocks `h = x + Attn(RMSNorm(x)); out = h + SwiGLU(RMSNorm(h))`
→ final RMSNorm → LM head (untied, or tied to the embedding as in LLaMA 3.2 1B/3B). RoPE is
applied to q and k after the projections. No biases anywhere.

The L blocks run under one `lax.scan` over the stacked layer weights, so compile time does not
grow with depth (`scan_layers=False` unrolls them, for comparison or for backends that schedule
unrolled code better); `config.remat` wraps the block in `jax.checkpoint` with a named policy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from llama_jax.attention import attention, attention_mask
from llama_jax.config import ModelConfig
from llama_jax.ops import dense, einsum_f32, rms_norm, swiglu
from llama_jax.params import LayerParams, Params
from llama_jax.rope import apply_rope, rope_cos_sin
from llama_jax.sharding import constrain

REMAT_POLICY_FNS = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def forward(config: ModelConfig, params: Params, tokens_BT: jax.Array, *,
            positions_BT: jax.Array | None = None,
            segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """Next-token logits `[B, T, V]` in fp32 for int32 tokens `[B, T]`.

    positions default to 0..T-1 per row; with `segment_ids_BT` (packed documents) tokens attend
    only within their own segment, and positions should restart at each document.
    """
    x_BTD = embed(config, params, tokens_BT)
    h_BTD = hidden_states(config, params, x_BTD, positions_BT=positions_BT,
                          segment_ids_BT=segment_ids_BT)
    return lm_head(config, params, h_BTD)


def embed(config: ModelConfig, params: Params, tokens_BT: jax.Array) -> jax.Array:
    return jnp.take(params.embed, tokens_BT, axis=0).astype(config.compute_dtype)


def lm_head(config: ModelConfig, params: Params, h_BTD: jax.Array) -> jax.Array:
    """fp32 logits: the loss and sampling want them in full precision."""
    if config.tie_embeddings:
        logits_BTV = einsum_f32("BTD,VD->BTV", h_BTD, params.embed.astype(h_BTD.dtype))
    else:
        logits_BTV = einsum_f32("BTD,DV->BTV", h_BTD, params.lm_head.astype(h_BTD.dtype))
    return constrain(logits_BTV, ("batch", "seq", "vocab"))


def hidden_states(config: ModelConfig, params: Params, x_BTD: jax.Array, *,
                  positions_BT: jax.Array | None = None,
                  segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """Embeddings `[B, T, D]` → final-normed hidden states `[B, T, D]` (what heads consume)."""
    B, T, _ = x_BTD.shape
    index_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if positions_BT is None:
        positions_BT = index_BT
    cos_BTh, sin_BTh = rope_cos_sin(config, positions_BT)
    mask_BTS = attention_mask(index_BT, index_BT, segment_ids_BT, segment_ids_BT)

    step = functools.partial(block, config, cos_BTh=cos_BTh, sin_BTh=sin_BTh, mask_BTS=mask_BTS)
    if config.remat != "none":
        step = jax.checkpoint(step, policy=REMAT_POLICY_FNS[config.remat], prevent_cse=False)
    if config.scan_layers:
        x_BTD, _ = jax.lax.scan(lambda x, layer: (step(layer, x), None), x_BTD, params.layers)
    else:
        for i in range(config.n_layers):
            x_BTD = step(jax.tree.map(lambda w: w[i], params.layers), x_BTD)
    return rms_norm(x_BTD, params.final_norm, config.norm_eps)


def block(config: ModelConfig, layer: LayerParams, x_BTD: jax.Array, *, cos_BTh: jax.Array,
          sin_BTh: jax.Array, mask_BTS: jax.Array) -> jax.Array:
    """One pre-norm decoder block; `layer` holds a single layer's (unstacked) weights."""
    x_BTD = constrain(x_BTD, ("batch", "seq", "embed"))
    q_BTNH, k_BTKH, v_BTKH = project_qkv(config, layer, x_BTD, cos_BTh, sin_BTh)
    out_BTD = finish_block(config, layer, x_BTD, attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS))
    return constrain(out_BTD, ("batch", "seq", "embed"))


def project_qkv(config: ModelConfig, layer: LayerParams, x_BTD: jax.Array, cos_BTh: jax.Array,
                sin_BTh: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """RMSNorm, then the q/k/v projections with RoPE on q and k (never v)."""
    h_BTD = rms_norm(x_BTD, layer.attn_norm, config.norm_eps)
    q_BTNH = apply_rope(dense("BTD,DNH->BTNH", h_BTD, layer.wq), cos_BTh, sin_BTh)
    k_BTKH = apply_rope(dense("BTD,DKH->BTKH", h_BTD, layer.wk), cos_BTh, sin_BTh)
    v_BTKH = dense("BTD,DKH->BTKH", h_BTD, layer.wv)
    return (constrain(q_BTNH, ("batch", "seq", "heads", "head_dim")),
            constrain(k_BTKH, ("batch", "seq", "kv_heads", "head_dim")),
            constrain(v_BTKH, ("batch", "seq", "kv_heads", "head_dim")))


def finish_block(config: ModelConfig, layer: LayerParams, x_BTD: jax.Array,
                 attn_BTNH: jax.Array) -> jax.Array:
    """Output projection and residual, then the SwiGLU half of the block."""
    h_BTD = x_BTD + dense("BTNH,NHD->BTD", attn_BTNH, layer.wo)
    ffn_in = rms_norm(h_BTD, layer.ffn_norm, config.norm_eps)
    return h_BTD + swiglu(ffn_in, layer.w_gate, layer.w_up, layer.w_down)
