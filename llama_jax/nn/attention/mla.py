"""Multi-head Latent Attention (`attention: mla`, the `mla:` config section; DeepSeek-AI 2024,
"DeepSeek-V2"): the mixer whose KV cache holds one low-rank latent per token instead of keys
and values per head.

Letters besides the model's (chosen apart from the MoE's): Z the KV latent width
(kv_lora_rank), Q the query latent's (q_lora_rank), J a head's position-free query/key features
(qk_nope_head_dim), I its rotary ones (qk_rope_head_dim), Y its value width (v_head_dim);
H = J + I; W = Z + I, what the cache holds per token and layer.

Per token (eq. 9-19 of the paper; W_DKV, W_KR are one `kv_a_proj_with_mqa` in DeepSeek's
checkpoints, split here):
    c = RMSNorm(x·W_DKV)                  [Z]     the latent (normalised, as DeepSeek does)
    k_R = RoPE(x·W_KR)                    [I]     one rotary key shared by all heads
    q = x·W_Q, or RMSNorm(x·W_DQ)·W_Q      [N, H]  q = [q_nope, RoPE(q_rope)] per head
    k = [c·W_UK, k_R], v = c·W_UV          [N, H], [N, Y] per head
    out = softmax(q·kᵀ · scale + mask)·v · W_O
with scale = 1/√H (J + I, not the absorbed width Z + I) times YaRN's mscale² (rope.py).

Two ways to compute it, one function of the config and the mode (`apply`):
- expanded (training, prefill, and decode with `mla_decode: expanded`): per-head keys and
  values are materialised from the latents and attended by `dot_product_attention` under the
  configured implementation (q/k head dim H, value head dim Y).
- absorbed (a decode step, or a verify pass of a few tokens): q_nope·(c·W_UK)ᵀ =
  (q_nope·W_UKᵀ)·cᵀ, so each head's query is moved into the latent space once and scores
  against the cached latents directly; softmax·v =
  (softmax·c)·W_UV, so W_UV comes after the softmax. That is multi-query attention with one
  "head" of width W = [c, k_R] (values: c) and N query heads: per step the cache is read once,
  and nothing per head is built for the S cached tokens (expanded rebuilds N·(J + Y) values for
  each of them).

The cache is `[B, S, W]` per layer (`LayerCache`, the unrolled decoder's) or `[L, B, S, W]` per
scanned group (`StackedCache`): L·W values per token against GQA's 2·L·K·H (DeepSeek-V2:
576 per layer, where the paper's MHA baseline, 128 heads of 128, caches 32768); float, or int8
with one scale per token's latent (kv_storage.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

from llama_jax.nn.attention import kv_storage
from llama_jax.nn.attention.context import (MIXERS, Context, Mixer, attention_of,
                                           causal_attention_flops)
from llama_jax.nn.attention.dot_product import DECODE_QUERIES, dense_attention
from llama_jax.nn.norms import rms_norm
from llama_jax.nn.ops import cast_weight, dense, einsum_f32
from llama_jax.errors import require
from llama_jax.nn.positions import POSITIONS, Rotation
from llama_jax.nn.rope import softmax_scale
from llama_jax.quant import Int8, as_float
from llama_jax.spec import gain, weight
from llama_jax.parallel.sharding import constrain

if TYPE_CHECKING:
    from llama_jax.config import ModelConfig

# DeepSeek's latent RMSNorms use their class default, not the model's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def specs(config: ModelConfig, residual_scale: float) -> dict:
    """`residual_scale` shrinks the init of W_O, which writes into the residual stream."""
    dims = config.dims
    lora = config.mla.q_lora_rank is not None
    q_in, q_axis = ("Q", "latent") if lora else ("D", "embed")
    tensors = {}
    if lora:
        tensors.update(wq_a=weight(dims, "DQ", ("embed", "latent"), contract="D"),
                       q_norm=gain(dims, "Q", ("norm",)))
    tensors.update(
        wq_nope=weight(dims, q_in + "NJ", (q_axis, "q_heads", "head_dim"), contract=q_in),
        wq_rope=weight(dims, q_in + "NI", (q_axis, "q_heads", "head_dim"), contract=q_in),
        w_dkv=weight(dims, "DZ", ("embed", "latent"), contract="D"),
        w_kr=weight(dims, "DI", ("embed", "head_dim"), contract="D"),
        kv_norm=gain(dims, "Z", ("norm",)),
        w_uk=weight(dims, "ZNJ", ("latent", "q_heads", "head_dim"), contract="Z"),
        w_uv=weight(dims, "ZNY", ("latent", "q_heads", "head_dim"), contract="Z"),
        wo=weight(dims, "NYD", ("q_heads", "head_dim", "embed"), residual_scale,
                  contract="NY"))
    return tensors


def apply(config: ModelConfig, p: dict, x_BTD: jax.Array, context: Context,
          kv: "StackedCache | LayerCache | None" = None):
    """Self-attention of normed inputs `[B, T, D]`; returns `([B, T, D], kv)`. With a cache
    the new tokens' latents are written at `context.end` first and the queries attend to the
    whole cache: absorbed for up to `DECODE_QUERIES` tokens (a decode step or a speculative
    verify pass; unless `mla_decode: expanded`), expanded otherwise."""
    q_nope_BTNJ, q_rope_BTNI = _queries(config, p, x_BTD, context.rotation)
    c_BTZ = rms_norm(dense("BTD,DZ->BTZ", x_BTD, p["w_dkv"]), p["kv_norm"], LATENT_NORM_EPS)
    k_rope_BTI = context.rotation.apply(dense("BTD,DI->BTI", x_BTD, p["w_kr"])[:, :, None])[:, :, 0]
    latent_BTW = jnp.concatenate([c_BTZ, k_rope_BTI], axis=-1)
    if kv is None:
        out_BTNY = _expanded(config, p, q_nope_BTNJ, q_rope_BTNI, latent_BTW, context)
    else:
        kv = kv.write(latent_BTW, context)
        latent_BSW = kv.read(context, x_BTD.dtype)
        absorbed = x_BTD.shape[1] <= DECODE_QUERIES and config.mla_decode == "absorbed"
        out_BTNY = (_absorbed if absorbed else _expanded)(config, p, q_nope_BTNJ, q_rope_BTNI,
                                                         latent_BSW, context)
    return dense("BTNY,NYD->BTD", out_BTNY, p["wo"]), kv


def _queries(config: ModelConfig, p: dict, x_BTD: jax.Array, rotation: Rotation):
    """`(q_nope [B, T, N, J], RoPE(q_rope) [B, T, N, I])`, through the query latent if any."""
    if config.mla.q_lora_rank is not None:
        x_BTQ = rms_norm(dense("BTD,DQ->BTQ", x_BTD, p["wq_a"]), p["q_norm"], LATENT_NORM_EPS)
        q_nope_BTNJ = dense("BTQ,QNJ->BTNJ", x_BTQ, p["wq_nope"])
        q_rope_BTNI = dense("BTQ,QNI->BTNI", x_BTQ, p["wq_rope"])
    else:
        q_nope_BTNJ = dense("BTD,DNJ->BTNJ", x_BTD, p["wq_nope"])
        q_rope_BTNI = dense("BTD,DNI->BTNI", x_BTD, p["wq_rope"])
    return q_nope_BTNJ, rotation.apply(q_rope_BTNI)


def _expanded(config: ModelConfig, p: dict, q_nope_BTNJ, q_rope_BTNI, latent_BSW,
              context: Context) -> jax.Array:
    """Per-head keys `[c·W_UK, k_R]` and values `c·W_UV` of the S latents, then attention
    under the configured implementation: `[B, T, N, Y]`."""
    Z = config.mla.kv_lora_rank
    latent_BSW = as_float(latent_BSW, q_nope_BTNJ.dtype)
    c_BSZ, k_rope_BSI = latent_BSW[..., :Z], latent_BSW[..., Z:]
    k_nope_BSNJ = dense("BSZ,ZNJ->BSNJ", c_BSZ, p["w_uk"])
    v_BSNY = dense("BSZ,ZNY->BSNY", c_BSZ, p["w_uv"])
    k_rope_BSNI = jnp.broadcast_to(k_rope_BSI[:, :, None], (*k_nope_BSNJ.shape[:3],
                                                             k_rope_BSI.shape[-1]))
    q_BTNH = jnp.concatenate([q_nope_BTNJ, q_rope_BTNI], axis=-1)
    k_BSNH = jnp.concatenate([k_nope_BSNJ, k_rope_BSNI], axis=-1)
    q_BTNH = constrain(q_BTNH, ("batch", "seq", "heads", "head_dim"))
    k_BSNH = constrain(k_BSNH, ("batch", "seq", "heads", "head_dim"))
    v_BSNY = constrain(v_BSNY, ("batch", "seq", "heads", "head_dim"))
    return attention_of(config)(q_BTNH, k_BSNH, v_BSNY, context.mask)


def _absorbed(config: ModelConfig, p: dict, q_nope_BTNJ, q_rope_BTNI, latent_BSW,
              context: Context) -> jax.Array:
    """Attention over the latents themselves: queries `[q_nope·W_UKᵀ, q_rope]` of width W
    against the cached `[c, k_R]` as one shared key head, values c, then W_UV: `[B, T, N, Y]`."""
    Z, dtype = config.mla.kv_lora_rank, q_nope_BTNJ.dtype
    q_latent_BTNZ = einsum_f32("BTNJ,ZNJ->BTNZ", q_nope_BTNJ, cast_weight(p["w_uk"], dtype))
    q_BTNW = jnp.concatenate([q_latent_BTNZ.astype(dtype), q_rope_BTNI], axis=-1)
    q_BTNW = constrain(q_BTNW, ("batch", "seq", "heads", None))
    latent_BS1W = latent_BSW[:, :, None]
    out_BTNZ = dense_attention(q_BTNW, latent_BS1W, latent_BS1W[..., :Z], context.mask.dense(),
                               scale=softmax_scale(config))
    out_BTNY = einsum_f32("BTNZ,ZNY->BTNY", out_BTNZ, cast_weight(p["w_uv"], dtype))
    return out_BTNY.astype(dtype)


# --------------------------------------------------------------------------- the latent cache

@struct.dataclass
class StackedCache:
    """A layer group's cache `[L, B, S, W]`, read and written at `context.layer`."""

    latent: jax.Array | Int8
    dtype: str = struct.field(pytree_node=False)  # of the cached values

    @classmethod
    def zeros(cls, config: ModelConfig, n_layers: int, batch: int, max_len: int,
              dtype: str) -> "StackedCache":
        shape = (n_layers, batch, max_len, cache_width(config))
        return cls(_constrain_stacked(kv_storage.zeros(shape, dtype)), dtype)

    def write(self, latent_BTW: jax.Array, context: Context) -> "StackedCache":
        latent = kv_storage.write(self.latent, latent_BTW[None],
                                  (context.layer, 0, context.end, 0), self.dtype, row_axis=1,
                                  pages_BN=context.pages)
        return self.replace(latent=_constrain_stacked(latent))

    def read(self, context: Context, compute_dtype) -> jax.Array | Int8:
        return _read(self.latent[context.layer], context, self.dtype, compute_dtype)



@struct.dataclass
class LayerCache:
    """One layer's cache `[B, S, W]`."""

    latent: jax.Array | Int8
    dtype: str = struct.field(pytree_node=False)  # of the cached values

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int, dtype: str) -> "LayerCache":
        latent = kv_storage.zeros((batch, max_len, cache_width(config)), dtype, bits=True)
        return cls(_constrain_layer(latent), dtype)

    def write(self, latent_BTW: jax.Array, context: Context) -> "LayerCache":
        latent = kv_storage.write(self.latent, latent_BTW, (0, context.end, 0), self.dtype,
                                  pages_BN=context.pages)
        return self.replace(latent=_constrain_layer(latent))

    def read(self, context: Context, compute_dtype) -> jax.Array | Int8:
        return _read(self.latent, context, self.dtype, compute_dtype)



def _read(latent_BSW: jax.Array | Int8, context: Context, dtype: str, compute_dtype
          ) -> jax.Array | Int8:
    """One layer's latents for attention; from a pool of pages `[P, page, W]`, the rows'."""
    if context.pages is not None:
        latent_BSW = kv_storage.gather_pages(latent_BSW, context.pages, 0, 1)
    return kv_storage.read(latent_BSW, dtype, compute_dtype)


def cache_width(config: ModelConfig) -> int:
    """W = kv_lora_rank + qk_rope_head_dim: what one token caches per layer."""
    return config.mla.kv_lora_rank + config.mla.qk_rope_head_dim


def cache_vectors(config: ModelConfig) -> tuple[int, int]:
    """What one token caches per layer: one vector of W values."""
    return 1, cache_width(config)


def cache_split(config: ModelConfig) -> tuple[str, int]:
    """The cache dimension the cache rules may split besides the rows: the latent width
    (replicated by default)."""
    return "latent", cache_width(config)


def _constrain_stacked(latent_LBSW: jax.Array | Int8) -> jax.Array | Int8:
    return kv_storage.constrained(latent_LBSW, (None, "batch", "seq", "latent"))


def _constrain_layer(latent_BSW: jax.Array | Int8) -> jax.Array | Int8:
    return kv_storage.constrained(latent_BSW, ("batch", "seq", "latent"))


def saved_activations(config: ModelConfig, heads: int, kv_heads: int) -> dict[str, int]:
    """Elements per token the projections keep for the backward pass under each remat policy
    (`heads`: those a device holds; every head has its own key and value). Expanded, per-head
    k and v: q and output N·(H + Hv), k and v N·(H + Hv), plus the latents before and after
    their norms (2·(Z + I + Q)) and the parts joined into q and k (2·N·H: the shared RoPE key
    is broadcast to every head); the dots policies keep the latents' matmul outputs
    (Z + I + Q) and q's and k's parts instead of the joined q and k; the attention policies
    attention's q, k, v and output (2·N·(H + Hv)), with the dots for dots_with_attention."""
    H, Hv, a = config.H, config.v_head_dim, config.mla
    latents = a.kv_lora_rank + a.qk_rope_head_dim + (a.q_lora_rank or 0)
    parts = 2 * heads * H
    return {"none": 2 * heads * (H + Hv) + 2 * latents + parts,
            "dots": 2 * heads * Hv + latents + parts,
            "dots_no_batch": heads * Hv + latents + parts,
            "attention": 2 * heads * (H + Hv),
            "dots_with_attention": 2 * heads * Hv + latents + parts}


def check_config(config: ModelConfig) -> None:
    """MLA fixes the head layout: every head has its own key and value (n_kv_heads =
    n_heads), queries and keys have qk_nope + qk_rope features (head_dim), and its decoupled
    key needs RoPE; its projections have no biases."""
    qk_head_dim = config.mla.qk_nope_head_dim + config.mla.qk_rope_head_dim
    require(config.n_kv_heads == config.n_heads, "n_kv_heads", config.n_kv_heads,
            f"does not apply to attention 'mla' (each of the n_heads={config.n_heads} heads "
            "expands its own key and value from the shared latent); remove it")
    require(config.head_dim == qk_head_dim, "head_dim", config.head_dim,
            f"is mla.qk_nope_head_dim + mla.qk_rope_head_dim ({qk_head_dim}) with "
            "attention 'mla'; remove it (or set it to null)")
    require(POSITIONS[config.positions].rotary, "positions", config.positions,
            "must be 'rope' with attention 'mla' (its decoupled key is rotary)")
    require(not config.bias, "bias", config.bias, "is not supported with attention 'mla'")


MIXERS.register("mla", Mixer(specs, apply, StackedCache.zeros, LayerCache.zeros, cache_split,
                             cache_vectors, saved_activations, check_config,
                             causal_attention_flops))
