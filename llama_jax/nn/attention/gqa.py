"""The GQA mixer (`attention: gqa`): causal dot-product attention with one code path for MHA,
GQA and MQA, its parameters, and its KV cache.

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
- `StackedCache`: a layer group's `k, v: [L, B, K, S, H]`, carried through the layer scan and
  updated in place. Heads come before slots so the keys of one (row, head) are contiguous: the
  batched attention matmuls read the cache in place (measured on CPU: 2.7x faster than
  [L, B, S, K, H], which makes XLA transpose every layer's slice at every step).
- `LayerCache`: one layer's `[B, K·S, H]` (the same bytes as [B, K, S, H] with K and S
  merged), for the unrolled decoder over per-layer weights: no per-layer slice is copied, and a
  decode step attends with one matmul per row (dot_product.py's
  `decode_attention_block_diagonal`). In a program for a CPU 16-bit values are stored as their
  uint16 bits (kv_storage.py).
Either holds float values or int8 ones with a scale per (token, head) (kv_storage.py).
A decoder's rows end where each has got to (`context.end` is `[B]`): a step writes each row
at its own end, every vector in one scatter (kv_storage.write_rows); a cache whose rows share
one end (a prompt's own cache) is written by a single `dynamic_update_slice`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

from llama_jax.nn.attention import kv_storage, paged_kernel
from llama_jax.nn.attention.context import (MIXERS, Context, Mixer, attention_of,
                                           causal_attention_flops)
from llama_jax.nn.attention.dot_product import (DECODE_QUERIES, decode_attention_block_diagonal,
                                                dense_attention)
from llama_jax.nn.ops import linear
from llama_jax.errors import require
from llama_jax.nn.positions import POSITIONS
from llama_jax.nn.rope import softmax_scale
from llama_jax.quant import Int8, as_float
from llama_jax.spec import bias, weight
from llama_jax.parallel import target
from llama_jax.parallel.sharding import constrain

if TYPE_CHECKING:
    from llama_jax.config import ModelConfig


# ------------------------------------------------------------------------------- the mixer

def specs(config: ModelConfig, residual_scale: float) -> dict:
    """`residual_scale` shrinks the init of W_O, which writes into the residual stream."""
    dims = config.dims
    tensors = {"wq": weight(dims, "DNH", ("embed", "q_heads", "head_dim"), contract="D"),
               "wk": weight(dims, "DKH", ("embed", "kv_heads", "head_dim"), contract="D"),
               "wv": weight(dims, "DKH", ("embed", "kv_heads", "head_dim"), contract="D"),
               "wo": weight(dims, "NHD", ("q_heads", "head_dim", "embed"), residual_scale,
                            contract="NH")}
    if config.bias:
        tensors.update(bq=bias(dims, "NH", ("q_heads", "head_dim")),
                       bk=bias(dims, "KH", ("kv_heads", "head_dim")),
                       bv=bias(dims, "KH", ("kv_heads", "head_dim")),
                       bo=bias(dims, "D", ("norm",)))
    return tensors


def apply(config: ModelConfig, p: dict, x_BTD: jax.Array, context: Context,
          kv: "StackedCache | LayerCache | None" = None):
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


# ------------------------------------------------------------------------------- the KV cache

@struct.dataclass
class StackedCache:
    """A layer group's cache `[L, B, K, S, H]`, read and written at `context.layer`."""

    k: jax.Array | Int8
    v: jax.Array | Int8
    dtype: str = struct.field(pytree_node=False)  # of the cached values

    @classmethod
    def zeros(cls, config: ModelConfig, n_layers: int, batch: int, max_len: int,
              dtype: str) -> "StackedCache":
        k, v = (_constrain_stacked(kv_storage.zeros(
            (n_layers, batch, config.K, max_len, config.H), dtype)) for _ in range(2))
        return cls(k=k, v=v, dtype=dtype)

    def write(self, k_BTKH: jax.Array, v_BTKH: jax.Array, context: Context) -> "StackedCache":
        """Writes new keys and values at slot `context.end` of the layer, in place."""
        def put(cache_LBKSH, x_BTKH):
            update = jnp.swapaxes(x_BTKH, 1, 2)[None]  # [1, B, K, T, H]
            return _constrain_stacked(kv_storage.write(
                cache_LBKSH, update, (context.layer, 0, 0, context.end, 0), self.dtype,
                row_axis=1, pages_BN=context.pages))
        return self.replace(k=put(self.k, k_BTKH), v=put(self.v, v_BTKH))

    def attend(self, config: ModelConfig, q_BTNH: jax.Array, context: Context) -> jax.Array:
        """The queries against the layer's cache, under the configured implementation."""
        k, v = (x[context.layer] for x in (self.k, self.v))
        if context.pages is not None:  # the layer's pool [P, K, page, H]: the rows' pages
            k, v = (kv_storage.gather_pages(x, context.pages, 0, 2) for x in (k, v))
        k, v = (kv_storage.read(x, self.dtype, q_BTNH.dtype) for x in (k, v))
        return attention_of(config)(q_BTNH, k, v, context.mask, kv_layout="BKSH")



@struct.dataclass
class LayerCache:
    """One layer's cache `[B, K·S, H]`: head k's slots are rows k·S .. k·S + S - 1."""

    k: jax.Array | Int8
    v: jax.Array | Int8
    max_len: int = struct.field(pytree_node=False)  # S
    dtype: str = struct.field(pytree_node=False)  # of the cached values

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int, dtype: str) -> "LayerCache":
        k, v = (_constrain_merged(kv_storage.zeros((batch, config.K * max_len, config.H), dtype,
                                                   bits=True), max_len) for _ in range(2))
        return cls(k=k, v=v, max_len=max_len, dtype=dtype)

    def write(self, k_BTKH: jax.Array, v_BTKH: jax.Array, context: Context) -> "LayerCache":
        if jnp.ndim(context.end) == 1:
            put = functools.partial(_write_rows_merged, pages_BN=context.pages)
        else:
            put = _write_by_head if target.platform() == "cpu" else _write_heads_view
        return self.replace(k=put(self.k, k_BTKH, self.max_len, context.end, self.dtype),
                            v=put(self.v, v_BTKH, self.max_len, context.end, self.dtype))

    def attend(self, config: ModelConfig, q_BTNH: jax.Array, context: Context) -> jax.Array:
        """A decode step or verify pass (up to `DECODE_QUERIES` queries) by
        `decode_attention_block_diagonal`, or in the grouped form where `grouped_decode`
        says (GPUs, long caches); longer inputs under the configured implementation. From a
        pool of pages, the rows' pages gathered, or read in place by Pallas's TPU kernel
        where it applies (paged_kernel.py)."""
        if context.pages is not None:
            _, T, _, H = q_BTNH.shape
            if paged_kernel.applies(T, self.dtype, H):
                return paged_kernel.paged_decode_attention(
                    q_BTNH, self.k, self.v, context.end + 1, context.pages, self.max_len,
                    softmax_scale(config))
            return self.gathered(context.pages).attend(config, q_BTNH,
                                                       context.replace(pages=None))
        k_BCH, v_BCH = (kv_storage.read(x, self.dtype, q_BTNH.dtype) for x in (self.k, self.v))
        B, T = q_BTNH.shape[:2]
        if T <= DECODE_QUERIES:
            if not grouped_decode(B, self.max_len):
                return decode_attention_block_diagonal(q_BTNH, k_BCH, v_BCH,
                                                       context.mask.dense(),
                                                       softmax_scale(config))
            k_BKSH, v_BKSH = (kv_storage.map_stored(x, lambda a: _heads(a, self.max_len))
                              for x in (k_BCH, v_BCH))  # int8 ones as they are
            return dense_attention(q_BTNH, k_BKSH, v_BKSH, context.mask.dense(),
                                   kv_layout="BKSH", scale=softmax_scale(config))
        k_BKSH, v_BKSH = (_heads(as_float(x, q_BTNH.dtype), self.max_len)
                          for x in (k_BCH, v_BCH))
        return attention_of(config)(q_BTNH, k_BKSH, v_BKSH, context.mask, kv_layout="BKSH")

    def gathered(self, pages_BN: jax.Array) -> "LayerCache":
        """The rows' caches `[B, K·N·page, H]` read from this pool of pages `[P, K·page, H]`
        (`max_len` the page's positions) by their tables `pages_BN`."""
        def gather(cache_PCH):
            return kv_storage.map_stored(cache_PCH, lambda a: _merged(
                kv_storage.gather_pages(_heads(a, self.max_len), pages_BN, 0, 2)))
        return self.replace(k=gather(self.k), v=gather(self.v),
                            max_len=pages_BN.shape[1] * self.max_len)



# Rows x slots from which a GPU's decode step attends over a per-layer cache in the grouped
# form (`grouped_decode`).
GROUPED_DECODE_ROW_SLOTS = 8192


def grouped_decode(batch: int, slots: int) -> bool:
    """Whether a decode step of `batch` rows attends over their per-layer caches of `slots`
    slots in the grouped form (`dense_attention`: each KV head's G = N/K queries against its
    S keys) instead of block-diagonally (all N queries against all K·S keys, other groups
    masked). On GPUs, from B·S = 8,192 on. At 8 rows x 8,192 slots XLA:GPU prices the
    block-diagonal form's K-times wider scores at 2.1x the grouped attention (200.8 against
    96.4 µs a layer, LLaMA-3 8B's heads), and the step of two such layers at 1.35x its HBM
    floor against 1.06x (1.58x against 1.10x with a small vocabulary). Below, the
    block-diagonal form launches 1–2 kernels a layer fewer at about the same price.
    Elsewhere it is block-diagonal: XLA:CPU runs it 2.2x faster
    (`decode_attention_block_diagonal`), and XLA:TPU's clock (v5e, the same layers) has the
    grouped form faster at 8 x 8,192 (1.19 against 1.32 ms a layer) but slower at 8 x 2,048
    and 1 x 8,192 (0.77 against 0.65, 0.68 against 0.53 ms)."""
    return target.platform() == "gpu" and batch * slots >= GROUPED_DECODE_ROW_SLOTS


def cache_vectors(config: ModelConfig) -> tuple[int, int]:
    """What one token caches per layer: 2·K vectors of H values (keys and values of the KV
    heads only)."""
    return 2 * config.K, config.H


def cache_split(config: ModelConfig) -> tuple[str, int]:
    """The cache dimension the cache rules may split besides the rows: the KV heads."""
    return "kv_heads", config.K


# On a mesh (`sharding.use_mesh`) caches are laid out by the cache rules, when created and
# after every write (else XLA's propagation picks a layout from the weights).
def _constrain_stacked(cache_LBKSH: jax.Array | Int8) -> jax.Array | Int8:
    return kv_storage.constrained(cache_LBKSH, (None, "batch", "kv_heads", "seq", "head_dim"))


def _constrain_merged(cache_BCH: jax.Array | Int8, max_len: int) -> jax.Array | Int8:
    """The merged layout holds head k's slots in rows k·S .. k·S + S - 1, so it is laid out as
    its [B, K, S, H] view: a split of the KV heads is a split of its merged axis into whole
    heads' blocks, as the stacked cache's (and the planner's) is."""
    view_BKSX = kv_storage.map_stored(cache_BCH, lambda a: _heads(a, max_len))
    view_BKSX = kv_storage.constrained(view_BKSX, ("batch", "kv_heads", "seq", "head_dim"))
    return kv_storage.map_stored(view_BKSX, _merged)


# Two ways to write a step's keys (or values) into a merged layer cache, each where it updates
# the cache in place: XLA:CPU copies the whole cache for an update of its [B, K, S, H] view
# (measured 1.2x the batch-8 bf16 step), and an accelerator's step, written head by head,
# ran one kernel per KV head and array.
def _write_by_head(cache_BCH, x_BTKH, max_len: int, end, dtype: str):
    for head in range(x_BTKH.shape[2]):
        cache_BCH = kv_storage.write(cache_BCH, x_BTKH[:, :, head], (0, head * max_len + end, 0),
                                     dtype)
    return _constrain_merged(cache_BCH, max_len)


def _write_heads_view(cache_BCH, x_BTKH, max_len: int, end, dtype: str):
    view_BKSX = kv_storage.map_stored(cache_BCH, lambda a: _heads(a, max_len))
    view_BKSX = kv_storage.write(view_BKSX, jnp.swapaxes(x_BTKH, 1, 2), (0, 0, end, 0), dtype)
    return _constrain_merged(kv_storage.map_stored(view_BKSX, _merged), max_len)


def _write_rows_merged(cache_BCH, x_BTKH, max_len: int, end_B, dtype: str,
                       pages_BN: jax.Array | None = None):
    """Each row's keys (or values) at its own end, every head's in one scatter into the
    merged layout: head k's position t of row b is k·S + t of its row, or with `pages_BN`
    k·page + t % page of its page (`kv_storage.page_index`; `max_len` is then the page's
    positions). A position past the row's cache goes to a row past it, to be dropped."""
    B, T, K, H = x_BTKH.shape
    if pages_BN is None:
        pages_BN = jnp.arange(B)[:, None]
    pages_BT, offsets_BT = kv_storage.page_index(end_B, T, pages_BN, max_len,
                                                 kv_storage.stored_shape(cache_BCH)[0])
    positions_BKT = jnp.arange(K)[None, :, None] * max_len + offsets_BT[:, None, :]
    rows_BKT = jnp.broadcast_to(pages_BT[:, None, :], positions_BKT.shape)
    x_BCH = jnp.swapaxes(x_BTKH, 1, 2).reshape(B, K * T, H)
    cache_BCH = kv_storage.write_rows(cache_BCH, x_BCH, rows_BKT.reshape(B, K * T),
                                      positions_BKT.reshape(B, K * T), (0, 0, 0), dtype,
                                      row_axis=0, seq_axis=1)
    return _constrain_merged(cache_BCH, max_len)


def _heads(a_BCX: jax.Array, max_len: int) -> jax.Array:
    """A merged layer cache array `[B, C = K·S, X]` seen as `[B, K, S, X]` (the same buffer)."""
    B, C, *rest = a_BCX.shape
    return a_BCX.reshape(B, C // max_len, max_len, *rest)


def _merged(a_BKSX: jax.Array) -> jax.Array:
    """`[B, K, S, X]` back to the merged `[B, K·S, X]`."""
    B, _, _, *rest = a_BKSX.shape
    return a_BKSX.reshape(B, -1, *rest)


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


MIXERS.register("gqa", Mixer(specs, apply, StackedCache.zeros, LayerCache.zeros, cache_split,
                             cache_vectors, saved_activations, check_config,
                             causal_attention_flops))
