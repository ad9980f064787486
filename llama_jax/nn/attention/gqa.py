"""The attention mixer: causal dot-product attention with one code path for MHA, GQA and MQA,
its parameters, and its KV cache; and what every attention mixer (mla.py too) shares: the
`Context` of a forward pass, `attention_of` (the configured implementation and softmax scale)
and the 16-bit storage of per-layer caches (`stored_type`, `store`, `load`).

N query heads share K key/value heads (K = N: MHA, K = 1: MQA, otherwise GQA; Ainslie et al.
2023). The dot product itself runs under the configured implementation (dot_product.py: dense,
chunked, cuDNN or splash; all contract queries grouped as (K, G = N/K) against the K key/value
heads, so repeated K/V are never materialised; logits and softmax are fp32). RoPE (when the
positions are rotary) turns q and k after the projections, never v.

Masks are built from slot indices, not from RoPE positions: positions restart at each packed
document and may be arbitrary, while causality is about where a token sits in the sequence (or
in the KV cache). Segment ids keep packed documents from attending to each other.

The KV cache holds KV heads only (never repeated to N): 2·B·S·K·H values per layer. Two
layouts, one per decode implementation (see model.py):
- `StackedKV`: a layer group's `k, v: [L, B, K, S, H]`, carried through the layer scan and
  updated in place. Heads come before slots so the keys of one (row, head) are contiguous: the
  batched attention matmuls read the cache in place (measured on CPU: 2.7x faster than
  [L, B, S, K, H], which makes XLA transpose every layer's slice at every step).
- `MergedKV`: one layer's `[B, K·S, H]` (the same bytes as [B, K, S, H] with K and S merged),
  for the unrolled decoder over per-layer weights: no per-layer slice is copied, and a decode
  step attends with one matmul per row (`decode_attention_block_diagonal`). 16-bit values are
  stored as their uint16 bits (see `stored_type`).
Rows of a ragged batch are left-padded; every step writes all rows at the same slot `end`, so
an update is a single `dynamic_update_slice`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

from llama_jax.nn.attention.chunked import MASKED
from llama_jax.nn.attention.dot_product import Mask, dot_product_attention
from llama_jax.nn.ops import einsum_f32, linear
from llama_jax.errors import require
from llama_jax.nn.positions import POSITIONS, Rotation
from llama_jax.nn.rope import softmax_scale
from llama_jax.spec import bias, weight
from llama_jax.parallel.sharding import constrain

if TYPE_CHECKING:
    from llama_jax.config import ModelConfig


def decode_attention_block_diagonal(q_B1NH: jax.Array, k_BCH: jax.Array, v_BCH: jax.Array,
                                    mask_BS: jax.Array, scale: float) -> jax.Array:
    """Attention of one query per row over a per-layer cache `[B, C = K·S, H]`.

    Each row is one matmul over all K·S keys, with query/key pairs of different groups masked
    out, so the result equals dense attention. That spends K times the score FLOPs of a decode
    step (small next to reading the cache), but XLA:CPU runs B matmuls of N rows far faster than the
    B·K matmuls of G = N/K rows of the grouped form (measured: 2.2x on the attention alone,
    8.6 -> 6.1 ms for a batch-8 decode step of the benchmark model).
    """
    N = q_B1NH.shape[2]
    C, S = k_BCH.shape[1], mask_BS.shape[1]
    K = C // S
    logits_BNC = einsum_f32("BNH,BCH->BNC", q_B1NH[:, 0], k_BCH) * scale
    same_group_NC = (jnp.arange(N) // (N // K))[:, None] == (jnp.arange(C) // S)[None, :]
    mask_BNC = same_group_NC[None] & jnp.tile(mask_BS, (1, K))[:, None, :]
    probs_BNC = jax.nn.softmax(jnp.where(mask_BNC, logits_BNC, MASKED), axis=-1)
    out_BNH = einsum_f32("BNC,BCH->BNH", probs_BNC.astype(v_BCH.dtype), v_BCH)
    return out_BNH[:, None].astype(q_B1NH.dtype)


# ------------------------------------------------------------------------------- the mixer

def attention_specs(config: ModelConfig, residual_scale: float) -> dict:
    """`residual_scale` shrinks the init of W_O, which writes into the residual stream."""
    dims = config.dims
    specs = {"wq": weight(dims, "DNH", ("embed", "q_heads", "head_dim"), contract="D"),
             "wk": weight(dims, "DKH", ("embed", "kv_heads", "head_dim"), contract="D"),
             "wv": weight(dims, "DKH", ("embed", "kv_heads", "head_dim"), contract="D"),
             "wo": weight(dims, "NHD", ("q_heads", "head_dim", "embed"), residual_scale,
                           contract="NH")}
    if config.bias:
        specs.update(bq=bias(dims, "NH", ("q_heads", "head_dim")),
                     bk=bias(dims, "KH", ("kv_heads", "head_dim")),
                     bv=bias(dims, "KH", ("kv_heads", "head_dim")),
                     bo=bias(dims, "D", ("norm",)))
    return specs


@struct.dataclass
class Context:
    """What the attention layers of one forward pass share: which keys each query may see (of
    the T new tokens in training, of the S cache slots when decoding), RoPE's rotation (None
    without rotary positions), the cache slot of the first new token, and the index of the
    layer running within its group (set by the layer scan, for stacked caches)."""

    mask: Mask
    rotation: Rotation | None = None
    end: jax.Array | None = None
    layer: jax.Array | int = 0


def apply_attention(config: ModelConfig, p: dict, x_BTD: jax.Array, context: Context,
                    kv: "StackedKV | MergedKV | None" = None):
    """Self-attention of normed inputs `[B, T, D]`; returns `([B, T, D], kv)`. Without a cache
    the T tokens attend to each other; with one their K/V are written at `context.end` first
    and the queries attend to the whole cache."""
    q_BTNH = linear("BTD,DNH->BTNH", x_BTD, p["wq"], p.get("bq"))
    k_BTKH = linear("BTD,DKH->BTKH", x_BTD, p["wk"], p.get("bk"))
    v_BTKH = linear("BTD,DKH->BTKH", x_BTD, p["wv"], p.get("bv"))
    if context.rotation is not None:
        q_BTNH, k_BTKH = context.rotation.apply(q_BTNH), context.rotation.apply(k_BTKH)
    q_BTNH = constrain(q_BTNH, ("batch", "seq", "heads", "head_dim"))
    k_BTKH = constrain(k_BTKH, ("batch", "seq", "kv_heads", "head_dim"))
    v_BTKH = constrain(v_BTKH, ("batch", "seq", "kv_heads", "head_dim"))
    if kv is None:
        out_BTNH = attention_of(config)(q_BTNH, k_BTKH, v_BTKH, context.mask)
    else:
        kv = kv.write(k_BTKH, v_BTKH, context)
        out_BTNH = kv.attend(config, q_BTNH, context)
    return linear("BTNH,NHD->BTD", out_BTNH, p["wo"], p.get("bo")), kv


def attention_of(config: ModelConfig):
    """`dot_product_attention` under the configured implementation, blocks and softmax scale
    (1/√H, times YaRN's mscale²: rope.softmax_scale)."""
    return functools.partial(dot_product_attention, impl=config.attention_impl,
                             block_q=config.attention_block_q,
                             block_kv=config.attention_block_kv, scale=softmax_scale(config))


# ------------------------------------------------------------------------------- the KV cache

@struct.dataclass
class StackedKV:
    """A layer group's cache `[L, B, K, S, H]`, read and written at `context.layer`."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, config: ModelConfig, n_layers: int, batch: int, max_len: int,
              dtype: str) -> "StackedKV":
        k, v = (_constrain_stacked(jnp.zeros((n_layers, batch, config.K, max_len, config.H),
                                             dtype)) for _ in range(2))
        return cls(k=k, v=v)

    def write(self, k_BTKH: jax.Array, v_BTKH: jax.Array, context: Context) -> "StackedKV":
        """Writes new keys and values at slot `context.end` of the layer, in place."""
        def put(cache_LBKSH, x_BTKH):
            update = jnp.swapaxes(x_BTKH, 1, 2)[None].astype(cache_LBKSH.dtype)  # [1,B,K,T,H]
            cache_LBKSH = jax.lax.dynamic_update_slice(cache_LBKSH, update,
                                                       (context.layer, 0, 0, context.end, 0))
            return _constrain_stacked(cache_LBKSH)
        return self.replace(k=put(self.k, k_BTKH), v=put(self.v, v_BTKH))

    def attend(self, config: ModelConfig, q_BTNH: jax.Array, context: Context) -> jax.Array:
        """The queries against the layer's cache, under the configured implementation."""
        layer = context.layer
        return attention_of(config)(q_BTNH, self.k[layer].astype(q_BTNH.dtype),
                                    self.v[layer].astype(q_BTNH.dtype), context.mask,
                                    kv_layout="BKSH")


@struct.dataclass
class MergedKV:
    """One layer's cache `[B, K·S, H]`: head k's slots are rows k·S .. k·S + S - 1."""

    k: jax.Array
    v: jax.Array
    max_len: int = struct.field(pytree_node=False)  # S
    dtype: str = struct.field(pytree_node=False)  # of the cached values

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int, dtype: str) -> "MergedKV":
        stored = stored_type(jnp.dtype(dtype))
        k, v = (_constrain_merged(jnp.zeros((batch, config.K * max_len, config.H), stored))
                for _ in range(2))
        return cls(k=k, v=v, max_len=max_len, dtype=jnp.dtype(dtype).name)

    def write(self, k_BTKH: jax.Array, v_BTKH: jax.Array, context: Context) -> "MergedKV":
        def put(cache_BCH, x_BTKH):
            for head in range(x_BTKH.shape[2]):
                update = store(x_BTKH[:, :, head], self.dtype)
                cache_BCH = jax.lax.dynamic_update_slice(
                    cache_BCH, update, (0, head * self.max_len + context.end, 0))
            return _constrain_merged(cache_BCH)
        return self.replace(k=put(self.k, k_BTKH), v=put(self.v, v_BTKH))

    def attend(self, config: ModelConfig, q_BTNH: jax.Array, context: Context) -> jax.Array:
        """A decode step by `decode_attention_block_diagonal`; longer inputs under the
        configured implementation."""
        k_BCH, v_BCH = (load(x, self.dtype, q_BTNH.dtype) for x in (self.k, self.v))
        B, T, _, H = q_BTNH.shape
        if T == 1:
            return decode_attention_block_diagonal(q_BTNH, k_BCH, v_BCH,
                                                   context.mask.dense()[:, 0],
                                                   softmax_scale(config))
        K, S = k_BCH.shape[1] // self.max_len, self.max_len
        return attention_of(config)(q_BTNH, k_BCH.reshape(B, K, S, H),
                                    v_BCH.reshape(B, K, S, H), context.mask, kv_layout="BKSH")


def kv_cache_elements(config: ModelConfig) -> int:
    """2·K·H: what one token caches per layer, keys and values of the KV heads only."""
    return 2 * config.K * config.H


def kv_cache_split(config: ModelConfig) -> tuple[str, int]:
    """The cache dimension the cache rules may split besides the rows: the KV heads."""
    return "kv_heads", config.K


# On a mesh (`sharding.use_mesh`) caches are laid out by the cache rules, when created and
# after every write (else XLA's propagation picks a layout from the weights). The merged layout
# puts heads with slots, so only its rows can be split.
def _constrain_stacked(cache_LBKSH: jax.Array) -> jax.Array:
    return constrain(cache_LBKSH, (None, "batch", "kv_heads", "seq", "head_dim"), "cache_rules")


def _constrain_merged(cache_BCH: jax.Array) -> jax.Array:
    return constrain(cache_BCH, ("batch", None, "head_dim"), "cache_rules")


def stored_type(dtype: jnp.dtype) -> jnp.dtype:
    """How a per-layer cache stores `dtype`: 16-bit floats as their uint16 bits. XLA:CPU upcasts
    a bf16 `dynamic_update_slice` to fp32 (rewriting the whole cache at every write), and even
    a bitcast view of a bf16 buffer made it copy the cache before each in-place update."""
    return jnp.dtype(jnp.uint16) if dtype.itemsize == 2 else dtype


def store(x: jax.Array, dtype: str) -> jax.Array:
    """Values for a per-layer cache of `dtype`, in its `stored_type`."""
    x = x.astype(dtype)
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x


def load(cache: jax.Array, dtype: str, compute_dtype) -> jax.Array:
    """A per-layer cache's values (of `dtype`) in `compute_dtype`. bf16 bits widen to fp32
    exactly by a shift."""
    if cache.dtype != jnp.uint16:
        return cache.astype(compute_dtype)
    if dtype == "bfloat16":
        widened = jax.lax.bitcast_convert_type(cache.astype(jnp.uint32) << 16, jnp.float32)
        return widened.astype(compute_dtype)
    return jax.lax.bitcast_convert_type(cache, dtype).astype(compute_dtype)


def saved_activations(config: ModelConfig, heads: int, kv_heads: int) -> dict[str, int]:
    """Elements per token the projections keep for the backward pass under each remat policy
    (`heads`, `kv_heads`: those a device holds): q and the attention output (N·H each), k and
    v (K·H each); dots_no_batch drops the attention output."""
    H, Hv = config.H, config.v_head_dim
    q_out_k_v = (heads + kv_heads) * (H + Hv)
    return {"none": q_out_k_v, "dots": q_out_k_v, "dots_no_batch": q_out_k_v - heads * Hv}


def check_config(config: ModelConfig) -> None:
    """Rotary positions rotate pairs of a head's features."""
    if POSITIONS[config.positions].rotary:
        require(config.head_dim % 2 == 0, "head_dim", config.head_dim,
                "must be even: RoPE rotates pairs of features")
