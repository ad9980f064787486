"""A decode step's attention over a pool of pages by Pallas's TPU paged attention kernel
(`jax.experimental.pallas.ops.tpu.paged_attention`), where it applies: the per-layer GQA pool
(gqa.LayerCache, `[P, K·page, H]`) of a paged cache, read in place through the rows' tables.
Everywhere else a step gathers the rows' pages and attends densely (`kv_storage.gather_pages`),
which is the reference this kernel is tested against.

The kernel reads K/V pages `[K, P, page, H]`: our pool's bytes are `[P, K, page, H]`, and a
transpose would copy the whole pool every step. But `[P·K, page, H]` is the same buffer, with
(page p, head k) at page p·K + k: so each row's K heads run as K rows of one KV head each,
`[B·K, G, H]` queries over a pool of one head, their tables `pages·K + k`. The kernel's grid
is (rows, KV heads) either way, so the work is the same.

It applies where it computes what the gather does up to bf16 rounding, and runs as written:
- a TPU (`target.platform()`) and heads of a multiple of 128 features (Mosaic's lanes);
- one query per row, a decode step (a verify pass's k + 1 and a prefill chunk gather);
- a bf16 cache: the kernel reads keys and values as bf16 whatever they are stored as (an fp32
  cache keeps the gather's precision), and int8 caches gather too (the kernel's int8 input
  wants scales per value, which would widen the pool's scales every step);
- no mesh splitting the pool (`sharding.active_mesh`): a shard's tables would name pages of
  other shards. Meshes gather.
Rows start at slot 0 (a paged cache's rows always do: kv_cache.paged_rows), so a row's
length is its end plus the one token written.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from llama_jax.parallel import sharding, target

# Mosaic tiles a block's last axis by a TPU core's 128 lanes: the kernel's head dims are
# multiples (LLaMA 1-3 and 3.2 3B have 128; 3.2 1B has 64, and gathers)
LANES = 128
# Positions one kernel block reads at most: the kernel walks a row's pages in blocks of
# `pages_per_compute_block`, which must divide the table's width
BLOCK_POSITIONS = 512


def applies(T: int, cache_dtype: str, head_dim: int) -> bool:
    """Whether a step of `T` queries per row over a pool in `cache_dtype` of heads of
    `head_dim` runs the kernel."""
    mesh = sharding.active_mesh()
    return (target.platform() == "tpu" and T == 1 and cache_dtype == "bfloat16"
            and head_dim % LANES == 0 and (mesh is None or mesh.size == 1))


def paged_decode_attention(q_BTNH: jax.Array, k_PCH: jax.Array, v_PCH: jax.Array,
                           lengths_B: jax.Array, pages_BN: jax.Array, page: int,
                           scale: float) -> jax.Array:
    """One query per row (`[B, 1, N, H]`) against the first `lengths_B[b]` positions of row
    b's pages `pages_BN[b]` (entries < 0 lie past its length) in a pool `[P, K·page, H]`;
    `[B, 1, N, H]` in the queries' dtype."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    B, _, N, H = q_BTNH.shape
    P, C, _ = k_PCH.shape
    K = C // page
    k_PCH, v_PCH = (_floats(x) for x in (k_PCH, v_PCH))
    # The kernel has no softmax scale: the queries carry it, in fp32 (as the kernel computes)
    q_RGH = (q_BTNH[:, 0].astype(jnp.float32) * scale).reshape(B * K, N // K, H)
    tables_BKN = jnp.maximum(pages_BN, 0)[:, None, :] * K + jnp.arange(K)[None, :, None]
    out_RGH = paged_attention(
        q_RGH, *(x.reshape(1, P * K, page, H) for x in (k_PCH, v_PCH)),
        jnp.repeat(lengths_B.astype(jnp.int32), K), tables_BKN.reshape(B * K, -1),
        pages_per_compute_block=compute_block(pages_BN.shape[1], page))
    return out_RGH.reshape(B, 1, N, H).astype(q_BTNH.dtype)


def _floats(cache_PCH: jax.Array) -> jax.Array:
    """A pool as bf16: a program for a CPU (the kernel's interpreter) stores 16-bit caches as
    their bits (kv_storage)."""
    if cache_PCH.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(cache_PCH, jnp.bfloat16)
    return cache_PCH


def compute_block(width: int, page: int) -> int:
    """The pages a kernel block reads: the most that divide the table's `width` and hold at
    most `BLOCK_POSITIONS` positions (at least one)."""
    return math.gcd(width, max(1, BLOCK_POSITIONS // page))
