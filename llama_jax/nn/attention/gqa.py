"""The attention mixer: causal dot-product attention with one code path for MHA, GQA and MQA,
its parameters, and its KV cache; and what every attention mixer (mla.py too) shares: the
`Context` of a forward pass and `attention_of` (the configured implementation and softmax
scale).

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
  stored as their uint16 bits (kv_storage.py).
Either holds float values or int8 ones with a scale per (token, head) (kv_storage.py).
Rows of a ragged batch are left-padded; every step writes all rows at the same slot `end`, so
an update is a single `dynamic_update_slice`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

from llama_jax.nn.attention import kv_storage
from llama_jax.nn.attention.kv_storage import SlotFn
from llama_jax.nn.attention.chunked import MASKED
from llama_jax.nn.attention.dot_product import Mask, dot_product_attention, probs_like
from llama_jax.nn.ops import einsum_f32, linear
from llama_jax.errors import require
from llama_jax.nn.positions import POSITIONS, Rotation
from llama_jax.nn.rope import softmax_scale
from llama_jax.quant import Int8, as_float
from llama_jax.spec import bias, weight
from llama_jax.parallel.sharding import constrain

if TYPE_CHECKING:
    from llama_jax.config import ModelConfig


def decode_attention_block_diagonal(q_B1NH: jax.Array, k_BCH: jax.Array | Int8,
                                    v_BCH: jax.Array | Int8, mask_BS: jax.Array,
                                    scale: float) -> jax.Array:
    """Attention of one query per row over a per-layer cache `[B, C = K·S, H]` (float, or
    int8 with scales `[B, C, 1]`).

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
    out_BNH = einsum_f32("BNC,BCH->BNH", probs_like(probs_BNC, v_BCH), v_BCH)
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

    k: jax.Array | Int8
    v: jax.Array | Int8
    dtype: str = struct.field(pytree_node=False)  # of the cached values

    @classmethod
    def zeros(cls, config: ModelConfig, n_layers: int, batch: int, max_len: int,
              dtype: str) -> "StackedKV":
        k, v = (_constrain_stacked(kv_storage.zeros(
            (n_layers, batch, config.K, max_len, config.H), dtype)) for _ in range(2))
        return cls(k=k, v=v, dtype=dtype)

    def write(self, k_BTKH: jax.Array, v_BTKH: jax.Array, context: Context) -> "StackedKV":
        """Writes new keys and values at slot `context.end` of the layer, in place."""
        def put(cache_LBKSH, x_BTKH):
            update = jnp.swapaxes(x_BTKH, 1, 2)[None]  # [1, B, K, T, H]
            return _constrain_stacked(kv_storage.write(
                cache_LBKSH, update, (context.layer, 0, 0, context.end, 0), self.dtype))
        return self.replace(k=put(self.k, k_BTKH), v=put(self.v, v_BTKH))

    def attend(self, config: ModelConfig, q_BTNH: jax.Array, context: Context) -> jax.Array:
        """The queries against the layer's cache, under the configured implementation."""
        k, v = (kv_storage.read(x[context.layer], self.dtype, q_BTNH.dtype)
                for x in (self.k, self.v))
        return attention_of(config)(q_BTNH, k, v, context.mask, kv_layout="BKSH")

    def map_seq(self, fn: SlotFn, max_len: int) -> "StackedKV":
        """The cache with `fn(array, seq_axis)` applied to its stored arrays; `fn` returns
        `max_len` slots (see `KVCache.map_seq`)."""
        def put(cache_LBKSH):
            return _constrain_stacked(kv_storage.map_stored(cache_LBKSH, lambda a: fn(a, 3)))
        return self.replace(k=put(self.k), v=put(self.v))


@struct.dataclass
class MergedKV:
    """One layer's cache `[B, K·S, H]`: head k's slots are rows k·S .. k·S + S - 1."""

    k: jax.Array | Int8
    v: jax.Array | Int8
    max_len: int = struct.field(pytree_node=False)  # S
    dtype: str = struct.field(pytree_node=False)  # of the cached values

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int, dtype: str) -> "MergedKV":
        k, v = (_constrain_merged(kv_storage.zeros((batch, config.K * max_len, config.H), dtype,
                                                   bits=True)) for _ in range(2))
        return cls(k=k, v=v, max_len=max_len, dtype=dtype)

    def write(self, k_BTKH: jax.Array, v_BTKH: jax.Array, context: Context) -> "MergedKV":
        def put(cache_BCH, x_BTKH):
            for head in range(x_BTKH.shape[2]):
                cache_BCH = kv_storage.write(cache_BCH, x_BTKH[:, :, head],
                                             (0, head * self.max_len + context.end, 0),
                                             self.dtype)
            return _constrain_merged(cache_BCH)
        return self.replace(k=put(self.k, k_BTKH), v=put(self.v, v_BTKH))

    def attend(self, config: ModelConfig, q_BTNH: jax.Array, context: Context) -> jax.Array:
        """A decode step by `decode_attention_block_diagonal`; longer inputs under the
        configured implementation."""
        k_BCH, v_BCH = (kv_storage.read(x, self.dtype, q_BTNH.dtype) for x in (self.k, self.v))
        B, T, _, H = q_BTNH.shape
        if T == 1:
            return decode_attention_block_diagonal(q_BTNH, k_BCH, v_BCH,
                                                   context.mask.dense()[:, 0],
                                                   softmax_scale(config))
        K, S = k_BCH.shape[1] // self.max_len, self.max_len
        k_BKSH, v_BKSH = (as_float(x, q_BTNH.dtype).reshape(B, K, S, H)
                          for x in (k_BCH, v_BCH))
        return attention_of(config)(q_BTNH, k_BKSH, v_BKSH, context.mask, kv_layout="BKSH")

    def map_seq(self, fn: SlotFn, max_len: int) -> "MergedKV":
        """The cache with `fn(array, seq_axis)` applied to its stored arrays seen as
        `[B, K, S, ...]`; `fn` returns `max_len` slots (see `KVCache.map_seq`)."""
        def per_head(a_BCX):
            B, C, *rest = a_BCX.shape
            a_BKSX = fn(a_BCX.reshape(B, C // self.max_len, self.max_len, *rest), 2)
            return a_BKSX.reshape(B, -1, *rest)
        def put(cache_BCH):
            return _constrain_merged(kv_storage.map_stored(cache_BCH, per_head))
        return self.replace(k=put(self.k), v=put(self.v), max_len=max_len)


def kv_cache_vectors(config: ModelConfig) -> tuple[int, int]:
    """What one token caches per layer: 2·K vectors of H values (keys and values of the KV
    heads only)."""
    return 2 * config.K, config.H


def kv_cache_split(config: ModelConfig) -> tuple[str, int]:
    """The cache dimension the cache rules may split besides the rows: the KV heads."""
    return "kv_heads", config.K


# On a mesh (`sharding.use_mesh`) caches are laid out by the cache rules, when created and
# after every write (else XLA's propagation picks a layout from the weights). The merged layout
# puts heads with slots, so only its rows can be split.
def _constrain_stacked(cache_LBKSH: jax.Array | Int8) -> jax.Array | Int8:
    return kv_storage.constrained(cache_LBKSH, (None, "batch", "kv_heads", "seq", "head_dim"))


def _constrain_merged(cache_BCH: jax.Array | Int8) -> jax.Array | Int8:
    return kv_storage.constrained(cache_BCH, ("batch", None, "head_dim"))


def saved_activations(config: ModelConfig, heads: int, kv_heads: int) -> dict[str, int]:
    """Elements per token the projections keep for the backward pass under each remat policy
    (`heads`, `kv_heads`: those a device holds): q and the attention output (N·H each), k and
    v (K·H each); dots_no_batch drops the attention output."""
    H, Hv = config.H, config.v_head_dim
    q_out_k_v = (heads + kv_heads) * (H + Hv)
    return {"none": q_out_k_v, "dots": q_out_k_v, "dots_no_batch": q_out_k_v - heads * Hv,
            "attention": q_out_k_v, "dots_with_attention": q_out_k_v}


def check_config(config: ModelConfig) -> None:
    """Rotary positions rotate pairs of a head's features."""
    if POSITIONS[config.positions].rotary:
        require(config.head_dim % 2 == 0, "head_dim", config.head_dim,
                "must be even: RoPE rotates pairs of features")
