"""Blockwise attention with an online softmax, in pure JAX: memory linear in the sequence length
on every backend (Rabe & Staats 2021, "Self-attention does not need O(n²) memory"; Dao et al.
2022, FlashAttention; the backward pass as in FlashAttention-2, Dao 2023).

Queries are cut into blocks of `block_q` rows, keys and values into blocks of `block_kv`. For
each query block a loop over key blocks keeps, per query and head, the running maximum m of the
scores, the running sum l of exp(s − m) and the unnormalised output, rescaling them by
exp(m_old − m_new) when the maximum grows: only one `[block_q, block_kv]` tile of scores exists
at a time. The backward pass (a custom VJP) recomputes each tile from q, k, v and the saved
log-sum-exp instead of storing probabilities, so the residuals are q, k, v, the output and one
fp32 number per query and head.

Tiles that the mask hides entirely are skipped: each query block loops over the key blocks from
the first to the last that may hold a visible pair, decided from per-block ranges (a tile can
only if its smallest key index is ≤ its largest query index and its query and key segment
ranges overlap: necessary conditions, so no needed tile is skipped). Under a causal mask that
skips the tiles above the diagonal, about half the work at long T.

GQA/MQA: queries are grouped as (K, G) and contracted against the K key/value heads directly.
The key and value head dims may differ (the value's sets the output's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from llama_jax.nn.ops import einsum_f32

# Finite, so that a fully masked row gives a uniform softmax instead of NaN (as the dense path).
MASKED = float(jnp.finfo(jnp.float32).min)
_NEVER = jnp.iinfo(jnp.int32).max  # key index of padding slots: after every query


# Remat names (model/transformer.py's attention policies) of attention's output and of the
# blockwise backward pass's log-sum-exp
OUTPUT_NAME, LSE_NAME = "attention", "attention_lse"


def chunked_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                      q_index_BT: jax.Array, kv_index_BS: jax.Array,
                      q_segment_BT: jax.Array | None, kv_segment_BS: jax.Array | None, *,
                      scale: float, block_q: int, block_kv: int) -> jax.Array:
    """softmax(q·kᵀ·scale + mask)·v in blocks; `[B, T, N, Hv]` in q's dtype. Query t sees key s
    iff `kv_index[s] <= q_index[t]` (and, with segments, their segment ids are equal).

    T and S need not be multiples of the blocks: queries are padded with index −1 (they see
    nothing and are dropped), keys with an index after every query (never seen)."""
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    bq, bk = min(block_q, T), min(block_kv, S)
    if q_segment_BT is None:  # one segment: the segment test always passes
        q_segment_BT = jnp.zeros((B, T), jnp.int32)
        kv_segment_BS = jnp.zeros((B, S), jnp.int32)

    def blocks(x, size, pad_value=0, mode="constant"):
        """`[B, L, ...]` -> `[L/size, B, size, ...]`, padded along L to whole blocks."""
        pad = -x.shape[1] % size
        widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
        x = jnp.pad(x, widths, mode, **({"constant_values": pad_value} if mode == "constant"
                                         else {}))
        return jnp.moveaxis(x.reshape(B, -1, size, *x.shape[2:]), 1, 0)

    # Segment ids are padded with their edge values so that padding widens no block's range.
    out_QBTKGH = _flash(
        scale, blocks(q_BTNH.reshape(B, T, K, N // K, H), bq), blocks(k_BSKH, bk),
        blocks(v_BSKH, bk), blocks(q_index_BT.astype(jnp.int32), bq, -1),
        blocks(kv_index_BS.astype(jnp.int32), bk, _NEVER),
        blocks(q_segment_BT.astype(jnp.int32), bq, mode="edge"),
        blocks(kv_segment_BS.astype(jnp.int32), bk, mode="edge"))
    out_BTNH = jnp.moveaxis(out_QBTKGH, 0, 1).reshape(B, -1, N, out_QBTKGH.shape[-1])
    return out_BTNH[:, :T]


def _tile_ranges(q_index_QBT, kv_index_JBS, q_segment_QBT, kv_segment_JBS):
    """Per query block, the key blocks `[lo, hi)` to visit: from the first to the last that may
    hold a visible pair (in any row). A dynamic loop bound, not a `lax.cond` per tile: JAX's
    partial evaluation of a cond inside a differentiated layer scan saves every tile's
    probabilities as residuals, which is the quadratic memory this module exists to avoid."""
    causal_QJB = kv_index_JBS.min(-1)[None] <= q_index_QBT.max(-1)[:, None]
    overlap_QJB = ((q_segment_QBT.min(-1)[:, None] <= kv_segment_JBS.max(-1)[None])
                   & (kv_segment_JBS.min(-1)[None] <= q_segment_QBT.max(-1)[:, None]))
    needed_QJ = jnp.any(causal_QJB & overlap_QJB, axis=-1)
    n_blocks = needed_QJ.shape[1]
    any_Q = needed_QJ.any(axis=1)
    lo_Q = jnp.where(any_Q, jnp.argmax(needed_QJ, axis=1), 0)
    hi_Q = jnp.where(any_Q, n_blocks - jnp.argmax(needed_QJ[:, ::-1], axis=1), 0)
    return lo_Q.astype(jnp.int32), hi_Q.astype(jnp.int32)


def visible(q_index_BT: jax.Array, kv_index_BS: jax.Array, q_segment_BT: jax.Array | None = None,
            kv_segment_BS: jax.Array | None = None) -> jax.Array:
    """`[B, T, S]` bool: query t sees key s iff `kv_index[s] <= q_index[t]` and (with segment
    ids) both are in the same segment."""
    visible_BTS = kv_index_BS[:, None, :] <= q_index_BT[:, :, None]
    if q_segment_BT is not None:
        visible_BTS &= q_segment_BT[:, :, None] == kv_segment_BS[:, None, :]
    return visible_BTS


def _scores(scale, q_BTKGH, k_BSKH, q_index_BT, kv_index_BS, q_segment_BT, kv_segment_BS):
    """One tile's masked fp32 scores `[B, K, G, T, S]`."""
    s_BKGTS = einsum_f32("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH) * scale
    visible_BTS = visible(q_index_BT, kv_index_BS, q_segment_BT, kv_segment_BS)
    return jnp.where(visible_BTS[:, None, None], s_BKGTS, MASKED)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(scale, q_QBTKGH, k_JBSKH, v_JBSKH, q_index_QBT, kv_index_JBS, q_segment_QBT,
           kv_segment_JBS):
    return _flash_forward(scale, q_QBTKGH, k_JBSKH, v_JBSKH, q_index_QBT, kv_index_JBS,
                          q_segment_QBT, kv_segment_JBS)[0]


def _flash_forward(scale, q_QBTKGH, k_JBSKH, v_JBSKH, q_index_QBT, kv_index_JBS, q_segment_QBT,
                   kv_segment_JBS):
    """Blocked outputs `[Q, B, T, K, G, Hv]`, log-sum-exps `[Q, B, K, G, T]` (fp32) and the
    key blocks each query block visits (`_tile_ranges`)."""
    lo_Q, hi_Q = _tile_ranges(q_index_QBT, kv_index_JBS, q_segment_QBT, kv_segment_JBS)

    def query_block(_, xs):
        q_BTKGH, q_index_BT, q_segment_BT, lo, hi = xs
        B, T, K, G, _ = q_BTKGH.shape

        def tile(j, carry):
            m_BKGT, l_BKGT, acc_BKGTH = carry
            v_BSKH = v_JBSKH[j]
            s_BKGTS = _scores(scale, q_BTKGH, k_JBSKH[j], q_index_BT, kv_index_JBS[j],
                              q_segment_BT, kv_segment_JBS[j])
            m_new_BKGT = jnp.maximum(m_BKGT, s_BKGTS.max(-1))
            p_BKGTS = jnp.exp(s_BKGTS - m_new_BKGT[..., None])
            rescale_BKGT = jnp.exp(m_BKGT - m_new_BKGT)
            pv_BKGTH = einsum_f32("BKGTS,BSKH->BKGTH", p_BKGTS.astype(v_BSKH.dtype), v_BSKH)
            return (m_new_BKGT, l_BKGT * rescale_BKGT + p_BKGTS.sum(-1),
                    acc_BKGTH * rescale_BKGT[..., None] + pv_BKGTH)

        Hv = v_JBSKH.shape[-1]
        init = (jnp.full((B, K, G, T), MASKED, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
                jnp.zeros((B, K, G, T, Hv), jnp.float32))
        m_BKGT, l_BKGT, acc_BKGTH = jax.lax.fori_loop(lo, hi, tile, init)
        # A row that saw no tile at all (only possible for padding) keeps l = 0: divide by 1.
        l_BKGT = jnp.where(l_BKGT == 0, 1.0, l_BKGT)
        out_BTKGH = jnp.einsum("BKGTH->BTKGH", acc_BKGTH / l_BKGT[..., None])
        return None, (out_BTKGH.astype(q_BTKGH.dtype), m_BKGT + jnp.log(l_BKGT))

    _, (out_QBTKGH, lse_QBKGT) = jax.lax.scan(
        query_block, None, (q_QBTKGH, q_index_QBT, q_segment_QBT, lo_Q, hi_Q))
    return out_QBTKGH, lse_QBKGT, (lo_Q, hi_Q)


def _flash_fwd(scale, q, k, v, q_index, kv_index, q_segment, kv_segment):
    out, lse, ranges = _flash_forward(scale, q, k, v, q_index, kv_index, q_segment, kv_segment)
    # Named so that a remat policy can keep them (the backward pass then skips the forward)
    out, lse = checkpoint_name(out, OUTPUT_NAME), checkpoint_name(lse, LSE_NAME)
    return out, (q, k, v, q_index, kv_index, q_segment, kv_segment, out, lse, ranges)


def _flash_bwd(scale, residuals, dout_QBTKGH):
    """FlashAttention-2's backward: per tile, p = exp(s − lse) is recomputed, then
    dV += pᵀ·dO, dP = dO·Vᵀ, dS = p ⊙ (dP − rowsum(dO ⊙ O)), dQ += dS·K·scale and
    dK += dSᵀ·Q·scale. dQ is built per query block; dK and dV accumulate in fp32 across them."""
    (q_QBTKGH, k_JBSKH, v_JBSKH, q_index_QBT, kv_index_JBS, q_segment_QBT, kv_segment_JBS,
     out_QBTKGH, lse_QBKGT, (lo_Q, hi_Q)) = residuals

    def query_block(dkv, xs):
        q_BTKGH, q_index_BT, q_segment_BT, lo, hi, lse_BKGT, do_BTKGH, o_BTKGH = xs
        # rowsum(dO ⊙ O) = Σ_s p·dP: the softmax's Jacobian term, one number per query and head.
        delta_BKGT = jnp.einsum("BTKGH->BKGT", do_BTKGH.astype(jnp.float32)
                                * o_BTKGH.astype(jnp.float32))

        def tile(j, carry):
            dq_BTKGH, dk_JBSKH, dv_JBSKH = carry
            k_BSKH, v_BSKH = k_JBSKH[j], v_JBSKH[j]
            s_BKGTS = _scores(scale, q_BTKGH, k_BSKH, q_index_BT, kv_index_JBS[j],
                              q_segment_BT, kv_segment_JBS[j])
            p_BKGTS = jnp.exp(s_BKGTS - lse_BKGT[..., None])
            dv_BSKH = einsum_f32("BKGTS,BTKGH->BSKH", p_BKGTS.astype(do_BTKGH.dtype), do_BTKGH)
            dp_BKGTS = einsum_f32("BTKGH,BSKH->BKGTS", do_BTKGH, v_BSKH.astype(do_BTKGH.dtype))
            ds_BKGTS = (p_BKGTS * (dp_BKGTS - delta_BKGT[..., None]) * scale).astype(
                q_BTKGH.dtype)
            dq_BTKGH = dq_BTKGH + einsum_f32("BKGTS,BSKH->BTKGH", ds_BKGTS,
                                             k_BSKH.astype(q_BTKGH.dtype))
            dk_BSKH = einsum_f32("BKGTS,BTKGH->BSKH", ds_BKGTS, q_BTKGH)
            return (dq_BTKGH, dk_JBSKH.at[j].add(dk_BSKH), dv_JBSKH.at[j].add(dv_BSKH))

        dq_BTKGH = jnp.zeros(q_BTKGH.shape, jnp.float32)
        dq_BTKGH, *dkv = jax.lax.fori_loop(lo, hi, tile, (dq_BTKGH, *dkv))
        return tuple(dkv), dq_BTKGH.astype(q_BTKGH.dtype)

    dkv = (jnp.zeros(k_JBSKH.shape, jnp.float32), jnp.zeros(v_JBSKH.shape, jnp.float32))
    (dk_JBSKH, dv_JBSKH), dq_QBTKGH = jax.lax.scan(
        query_block, dkv, (q_QBTKGH, q_index_QBT, q_segment_QBT, lo_Q, hi_Q, lse_QBKGT,
                           dout_QBTKGH, out_QBTKGH))
    return (dq_QBTKGH, dk_JBSKH.astype(k_JBSKH.dtype), dv_JBSKH.astype(v_JBSKH.dtype),
            None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
