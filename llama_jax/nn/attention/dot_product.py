"""Scaled dot-product attention, softmax(q·kᵀ·scale + mask)·v, under a choice of implementation
(`ModelConfig.attention_impl`, an execution setting: all compute the same function).

- `xla`: the dense computation. It materialises fp32 scores `[B, K, G, T, S]` and the mask
  `[B, T, S]`: memory quadratic in the sequence length.
- `chunked`: blockwise with an online softmax and a custom backward pass (chunked.py), pure JAX,
  memory linear in the sequence length on every backend. When one block covers all queries and
  keys it is the dense computation, and runs as such.
- `cudnn`: cuDNN's fused flash attention through `jax.nn.dot_product_attention` (NVIDIA GPUs,
  bf16/fp16). Packed documents go to it as a `[B, 1, T, S]` mask (its public JAX interface has
  no segment ids), which cuDNN applies as a bias: quadratic, though 2 bytes per query/key pair
  instead of the dense path's 8·N (fp32 scores and probabilities of N heads).
- `splash`: the Pallas TPU splash-attention kernel of `jax.experimental` (block-sparse causal
  mask, segment ids), run per shard under `sharding.per_shard` on a mesh.
- `auto`: cudnn on GPUs where it applies (bf16/fp16, head dims ≤ 128 and multiples of 8),
  splash on TPUs, chunked otherwise (`resolve_attention_impl`).

The mask is described, not materialised (`Mask`): query t sees key s iff `kv_index[s] <=
q_index[t]` and, with segment ids, both are in the same segment. The fused kernels' built-in
causal masks hold only when queries and keys are the same tokens at slots 0..T−1 (`aligned`:
training and uncached forwards); prefill into a KV cache (queries at slots `end..`, a traced
offset) runs `chunked` under them. A decode step's query, and the few queries of a speculative
verify pass against a cache (up to `DECODE_QUERIES`), always run dense: their scores
`[B, K, G, T, S]` are linear in S already, and blocks would only pad them.

Besides these, `decode_attention_block_diagonal` is the decode step (or verify pass) over a
cache whose heads and slots are merged into one axis (the unrolled decoder's GQA layout,
gqa.py): chosen by that layout, not by `attention_impl`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct
from jax.ad_checkpoint import checkpoint_name

from llama_jax.dtypes import dtype_name
from llama_jax.errors import ConfigError
from llama_jax.nn.attention.chunked import (LSE_NAME, MASKED, OUTPUT_NAME, chunked_attention,
                                            visible)
from llama_jax.nn.ops import einsum_f32
from llama_jax.parallel import target
from llama_jax.parallel.sharding import activation_ways, per_shard
from llama_jax.quant import Int8, as_float, is_int8

if TYPE_CHECKING:
    from llama_jax.config import ModelConfig

# The implementations of the same function (`attention_impl`, an execution setting).
ATTENTION_IMPLS = ("auto", "xla", "chunked", "cudnn", "splash")

# Up to this many queries against a KV cache (a decode step: 1; a speculative verify pass:
# k + 1) attend densely, as a decode step does.
DECODE_QUERIES = 16
_CUDNN_DTYPES = ("bfloat16", "float16")
_SPLASH_LANES = 128  # splash's blocks are whole multiples of the TPU's 128 lanes


@struct.dataclass
class Mask:
    """Which keys each query may see, as the indices it is computed from: causal by slot index
    (`kv_index <= q_index`) and, with segment ids, within a segment. `aligned` (static) says the
    queries and keys are the same T tokens at slots 0..T−1."""

    q_index_BT: jax.Array
    kv_index_BS: jax.Array
    q_segment_BT: jax.Array | None = None
    kv_segment_BS: jax.Array | None = None
    aligned: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def causal(cls, B: int, T: int, segment_ids_BT: jax.Array | None = None) -> "Mask":
        """T tokens attending to themselves (packed documents kept apart by `segment_ids_BT`)."""
        index_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return cls(index_BT, index_BT, segment_ids_BT, segment_ids_BT, aligned=True)

    def dense(self) -> jax.Array:
        """The `[B, T, S]` bool mask."""
        return visible(self.q_index_BT, self.kv_index_BS, self.q_segment_BT, self.kv_segment_BS)


def one_block(T: int, S: int, block_q: int, block_kv: int) -> bool:
    """Whether one block covers all T queries and S keys, where `chunked` is the dense
    computation and runs as such."""
    return T <= block_q and S <= block_kv


def resolve_attention_impl(impl: str, backend: str | None = None,
                           compute_dtype: str = "float32", head_dim: int = 128,
                           block_q: int = 512, block_kv: int = 512,
                           v_head_dim: int | None = None) -> str:
    """The implementation `impl` stands for on `backend` (default: the platform being compiled
    for, `parallel.target.platform()`): "auto" picks, and an explicit choice the backend or the
    settings cannot run is a `ConfigError`. `v_head_dim` (default: head_dim) is the values'
    head dim, which `jax.nn.dot_product_attention` (cuDNN) needs equal to the keys'."""
    backend = backend or target.platform()
    dtype = dtype_name(compute_dtype, "compute_dtype")
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    cudnn_ok = (dtype in _CUDNN_DTYPES and head_dim <= 128 and head_dim % 8 == 0
                and v_head_dim == head_dim)
    if impl not in ATTENTION_IMPLS:
        raise ConfigError(f"attention_impl={impl!r} is not one of {', '.join(ATTENTION_IMPLS)}")
    if impl == "auto":
        if backend == "gpu" and cudnn_ok:
            return "cudnn"
        return "splash" if backend == "tpu" else "chunked"
    if impl == "cudnn":
        if backend != "gpu":
            raise ConfigError(f"attention_impl='cudnn' needs an NVIDIA GPU; the backend "
                              f"is {backend!r}; use auto, chunked or xla")
        if not cudnn_ok:
            raise ConfigError(f"attention_impl='cudnn' needs compute_dtype bfloat16 or float16 "
                              f"and a head dim <= 128 divisible by 8, the same for values "
                              f"(compute_dtype={dtype}, head_dim={head_dim}, value head dim "
                              f"{v_head_dim}); use auto or chunked")
    if impl == "splash":
        if backend != "tpu":
            raise ConfigError(f"attention_impl='splash' needs a TPU; the backend is "
                              f"{backend!r}; use auto, chunked or xla")
        _splash_blocks_ok(block_q, block_kv)
    return impl


def chosen_attention(config: ModelConfig, backend: str | None = None) -> str:
    """The implementation `config` runs attention with on `backend` (a `ConfigError` if it
    cannot): what a run checks before compiling."""
    return resolve_attention_impl(config.attention_impl, backend, config.compute_dtype, config.H,
                                  config.attention_block_q, config.attention_block_kv,
                                  config.v_head_dim)


def describe_attention(config: ModelConfig, seq_len: int, backend: str | None = None) -> str:
    """One line for a run's log: the implementation, why, and its blocks at `seq_len`."""
    backend = backend or target.platform()
    impl = chosen_attention(config, backend)
    why = f"auto on {backend}" if config.attention_impl == "auto" else "attention_impl"
    blocks = ""
    if impl in ("chunked", "splash"):
        blocks = (f"; blocks of {config.attention_block_q} queries x "
                  f"{config.attention_block_kv} keys")
        if impl == "chunked" and one_block(seq_len, seq_len, config.attention_block_q,
                                           config.attention_block_kv):
            blocks += f", so one block at seq_len {seq_len}: computed densely"
    return f"attention: {impl} ({why}{blocks})"


def _splash_blocks_ok(block_q: int, block_kv: int) -> None:
    for name, size in (("attention_block_q", block_q), ("attention_block_kv", block_kv)):
        if size % _SPLASH_LANES:
            raise ConfigError(f"{name}={size}: splash attention needs blocks that are "
                              f"multiples of {_SPLASH_LANES}")


# Remat names: attention's inputs and output, and the blockwise paths' log-sum-exp
INPUT_NAMES = ("query", "key", "value")
ATTENTION_NAMES = (*INPUT_NAMES, OUTPUT_NAME, LSE_NAME)


def dot_product_attention(q_BTNH: jax.Array, k: jax.Array | Int8, v: jax.Array | Int8,
                          mask: Mask, *, impl: str = "xla", kv_layout: str = "BSKH",
                          scale: float | None = None, block_q: int = 512,
                          block_kv: int = 512) -> jax.Array:
    """Grouped-head attention `[B, T, N, Hv]` in q's dtype. `kv_layout` names the axes of k and
    v: "BSKH" (fresh projections) or "BKSH" (the KV cache, heads leading). `scale` defaults to
    1/√H of the queries' head dim. int8 keys and values (an int8 KV cache, one scale per
    vector) are read as they are by the dense computation and dequantized for the others.

    q, k, v and the output carry remat names (`ATTENTION_NAMES`)."""
    q_BTNH, k, v = (checkpoint_name(x, name) for x, name in zip((q_BTNH, k, v), INPUT_NAMES))
    with jax.named_scope("attention"):  # profiles (bench/profile_step.py) group by it
        out_BTNH = _attention(q_BTNH, k, v, mask, impl=impl, kv_layout=kv_layout, scale=scale,
                              block_q=block_q, block_kv=block_kv)
    return checkpoint_name(out_BTNH, OUTPUT_NAME)


def _attention(q_BTNH: jax.Array, k: jax.Array | Int8, v: jax.Array | Int8, mask: Mask, *,
               impl: str, kv_layout: str, scale: float | None, block_q: int,
               block_kv: int) -> jax.Array:
    B, T, N, H = q_BTNH.shape
    scale = H ** -0.5 if scale is None else scale
    impl = resolve_attention_impl(impl, compute_dtype=q_BTNH.dtype, head_dim=H,
                                  v_head_dim=v.shape[-1],
                                  block_q=block_q, block_kv=block_kv)
    S = k.shape[kv_layout.index("S")]
    if (T == 1 or impl == "xla" or (impl == "chunked" and one_block(T, S, block_q, block_kv))
            or (T <= DECODE_QUERIES and not mask.aligned)):
        return dense_attention(q_BTNH, k, v, mask.dense(), kv_layout=kv_layout, scale=scale)
    k, v = (as_float(x, q_BTNH.dtype) for x in (k, v))
    if kv_layout == "BKSH":
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    if impl == "cudnn" and mask.aligned:
        return cudnn_attention(q_BTNH, k, v, mask, scale=scale)
    if impl == "splash" and mask.aligned:
        return splash_attention(q_BTNH, k, v, mask, scale=scale, block_q=block_q,
                                block_kv=block_kv)
    return chunked_attention(q_BTNH, k, v, mask.q_index_BT, mask.kv_index_BS, mask.q_segment_BT,
                             mask.kv_segment_BS, scale=scale, block_q=block_q, block_kv=block_kv)


def dense_attention(q_BTNH: jax.Array, k: jax.Array | Int8, v: jax.Array | Int8,
                    mask_BTS: jax.Array, *, kv_layout: str = "BSKH",
                    scale: float | None = None) -> jax.Array:
    """The `xla` implementation: all fp32 scores at once, masked with a `[B, T, S]` bool mask.
    Queries are reshaped to (K, G = N/K) against the K key/value heads: K/V are never repeated.
    int8 K/V enter the matmuls as they are: the keys' scales multiply the scores, the values'
    the probabilities (`ops.einsum_f32`)."""
    B, T, N, H = q_BTNH.shape
    K = k.shape[kv_layout.index("K")]
    scale = H ** -0.5 if scale is None else scale
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    logits_BKGTS = einsum_f32(f"BTKGH,{kv_layout}->BKGTS", q_BTKGH, k) * scale
    logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, MASKED)
    probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1)
    out_BTKGH = einsum_f32(f"BKGTS,{kv_layout}->BTKGH", probs_like(probs_BKGTS, v), v)
    return out_BTKGH.reshape(B, T, N, v.shape[-1]).astype(q_BTNH.dtype)


def probs_like(probs: jax.Array, v: jax.Array | Int8) -> jax.Array:
    """Attention probabilities for the matmul with the values: in the values' float dtype;
    fp32 against int8 values (whose scales multiply them)."""
    return probs if is_int8(v) else probs.astype(v.dtype)


def decode_attention_block_diagonal(q_BTNH: jax.Array, k_BCH: jax.Array | Int8,
                                    v_BCH: jax.Array | Int8, mask_BTS: jax.Array,
                                    scale: float) -> jax.Array:
    """Attention of a few queries per row (a decode step's one, a verify pass's k + 1) over
    one layer's GQA cache merged to `[B, C = K·S, H]` (float, or int8 with scales
    `[B, C, 1]`): the unrolled decoder's step (gqa.LayerCache).

    Each row is one matmul of its T·N queries over all K·S keys, with query/key pairs of
    different groups masked out, so the result equals dense attention. That spends K times
    the score FLOPs of a decode step (small next to reading the cache), but XLA:CPU runs B
    matmuls of N rows far faster than the B·K matmuls of G = N/K rows of the grouped form
    (measured: 2.2x on the attention alone, 8.6 -> 6.1 ms for a batch-8 decode step of the
    benchmark model).
    """
    B, T, N, H = q_BTNH.shape
    C, S = k_BCH.shape[1], mask_BTS.shape[2]
    K = C // S
    logits_BTNC = einsum_f32("BTNH,BCH->BTNC", q_BTNH, k_BCH) * scale
    same_group_NC = (jnp.arange(N) // (N // K))[:, None] == (jnp.arange(C) // S)[None, :]
    mask_BTNC = same_group_NC[None, None] & jnp.tile(mask_BTS, (1, 1, K))[:, :, None, :]
    probs_BTNC = jax.nn.softmax(jnp.where(mask_BTNC, logits_BTNC, MASKED), axis=-1)
    out_BTNH = einsum_f32("BTNC,BCH->BTNH", probs_like(probs_BTNC, v_BCH), v_BCH)
    return out_BTNH.astype(q_BTNH.dtype)


def cudnn_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask: Mask, *,
                    scale: float, implementation: str = "cudnn") -> jax.Array:
    """cuDNN flash attention for aligned masks. `implementation="xla"` runs the same call
    through JAX's reference path (how CPU tests check the arguments we pass)."""
    segments_B1TS = None
    if mask.q_segment_BT is not None:
        segments_B1TS = (mask.q_segment_BT[:, :, None] == mask.kv_segment_BS[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH.astype(q_BTNH.dtype),
                                        v_BSKH.astype(q_BTNH.dtype), mask=segments_B1TS,
                                        scale=scale, is_causal=True,
                                        implementation=implementation)


def splash_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask: Mask, *,
                     scale: float, block_q: int, block_kv: int,
                     interpret: bool = False) -> jax.Array:
    """The splash kernel for aligned masks (causal, with segment ids). T is padded to whole
    blocks; padding keys get segment −1, which no token has. `interpret=True` runs the kernel
    in Pallas's interpreter (how CPU tests check it)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernels, splash_attention_mask as masks)

    _splash_blocks_ok(block_q, block_kv)
    B, T, N, H = q_BTNH.shape
    padded = -(-T // math.lcm(block_q, block_kv)) * math.lcm(block_q, block_kv)
    bq, bk = min(block_q, padded), min(block_kv, padded)
    segment_BT = (jnp.zeros((B, T), jnp.int32) if mask.q_segment_BT is None
                  else mask.q_segment_BT.astype(jnp.int32))
    segment_BT = jnp.pad(segment_BT, ((0, 0), (0, padded - T)), constant_values=-1)

    def heads_first(x_BTnH):
        return jnp.pad(jnp.swapaxes(x_BTnH, 1, 2), ((0, 0), (0, 0), (0, padded - T), (0, 0)))

    sizes = dict(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                 block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    kernel = kernels.make_splash_mha(
        masks.MultiHeadMask([masks.CausalMask((padded, padded))] * N),
        block_sizes=kernels.BlockSizes(**sizes), head_shards=1, q_seq_shards=1,
        interpret=interpret)

    def attend(q_BNTH, k_BKSH, v_BKSH, segment_BT):
        return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=kernels.SegmentIds(s, s)))(
            q_BNTH, k_BKSH, v_BKSH, segment_BT)

    K = k_BSKH.shape[2]
    if activation_ways("kv_heads", K) < activation_ways("heads", N):
        # The KV heads do not split over the mesh as the query heads do (tensor=8 over 4 KV
        # heads): each query head gets its own copy of its KV head, so that every shard holds
        # the KV heads of its own queries.
        k_BSKH, v_BSKH = (jnp.repeat(x_BSKH, N // K, axis=2) for x_BSKH in (k_BSKH, v_BSKH))
    attend = per_shard(attend, in_axes=(("batch", "heads", None, None),
                                        ("batch", "kv_heads", None, None),
                                        ("batch", "kv_heads", None, None), ("batch", None)),
                       out_axes=("batch", "heads", None, None))
    dtype = q_BTNH.dtype
    out_BNTH = attend(heads_first(q_BTNH * jnp.asarray(scale, dtype)),
                      heads_first(k_BSKH.astype(dtype)), heads_first(v_BSKH.astype(dtype)),
                      segment_BT)
    return jnp.swapaxes(out_BNTH[:, :, :T], 1, 2)
