"""Attention under every implementation: the float64 reference, chunked == xla (forward and
gradients) over head groupings, masks and block remainders, GQA/MQA without repeated K/V,
causality, packed documents, memory linear in T, and the implementation choice itself.

cuDNN and splash cannot run on CPU; their wrappers are checked here through the same calls
with JAX's reference path (`cudnn_attention(..., implementation="xla")`) and Pallas's
interpreter (`splash_attention(..., interpret=True)`)."""

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax.parallel import sharding
from llama_jax.config import MeshConfig, ModelConfig
from llama_jax.errors import ConfigError
from llama_jax.nn.attention.dot_product import (Mask, cudnn_attention, describe_attention,
                                      dot_product_attention, resolve_attention_impl,
                                      splash_attention)
from reference import assert_close, relative_error
import reference as ref

B, T, H = 2, 11, 16
SEGMENTS = np.array([[1] * 4 + [2] * 7, [1] * 6 + [2] * 2 + [3] * 3])
HEADS = {"MHA": (4, 4), "GQA": (8, 2), "MQA": (4, 1)}


@functools.partial(jax.jit, static_argnums=0)
def attend(impl, q, k, v, mask):
    """`impl`'s output; chunked with blocks (4 x 3) that divide neither T nor S."""
    if impl == "splash":
        return splash_attention(q, k, v, mask, scale=q.shape[-1] ** -0.5, block_q=128,
                                block_kv=128, interpret=True)
    if impl == "cudnn":
        return cudnn_attention(q, k, v, mask, scale=q.shape[-1] ** -0.5, implementation="xla")
    return dot_product_attention(q, k, v, mask, impl=impl, block_q=4, block_kv=3)


def qkv(rng, N, K, T=T, S=None, dtype=np.float32):
    """Random q, k, v from the test's own seeded generator (never a shared one: a test's inputs
    must not depend on which tests ran before it)."""
    S = T if S is None else S
    return (rng.standard_normal((B, T, N, H)).astype(dtype),
            rng.standard_normal((B, S, K, H)).astype(dtype),
            rng.standard_normal((B, S, K, H)).astype(dtype))


def causal(T=T, segments=None):
    return Mask.causal(B, T, None if segments is None else jnp.asarray(segments))


def cache_mask(T_new, S, start_B):
    """Queries at the last T_new of S cache slots; row b's slots before start_B[b] are left
    padding (the decoder's prefill and decode steps)."""
    kv_index_BS = jnp.broadcast_to(jnp.arange(S), (B, S))
    return Mask(jnp.broadcast_to(jnp.arange(S - T_new, S), (B, T_new)), kv_index_BS,
                jnp.ones((B, T_new), jnp.int32),
                (kv_index_BS >= jnp.asarray(start_B)[:, None]).astype(jnp.int32))


# The kernel wrappers on one grouping (splash interprets slowly); the JAX paths on all three.
@pytest.mark.parametrize("impl, heads", [(impl, heads) for impl in ("xla", "chunked")
                                         for heads in HEADS] + [("cudnn", "GQA"),
                                                                ("splash", "GQA")])
def test_matches_float64_reference(impl, heads):
    q, k, v = qkv(np.random.default_rng(1), *HEADS[heads])
    out = attend(impl, q, k, v, causal(segments=SEGMENTS))
    assert out.shape == q.shape
    expected = ref.attention(q, k, v, ref.causal_mask(T, SEGMENTS, B=B))
    assert relative_error(out, expected) < 1e-6


@pytest.mark.parametrize("mesh_config", [MeshConfig(data=8), MeshConfig(data=2, tensor=4),
                                         MeshConfig(data=1, tensor=8)],
                         ids=["dp8", "dp2-tp4", "tp8"])
def test_splash_runs_per_shard_on_a_mesh(mesh_config):
    """A Pallas kernel is not partitioned by XLA: on a mesh it runs under shard_map, per row
    and head shard (`sharding.per_shard`). Over tensor=8 the 8 query heads split and the 4
    KV heads do not: each query head's shard must still get its own KV head."""
    B8, N, K = 8, 8, 4
    rng = np.random.default_rng(2)
    q = rng.standard_normal((B8, T, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((B8, T, K, H)).astype(np.float32) for _ in range(2))
    mask = Mask.causal(B8, T, jnp.asarray(np.tile(SEGMENTS, (4, 1))))
    mesh = sharding.make_mesh(mesh_config)
    def splash(*args):
        return splash_attention(*args, scale=H ** -0.5, block_q=128, block_kv=128,
                                interpret=True)
    with sharding.use_mesh(mesh, mesh_config):  # a fresh jit: the rules are read when tracing
        out = jax.jit(splash)(q, k, v, mask)
        assert "shard_map" in str(jax.make_jaxpr(splash)(q, k, v, mask))
    expected = ref.attention(q, k, v, np.asarray(mask.dense()))
    assert relative_error(out, expected) < 1e-6


def projection(shape):
    """The loss's random projection of the output (fixed: seeded here, not drawn from the
    test's generator)."""
    return np.random.default_rng(7).standard_normal(shape)


@functools.partial(jax.jit, static_argnums=0)
def loss_and_grads(impl, q, k, v, mask):
    def loss(q, k, v):  # a random projection of the output: every element gets a cotangent
        out = attend(impl, q, k, v, mask).astype(jnp.float32)
        return jnp.sum(out * jnp.asarray(projection(out.shape)))
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


def projection_terms(out):
    """Σ |out · projection|: the scale of the loss's float32 rounding. Its terms cancel, so
    the loss itself can be far smaller than its rounding error (a bound relative to the loss
    passes or fails with the order of the sum)."""
    return float(np.sum(np.abs(np.asarray(out, np.float64) * projection(out.shape))))


MASKS = {
    "causal": lambda: (T, T, causal()),
    "packed": lambda: (T, T, causal(segments=SEGMENTS)),
    "T=1": lambda: (1, 1, Mask.causal(B, 1)),
    "prefill-left-padded": lambda: (7, 13, cache_mask(7, 13, [0, 5])),
    "decode-left-padded": lambda: (1, 13, cache_mask(1, 13, [2, 6])),
}


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("heads", list(HEADS))
def test_chunked_equals_xla_forward_and_gradients(heads, mask_name):
    T_q, S, mask = MASKS[mask_name]()
    q, k, v = qkv(np.random.default_rng(3), *HEADS[heads], T=T_q, S=S)
    from llama_jax.nn.attention.chunked import chunked_attention
    # The chunked kernel itself (dot_product_attention sends one query to the dense path).
    chunked = chunked_attention(q, k, v, mask.q_index_BT, mask.kv_index_BS, mask.q_segment_BT,
                                mask.kv_segment_BS, scale=H ** -0.5, block_q=4, block_kv=3)
    dense = attend("xla", q, k, v, mask)
    assert relative_error(chunked, dense) < 1e-5
    (value_c, grads_c), (value_x, grads_x) = (loss_and_grads(i, q, k, v, mask)
                                              for i in ("chunked", "xla"))
    assert abs(float(value_c) - float(value_x)) <= 1e-6 * projection_terms(dense)
    for name, g_c, g_x in zip("qkv", grads_c, grads_x):
        # (one key alone: softmax is constant and dq is exactly zero on both paths)
        assert np.linalg.norm(g_c - g_x) <= 1e-5 * np.linalg.norm(g_x), name


def test_chunked_bf16_matches_the_bf16_dense_path():
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in qkv(np.random.default_rng(4), 8, 2, T=40))
    mask = causal(T=40)
    (value_c, grads_c), (value_x, grads_x) = (loss_and_grads(i, q, k, v, mask)
                                              for i in ("chunked", "xla"))
    chunked, dense = attend("chunked", q, k, v, mask), attend("xla", q, k, v, mask)
    assert chunked.dtype == jnp.bfloat16
    # bf16 rounds the (unnormalised) probabilities at different points: a few bf16 ulps.
    assert relative_error(chunked, dense) < 1e-2
    assert abs(float(value_c) - float(value_x)) <= 1e-3 * projection_terms(
        dense.astype(jnp.float32))
    for g_c, g_x in zip(grads_c, grads_x):
        assert g_c.dtype == jnp.bfloat16 and relative_error(g_c, g_x) < 2e-2
    full = attend("xla", *(a.astype(jnp.float32) for a in (q, k, v)), mask)
    assert relative_error(chunked, full) < 1e-2


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_grouped_equals_mha_with_repeated_kv(impl):
    N, K = 8, 2
    q, k, v = qkv(np.random.default_rng(5), N, K)
    grouped = attend(impl, q, k, v, causal())
    repeated = attend(impl, q, np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2),
                      causal())
    assert_close(grouped, repeated, 1e-5)  # different programs: sums in different orders


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_grouped_attention_never_materialises_repeated_kv(impl):
    N, K, T_q, S = 8, 2, 6, 13  # T_q != S tells query-shaped arrays from key-shaped ones
    q, k, v = qkv(np.random.default_rng(6), N, K, T=T_q, S=S)
    mask = cache_mask(T_q, S, [0, 0])
    jaxpr = jax.make_jaxpr(lambda q, k, v: loss_and_grads(impl, q, k, v, mask))(q, k, v)

    def shapes(jaxpr):
        for eqn in jaxpr.eqns:
            yield from (tuple(var.aval.shape) for var in eqn.outvars)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from shapes(sub)
    found = set(shapes(jaxpr.jaxpr))
    assert not any(s[-2:] == (N, H) and S in s or (K, N // K, H) == s[-3:] and S in s
                   for s in found), found


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_causality_by_gradient(impl):
    q, k, v = qkv(np.random.default_rng(8), 4, 2)

    def out_t(k, v, t):
        return attend(impl, q, k, v, causal())[:, t].sum()

    for t in (0, 4, T - 1):
        dk, dv = jax.grad(out_t, argnums=(0, 1))(k, v, t)
        assert np.all(np.asarray(dk)[:, t + 1:] == 0) and np.all(np.asarray(dv)[:, t + 1:] == 0)
        assert np.all(np.abs(np.asarray(dv)[:, :t + 1]).sum(axis=(2, 3)) > 0)


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_segments_do_not_attend_across_documents(impl):
    q, k, v = qkv(np.random.default_rng(9), 4, 2)
    packed = np.asarray(attend(impl, q, k, v, causal(segments=SEGMENTS)))
    for b in range(B):
        for s in np.unique(SEGMENTS[b]):
            idx = np.flatnonzero(SEGMENTS[b] == s)
            alone = attend(impl, q[b:b + 1, idx], k[b:b + 1, idx], v[b:b + 1, idx],
                           Mask.causal(1, len(idx)))
            assert_close(packed[b, idx], alone[0], 1e-5)


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_fully_masked_rows_stay_finite(impl):
    q, k, v = qkv(np.random.default_rng(10), 4, 2)
    nothing = Mask(jnp.full((B, T), -1), jnp.broadcast_to(jnp.arange(T), (B, T)))
    value, grads = loss_and_grads(impl, q, k, v, nothing)
    assert np.isfinite(attend(impl, q, k, v, nothing)).all() and np.isfinite(value)
    assert all(np.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("N, K", [(4, 4), (8, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
def test_block_diagonal_decode_attention_matches_reference(N, K):
    from llama_jax.nn.attention.dot_product import decode_attention_block_diagonal

    S, T = 13, 3  # three queries: a verify pass's, at slots 8, 9, 10
    rng = np.random.default_rng(11)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((B, K, S, H)).astype(np.float32) for _ in range(2))
    valid = np.ones((B, T, S), bool)
    valid[0, :, :4] = False  # left padding of row 0
    for t in range(T):
        valid[:, t, 9 + t:] = False  # slots after each query's own
    out = decode_attention_block_diagonal(q, k.reshape(B, K * S, H), v.reshape(B, K * S, H),
                                          valid, H ** -0.5)
    ref_out = ref.attention(q, np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2), valid)
    assert relative_error(out, ref_out) < 1e-6


# ------------------------------------------------------------------- memory and the choice

LONG = ModelConfig(vocab_size=128, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64,
                   max_seq_len=8192)


def step_temporaries(config: ModelConfig, T: int) -> int:
    """Temporary bytes of the compiled loss-and-gradient step at sequence length T."""
    params = llama_jax.abstract_params(config)
    tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)

    def loss(params, tokens):
        logits = llama_jax.forward(config, params, tokens)
        return -jnp.mean(jax.nn.log_softmax(logits)[0, jnp.arange(T), tokens[0]])
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_chunked_step_memory_grows_linearly_with_T():
    temps = {impl: [step_temporaries(LONG.with_execution(attention_impl=impl), T)
                    for T in (2048, 4096, 8192)] for impl in ("chunked", "xla")}
    # Doubling T doubles the chunked step's temporaries (plus a constant: the block tiles)...
    for small, large in zip(temps["chunked"], temps["chunked"][1:]):
        assert large < 2.2 * small, temps
    # ... and quadruples the dense step's scores.
    for small, large in zip(temps["xla"], temps["xla"][1:]):
        assert large > 3.5 * small, temps
    assert temps["xla"][-1] > 20 * temps["chunked"][-1], temps


def test_auto_runs_on_cpu_and_picks_chunked():
    assert resolve_attention_impl("auto", "cpu") == "chunked"
    assert resolve_attention_impl("auto", "gpu", "bfloat16") == "cudnn"
    assert resolve_attention_impl("auto", "gpu", "float32") == "chunked"  # cuDNN has no fp32
    assert resolve_attention_impl("auto", "tpu") == "splash"
    # jax.nn.dot_product_attention needs values as wide as keys (MLA's may differ)
    assert resolve_attention_impl("auto", "gpu", "bfloat16", 96, v_head_dim=64) == "chunked"
    config = dataclasses.replace(LONG, max_seq_len=64, attention_block_q=16,
                                 attention_block_kv=16)
    params = llama_jax.init_params(config, jax.random.key(0))
    tokens = np.random.default_rng(12).integers(0, 128, (2, 40), dtype=np.int32)
    out = llama_jax.forward(config, params, tokens)
    expected = llama_jax.forward(config.with_execution(attention_impl="xla"), params, tokens)
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("impl, settings, message", [
    ("cudnn", {}, "attention_impl='cudnn' needs an NVIDIA GPU; the backend is 'cpu'"),
    ("splash", {}, "attention_impl='splash' needs a TPU; the backend is 'cpu'"),
])
def test_kernels_the_backend_lacks_are_refused_before_compiling(impl, settings, message):
    config = LONG.with_execution(attention_impl=impl, **settings)
    params = llama_jax.abstract_params(config)
    with pytest.raises(ConfigError, match=message):
        jax.jit(llama_jax.forward, static_argnums=0).trace(
            config, params, jax.ShapeDtypeStruct((1, 600), jnp.int32))


@pytest.mark.parametrize("fields, message", [
    (dict(attention_impl="flash"), "attention_impl='flash' is not one of"),
    (dict(attention_block_q=0), "attention_block_q=0 must be a positive integer"),
])
def test_bad_attention_settings_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(LONG, **fields)


def test_kernel_settings_the_kernel_cannot_use_are_refused():
    with pytest.raises(ConfigError, match="compute_dtype bfloat16 or float16"):
        resolve_attention_impl("cudnn", "gpu", "float32")
    with pytest.raises(ConfigError, match="head_dim=96, value head dim 64"):
        resolve_attention_impl("cudnn", "gpu", "bfloat16", 96, v_head_dim=64)
    with pytest.raises(ConfigError, match="attention_block_q=100: splash attention needs"):
        resolve_attention_impl("splash", "tpu", block_q=100)


def test_the_run_log_line_names_the_choice():
    config = LONG.with_execution(attention_block_q=256, attention_block_kv=128)
    assert describe_attention(config, 4096, "cpu") == (
        "attention: chunked (auto on cpu; blocks of 256 queries x 128 keys)")
    assert describe_attention(config, 100, "cpu").endswith(
        "so one block at seq_len 100: computed densely)")
    assert describe_attention(config.with_execution(attention_impl="xla"), 4096, "cpu") == (
        "attention: xla (attention_impl)")
    assert describe_attention(config.with_execution(compute_dtype="bfloat16"), 4096, "gpu") == (
        "attention: cudnn (auto on gpu)")
