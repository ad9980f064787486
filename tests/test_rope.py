"""RoPE: frequencies (incl. llama3 scaling), precision of the tables, the relative-position
property, and equality with Meta's interleaved complex form up to the q/k row permutation."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax.config import ModelConfig, RopeScaling, load_model_config
from llama_jax.nn.rope import apply_rope, inverse_frequencies, rope_cos_sin, swapped_halves
from reference import relative_error
import reference as ref


def head_config(head_dim=64, **kw):
    return ModelConfig(vocab_size=8, dim=head_dim, n_layers=1, n_heads=1, **kw)


def rotate(config, x_BTNH, positions_BT):
    cos, sin = rope_cos_sin(config, jnp.asarray(positions_BT, jnp.int32))
    return np.asarray(apply_rope(jnp.asarray(x_BTNH), cos, sin), np.float64)


def test_golden_rotation_head_dim_4():
    # θ = [1, 0.01]; half-split pairs (x0, x2) and (x1, x3); position 1.
    out = rotate(head_config(4, rope_theta=10000.0), np.array([[[[1., 2., 3., 4.]]]], np.float32),
                 [[1]])
    golden = [-1.9841106485555495, 1.959900667496664, 2.4623779024123156, 4.019799668334994]
    np.testing.assert_allclose(out[0, 0, 0], golden, rtol=1e-6)
    np.testing.assert_array_equal(rotate(head_config(4), np.ones((1, 1, 1, 4), np.float32),
                                         [[0]]), np.ones((1, 1, 1, 4)))  # position 0: identity


def test_golden_llama3_frequencies():
    f = inverse_frequencies(load_model_config("llama3.1-8b"))
    assert f.shape == (64,)
    np.testing.assert_allclose(f[[0, 20, 40, 63]], [1.0, 0.016560440080994446,
                                                    3.428102195952591e-05, 3.068925988914511e-07],
                               rtol=1e-12)
    assert f[63] == pytest.approx(500000.0 ** (-126 / 128) / 8, rel=1e-12)  # long: divided by 8


@pytest.mark.parametrize("preset", ["llama3.1-8b", "llama3.2-1b", "tiny-llama3.2"])
def test_llama3_frequencies_match_meta_and_transformers(preset):
    c = load_model_config(preset)
    ours = inverse_frequencies(c)
    np.testing.assert_allclose(ours, ref.meta_inv_freq(c), rtol=1e-14)
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_llama3_parameters
    s = c.rope_scaling
    hf = transformers.LlamaConfig(
        hidden_size=c.dim, num_attention_heads=c.n_heads, max_position_embeddings=c.max_seq_len,
        rope_parameters=dict(rope_type="llama3", rope_theta=c.rope_theta, factor=s.factor,
                             low_freq_factor=s.low_freq_factor,
                             high_freq_factor=s.high_freq_factor,
                             original_max_position_embeddings=s.original_max_position_embeddings))
    hf_inv_freq, _ = _compute_llama3_parameters(hf)
    np.testing.assert_allclose(ours, hf_inv_freq.double().numpy(), rtol=1e-6)  # HF is fp32


@pytest.mark.parametrize("scaling", [
    dict(factor=4.0, original_max_position_embeddings=64),  # temperature mscale(1) on cos/sin
    dict(factor=4.0, original_max_position_embeddings=64, mscale_all_dim=1.0),  # mscale unset
    dict(factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707),
    dict(factor=8.0, original_max_position_embeddings=2048, beta_fast=16.0, beta_slow=2.0,
         mscale=1.0, mscale_all_dim=0.5),
], ids=["plain", "all-dim-only", "deepseek-v2", "uneven"])
def test_yarn_matches_deepseek_and_transformers(scaling):
    """Frequencies, cos/sin temperature and softmax scale of YaRN against DeepSeek's `yarn_*`
    functions (tests/reference.py) and transformers' `_compute_yarn_parameters`."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    from llama_jax.nn.rope import rotation_scale, softmax_scale

    c = head_config(64, rope_theta=10000.0, rope_type="yarn",
                    rope_scaling=RopeScaling(**scaling))
    ours = inverse_frequencies(c)
    np.testing.assert_allclose(ours, ref.meta_inv_freq(c), rtol=1e-14)
    assert (rotation_scale(c), softmax_scale(c)) == pytest.approx(ref.rope_and_softmax_scales(c),
                                                                  rel=1e-12)
    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=1, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, **scaling))
    hf_inv_freq, hf_attention_factor = _compute_yarn_parameters(hf)
    np.testing.assert_allclose(ours, hf_inv_freq.double().numpy(), rtol=1e-6)  # HF is fp32
    assert rotation_scale(c) == pytest.approx(hf_attention_factor, rel=1e-12)
    # the fastest frequency kept, the slowest (far below one turn per context) divided
    assert ours[0] == 1.0 and ours[-1] == pytest.approx(10000.0 ** (-62 / 64) / scaling["factor"],
                                                        rel=1e-12)


@pytest.mark.parametrize("preset", ["llama3.1-8b", "llama2-7b"])
def test_tables_exact_to_1e6_up_to_131072_positions(preset):
    c = load_model_config(preset)
    positions = jnp.arange(131072, dtype=jnp.int32)[None]
    cos, sin = jax.jit(lambda p: rope_cos_sin(c, p))(positions)
    angles = np.arange(131072, dtype=np.float64)[:, None] * inverse_frequencies(c)[None]
    assert np.isfinite(cos).all() and np.isfinite(sin).all()
    assert np.abs(np.asarray(cos[0], np.float64) - np.cos(angles)).max() < 1e-6
    assert np.abs(np.asarray(sin[0], np.float64) - np.sin(angles)).max() < 1e-6


def test_relative_position_property():
    # <f(q, m), f(k, n)> depends on m - n only, at small and very large positions.
    c = load_model_config("llama3.1-8b")
    c = dataclasses.replace(c, head_dim=128)
    q, k = np.random.default_rng(1).standard_normal((2, 1, 1, 1, 128)).astype(np.float32)
    for m, n in [(5, 2), (1000, 7), (100_000, 99_990), (131_000, 3)]:
        terms = rotate(c, q, [[m]]) * rotate(c, k, [[n]])
        base = np.sum(terms)
        for shift in (1, 17, 4096):
            shifted = np.sum(rotate(c, q, [[m + shift]]) * rotate(c, k, [[n + shift]]))
            # The products cancel: the float32 tables' rounding is relative to their
            # magnitudes, not to the dot product.
            assert abs(shifted - base) <= 1e-6 * np.sum(np.abs(terms)), (m, n, shift)


def test_rope_preserves_norm_and_never_touches_other_heads():
    c = head_config(32)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 5, 3, 32)).astype(np.float32)
    out = rotate(c, x, rng.integers(0, 10_000, (2, 5)))
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


@pytest.mark.parametrize("scaling", [None, RopeScaling(factor=8.0,
                                                       original_max_position_embeddings=64)])
def test_half_split_equals_meta_interleaved_after_permutation(scaling):
    c = head_config(64, rope_theta=500000.0, rope_type="default" if scaling is None else "llama3",
                    rope_scaling=scaling)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 9, 4, 64)).astype(np.float32)
    positions = rng.integers(0, 5000, (2, 9))
    ours = rotate(c, x, positions)
    meta = ref.rope_meta(ref.to_interleaved(x), positions, ref.meta_inv_freq(c))
    assert relative_error(ref.to_interleaved(ours), meta) < 1e-6


def test_bf16_inputs_rotate_in_fp32_and_return_bf16():
    c = head_config(64)
    x = np.random.default_rng(4).standard_normal((1, 4, 2, 64)).astype(np.float32)
    cos, sin = rope_cos_sin(c, jnp.arange(4, dtype=jnp.int32)[None] * 1000)
    out = apply_rope(jnp.asarray(x, jnp.bfloat16), cos, sin)
    assert out.dtype == jnp.bfloat16
    assert relative_error(out, apply_rope(jnp.asarray(x), cos, sin)) < 1e-2
    assert math.isfinite(float(jnp.sum(out)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gradient_is_the_cotangent_rotated_back(dtype):
    """The backward pass rotates the cotangent by -angle, as the float64 transpose of the
    rotation does (the rotation is orthogonal), in the input's dtype."""
    c = head_config(16)
    rng = np.random.default_rng(5)
    x, ct = (rng.standard_normal((2, 6, 3, 16)).astype(np.float32) for _ in range(2))
    positions = rng.integers(0, 5000, (2, 6))
    cos, sin = rope_cos_sin(c, jnp.asarray(positions, jnp.int32))
    _, pull = jax.vjp(lambda x: apply_rope(x, cos, sin), jnp.asarray(x, dtype))
    (d_x,) = pull(jnp.asarray(ct, dtype))
    assert d_x.dtype == dtype
    ct64 = np.asarray(jnp.asarray(ct, dtype), np.float64)
    c64, s64 = (np.asarray(a, np.float64)[:, :, None] for a in (cos, sin))
    half = ct64[..., :8], ct64[..., 8:]
    want = np.concatenate([half[0] * c64 + half[1] * s64, half[1] * c64 - half[0] * s64], -1)
    assert relative_error(d_x, want) < (1e-6 if dtype == "float32" else 1e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_partners_by_matmul_are_the_sliced_ones_exactly(dtype):
    """TPU programs take each feature's partner by a permutation matmul (fp32 accumulation at
    full precision): every value exactly the sliced one, in fp32."""
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 5, 3, 16)) * 100, dtype)
    by_matmul, sliced = swapped_halves(x, by_matmul=True), swapped_halves(x, by_matmul=False)
    assert by_matmul.dtype == sliced.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(by_matmul), np.asarray(sliced))
    np.testing.assert_array_equal(np.asarray(sliced[..., :8]), np.asarray(x[..., 8:], np.float32))
