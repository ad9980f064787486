"""Attention: float64 reference, GQA/MQA without repeated K/V, causality, segment masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax.nn.attention import attention, attention_mask
from reference import relative_error
import reference as ref

rng = np.random.default_rng(2)
B, T, H = 2, 11, 16


def qkv(N, K, T=T):
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k = rng.standard_normal((B, T, K, H)).astype(np.float32)
    v = rng.standard_normal((B, T, K, H)).astype(np.float32)
    return q, k, v


def causal(T=T, segments=None):
    index = jnp.broadcast_to(jnp.arange(T), (B, T))
    seg = None if segments is None else jnp.asarray(segments)
    return attention_mask(index, index, seg, seg)


@pytest.mark.parametrize("N, K", [(4, 4), (4, 2), (8, 2), (4, 1)], ids=["MHA", "GQA2", "GQA4",
                                                                        "MQA"])
def test_matches_float64_reference(N, K):
    q, k, v = qkv(N, K)
    out = jax.jit(attention)(q, k, v, causal())
    assert out.shape == (B, T, N, H)
    assert relative_error(out, ref.attention(q, k, v, ref.causal_mask(T, B=B))) < 1e-6


@pytest.mark.parametrize("K", [2, 1])
def test_grouped_equals_mha_with_repeated_kv(K):
    N = 8
    q, k, v = qkv(N, K)
    grouped = attention(q, k, v, causal())
    repeated = attention(q, np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2), causal())
    np.testing.assert_allclose(grouped, repeated, rtol=1e-6, atol=1e-6)


def test_grouped_attention_never_materialises_repeated_kv():
    N, K, T_q, S = 8, 2, 3, 13  # T_q != S tells query-shaped arrays from key-shaped ones
    q = rng.standard_normal((B, T_q, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((B, S, K, H)).astype(np.float32) for _ in range(2))
    mask = attention_mask(jnp.full((B, T_q), S - 1), jnp.broadcast_to(jnp.arange(S), (B, S)))
    jaxpr = jax.make_jaxpr(attention)(q, k, v, mask).jaxpr
    shapes = {tuple(var.aval.shape) for eqn in jaxpr.eqns for var in eqn.outvars}
    assert (B, S, N, H) not in shapes and (B, S, K, N // K, H) not in shapes, shapes


def test_causality_by_gradient():
    q, k, v = qkv(4, 2)

    def out_t(k, v, t):
        return attention(q, k, v, causal())[:, t].sum()

    for t in (0, 4, T - 1):
        dk, dv = jax.grad(out_t, argnums=(0, 1))(k, v, t)
        assert np.all(np.asarray(dk)[:, t + 1:] == 0) and np.all(np.asarray(dv)[:, t + 1:] == 0)
        assert np.all(np.abs(np.asarray(dv)[:, :t + 1]).sum(axis=(2, 3)) > 0)


def test_segments_do_not_attend_across_documents():
    segments = np.array([[1] * 4 + [2] * 7, [1] * 6 + [2] * 2 + [3] * 3])
    q, k, v = qkv(4, 2)
    packed = np.asarray(attention(q, k, v, causal(segments=segments)))
    for b in range(B):
        for s in np.unique(segments[b]):
            idx = np.flatnonzero(segments[b] == s)
            alone = attention(q[b:b + 1, idx], k[b:b + 1, idx], v[b:b + 1, idx],
                              attention_mask(*(jnp.arange(len(idx))[None],) * 2))
            np.testing.assert_allclose(packed[b, idx], alone[0], rtol=1e-6, atol=1e-6)


def test_fully_masked_rows_stay_finite():
    q, k, v = qkv(4, 2)
    mask = np.zeros((B, T, T), bool)
    assert np.isfinite(attention(q, k, v, mask)).all()


def test_bf16_attention_is_close_to_fp32():
    q, k, v = qkv(4, 2)
    out = attention(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)), causal())
    assert out.dtype == jnp.bfloat16
    assert relative_error(out, attention(q, k, v, causal())) < 2e-2


@pytest.mark.parametrize("N, K", [(4, 4), (8, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
def test_block_diagonal_decode_attention_matches_reference(N, K):
    from llama_jax.nn.attention import decode_attention_block_diagonal

    S = 13
    q = rng.standard_normal((B, 1, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((B, K, S, H)).astype(np.float32) for _ in range(2))
    valid = np.ones((B, S), bool)
    valid[0, :4] = False  # left padding of row 0
    valid[:, 9:] = False  # slots after the current token
    out = decode_attention_block_diagonal(q, k.reshape(B, K * S, H), v.reshape(B, K * S, H),
                                          valid)
    ref_out = ref.attention(q, np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2), valid[:, None, :])
    assert relative_error(out, ref_out) < 1e-6
