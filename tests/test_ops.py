"""RMSNorm and the mixed-precision einsum against float64 numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax.nn.norms import rms_norm
from llama_jax.nn.ops import dense, einsum_f32, einsum_f32_grads, lookup
from reference import relative_error
import reference as ref


def randn(rng, *shape, scale=1.0):
    """From the test's own seeded generator: inputs never depend on which tests ran before."""
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def test_rms_norm_matches_float64():
    rng = np.random.default_rng(1)
    x, g = randn(rng, 3, 5, 64, scale=3.0), randn(rng, 64)
    out = jax.jit(rms_norm, static_argnums=2)(x, g, 1e-5)
    assert out.dtype == jnp.float32
    assert relative_error(out, ref.rms_norm(x, g, 1e-5)) < 1e-6


def test_rms_norm_has_no_mean_subtraction_and_uses_eps():
    x = np.full((1, 4), 2.0, np.float32)
    np.testing.assert_allclose(rms_norm(x, np.ones(4, np.float32), 0.0), np.ones((1, 4)))
    x = randn(np.random.default_rng(2), 2, 16, scale=1e-3)  # eps dominates tiny activations
    assert relative_error(rms_norm(x, np.ones(16, np.float32), 1.0), x / np.sqrt(1.0 + np.mean(
        x.astype(np.float64) ** 2, -1, keepdims=True))) < 1e-6


def test_rms_norm_bf16_keeps_fp32_statistics():
    # Large activations: squaring in bf16 would lose the mean; fp32 statistics keep it.
    rng = np.random.default_rng(3)
    x, g = randn(rng, 4, 256, scale=300.0), randn(rng, 256)
    out = rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(g), 1e-5)
    assert out.dtype == jnp.bfloat16
    assert relative_error(out, ref.rms_norm(x, g, 1e-5)) < 1e-2


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_dense_casts_weights_to_the_activation_dtype(dtype, tol):
    rng = np.random.default_rng(4)
    x, w = randn(rng, 2, 3, 64), randn(rng, 64, 4, 8)
    out = dense("BTD,DNH->BTNH", jnp.asarray(x, dtype), w)
    assert out.dtype == dtype
    assert relative_error(out, np.einsum("btd,dnh->btnh", x.astype(np.float64), w)) < tol


def test_dense_accumulates_in_fp32():
    # 4096 terms of ~1/64 each summed in bf16 would stall; fp32 accumulation gets the sum right.
    x = jnp.full((1, 1, 4096), 0.125, jnp.bfloat16)
    w = jnp.full((4096, 1), 0.125, jnp.bfloat16)
    assert float(dense("BTD,DF->BTF", x, w)[0, 0, 0]) == 64.0


TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
            max_seq_len=16)


@pytest.mark.parametrize("kind", ["gqa", "moe-capacity", "moe-dropless", "mla"])
def test_fp32_models_multiply_at_full_precision(kind):
    """An fp32 model computes in fp32 on every backend: each matmul of its training gradient
    asks for HIGHEST precision (at DEFAULT, GPUs run fp32 matmuls as TF32, TPUs as one bf16
    pass). Under bf16 compute the blocks' matmuls stay at DEFAULT. Read from the lowered
    program, since CPU computes fp32 at full precision either way."""
    import dataclasses

    from llama_jax import ModelConfig, init_params
    from llama_jax.config import MlaConfig, MoeConfig
    from llama_jax.training.step import loss_sums

    config = ModelConfig(**TINY)
    if kind.startswith("moe"):
        config = dataclasses.replace(config, mlp="moe", moe=MoeConfig(n_experts=4, top_k=2),
                                     moe_dispatch=kind.split("-")[1])
    if kind == "mla":
        config = dataclasses.replace(config, attention="mla", n_kv_heads=None, head_dim=None,
                                     mla=MlaConfig(
                                         kv_lora_rank=16, qk_nope_head_dim=8,
                                         qk_rope_head_dim=8, v_head_dim=8))
    params = init_params(config, jax.random.key(0))
    window = jax.random.randint(jax.random.key(1), (2, 9), 0, config.vocab_size)

    def dots(compute_dtype):
        c = config.with_execution(compute_dtype=compute_dtype)
        grad = jax.grad(lambda p: loss_sums(c, p, window, 1, 0.0)[0])
        text = jax.jit(grad).lower(params).as_text()
        return [line for line in text.splitlines()
                if "dot_general" in line or "ragged_dot" in line]

    fp32 = dots("float32")
    assert fp32 and all("precision = [HIGHEST, HIGHEST]" in line for line in fp32), [
        line for line in fp32 if "HIGHEST" not in line][:3]
    assert any("HIGHEST" not in line for line in dots("bfloat16"))


@pytest.mark.parametrize("equation, w_shape", [("BTD,DV->BTV", (16, 40)),
                                               ("BTD,VD->BTV", (40, 16))])
def test_einsum_grads_are_autodiffs_for_a_cotangent_in_the_operands_dtype(equation, w_shape):
    """The LM head's backward matmuls (training/cross_entropy.py): given a cotangent in the
    operands' dtype, the two matmuls autodiff would run on it, each gradient in its operand's
    dtype (for bf16 operands: bf16 matmuls with fp32 accumulation)."""
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    ct = jax.random.normal(k3, (2, 5, 40))
    for dtype in (jnp.float32, jnp.bfloat16):
        h = jax.random.normal(k1, (2, 5, 16)).astype(dtype)
        w = jax.random.normal(k2, w_shape).astype(dtype)
        _, pull_reference = jax.vjp(lambda a, b: einsum_f32(equation, a, b), h, w)
        rounded = ct.astype(dtype)
        for got, want in zip(einsum_f32_grads(equation, h, w, rounded),
                             pull_reference(rounded.astype(jnp.float32))):
            assert got.dtype == dtype
            np.testing.assert_array_equal(got.astype(jnp.float32), want.astype(jnp.float32))

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_embedding_lookups_gradient_is_autodiffs(dtype):
    """`lookup`'s own backward rule (the rows moved before they are widened) gives autodiff's
    gradient of the plain take, every repeated token's rows summed in the table's fp32."""
    table = jax.random.normal(jax.random.key(0), (11, 6))
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, 11)  # repeats among 27
    weights = jax.random.normal(jax.random.key(2), (3, 9, 6))

    def loss(take):
        return lambda t: jnp.sum(jnp.sin(take(t)).astype(jnp.float32) * weights)
    got = jax.grad(loss(lambda t: lookup(t, tokens, dtype)))(table)
    want = jax.grad(loss(lambda t: jnp.take(t, tokens, axis=0).astype(dtype)))(table)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("platform, padded", [("tpu", {1: True, 2: True}),
                                              ("gpu", {1: True, 2: False})])
def test_a_decode_steps_one_row_matmuls_are_padded_where_the_compiler_wants_them(
        platform, padded, monkeypatch):
    """A one-row matmul runs on 8 rows (`ops.row_tiled`), its result the float64 one; on a GPU
    only where it contracts one axis: XLA:GPU keeps W_O's, over heads x features, a GEMM."""
    from llama_jax.parallel import target
    monkeypatch.setattr(target, "platform", lambda: platform)
    rng = np.random.default_rng(0)
    for equation, x_shape, w_shape, n_in in [("BTD,DNH->BTNH", (1, 1, 16), (16, 4, 8), 1),
                                             ("BTNH,NHD->BTD", (1, 1, 4, 8), (4, 8, 16), 2)]:
        x, w = randn(rng, *x_shape), randn(rng, *w_shape)
        jaxpr = str(jax.make_jaxpr(lambda x, w: dense(equation, x, w))(x, w))
        assert ("pad[" in jaxpr) == padded[n_in], (platform, equation, jaxpr)
        want = np.einsum(equation, x.astype(np.float64), w.astype(np.float64))
        assert relative_error(dense(equation, jnp.asarray(x), jnp.asarray(w)), want) < 1e-6
