"""The whole model: float64 reference (MHA, GQA, MQA, tied, llama3 scaling past the original
context), causality, packing, batching, scan == unrolled loop, remat, mixed precision."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax.config import load_model_config
from llama_jax.model.transformer import embed, run_layers
from llama_jax.nn.attention.context import Context
from llama_jax.nn.attention.dot_product import Mask
from llama_jax.nn.positions import rotation
from llama_jax.model.params import param_specs
from models import TINY, random_params
from reference import assert_close, relative_error
import reference as ref

CONFIGS = {
    "gqa": TINY,
    "mha": dataclasses.replace(TINY, n_kv_heads=4),
    "mqa-tied-llama3": load_model_config("tiny-llama3.2"),  # K=1, scaling past 64 positions
}
forward = jax.jit(llama_jax.forward, static_argnums=0)


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIGS)


def tokens(config, B, T, seed=0):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, config.vocab_size, jnp.int32)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_float64_reference(name, params):
    config = CONFIGS[name]
    T = 96 if config.rope_scaling else 24  # llama3: beyond original_max_position_embeddings
    toks = tokens(config, 2, T)
    out = forward(config, params[name], toks)
    assert out.shape == (2, T, config.vocab_size) and out.dtype == jnp.float32
    assert relative_error(out, ref.forward(config, params[name], toks)) < 1e-5


def test_custom_positions_match_reference(params):
    toks = tokens(TINY, 1, 16)
    positions = jnp.arange(16, dtype=jnp.int32)[None] + 1000
    out = forward(TINY, params["gqa"], toks, positions_BT=positions)
    assert relative_error(out, ref.forward(TINY, params["gqa"], toks, positions)) < 1e-5


def test_packed_documents_equal_separate_documents(params):
    a, b = tokens(TINY, 1, 5, seed=1), tokens(TINY, 1, 9, seed=2)
    packed = jnp.concatenate([a, b], axis=1)
    positions = jnp.concatenate([jnp.arange(5), jnp.arange(9)])[None].astype(jnp.int32)
    segments = jnp.array([[1] * 5 + [2] * 9], jnp.int32)
    out = forward(TINY, params["gqa"], packed, positions_BT=positions, segment_ids_BT=segments)
    np.testing.assert_allclose(out[:, :5], forward(TINY, params["gqa"], a), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[:, 5:], forward(TINY, params["gqa"], b), rtol=1e-5, atol=1e-5)


def test_batched_equals_single(params):
    toks = tokens(TINY, 3, 12)
    batched = forward(TINY, params["gqa"], toks)
    for i in range(3):
        np.testing.assert_allclose(batched[i:i + 1], forward(TINY, params["gqa"], toks[i:i + 1]),
                                   rtol=1e-5, atol=1e-5)


def test_causality_by_gradient(params):
    T = 10
    index = jnp.arange(T)[None]
    x = embed(TINY, params["gqa"], tokens(TINY, 1, T), index)
    context = Context(Mask.causal(1, T), rotation(TINY, index))

    def layers(x):
        return run_layers(TINY, params["gqa"]["groups"], x, context)[0]
    jac = jax.jacrev(layers)(x)[0, :, :, 0]  # [T,D,T,D]
    influence = np.abs(np.asarray(jac)).sum(axis=(1, 3))  # [t_out, t_in]
    assert np.all(influence[np.triu_indices(T, k=1)] == 0.0)  # exactly zero from the future
    assert np.all(influence[np.tril_indices(T)] > 0.0)


@pytest.mark.parametrize("name", ["gqa", "mqa-tied-llama3"])
def test_scan_equals_unrolled_loop(name, params):
    config = CONFIGS[name]
    toks = tokens(config, 2, 16)
    scanned = forward(config, params[name], toks)
    unrolled = forward(dataclasses.replace(config, scan_layers=False), params[name], toks)
    assert_close(scanned, unrolled, 1e-5)  # two programs: XLA may sum in other orders
    hlo = jax.jit(llama_jax.forward, static_argnums=0).lower(config, params[name], toks).as_text()
    assert "while" in hlo  # the layers really are a loop, not L inlined copies


def loss_and_grads(config, params, toks):
    def loss(p):
        logits = llama_jax.forward(config, p, toks[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1).mean()
    return jax.jit(jax.value_and_grad(loss))(params)


# Blocks of 8 make attention at T = 16 blockwise (the chunked path's own backward pass)
BLOCKWISE = dataclasses.replace(TINY, attention_impl="chunked", attention_block_q=8,
                                attention_block_kv=8)


@pytest.mark.parametrize("policy, base", [
    ("full", TINY), ("dots", TINY), ("dots_no_batch", TINY), ("attention", TINY),
    ("dots_with_attention", TINY), ("full", BLOCKWISE), ("attention", BLOCKWISE),
    ("dots_with_attention", BLOCKWISE)], ids=lambda x: getattr(x, "attention_impl", x))
def test_remat_does_not_change_values_or_gradients(policy, base, params):
    toks = tokens(base, 2, 17)
    loss, grads = loss_and_grads(base, params["gqa"], toks)
    remat_config = dataclasses.replace(base, remat=policy)
    remat_loss, remat_grads = loss_and_grads(remat_config, params["gqa"], toks)
    assert remat_loss == pytest.approx(float(loss), rel=1e-6)
    jaxpr = str(jax.make_jaxpr(llama_jax.forward, static_argnums=0)(remat_config, params["gqa"],
                                                                    toks))
    assert "checkpoint" in jaxpr or "remat" in jaxpr  # the block really is rematerialised
    for (path, g), rg in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(remat_grads)):
        assert_close(rg, g, 1e-5, err_msg=jax.tree_util.keystr(path))  # on each leaf's scale


def test_the_attention_policies_keep_blockwise_attention_from_running_twice(params):
    """The blockwise forward is one loop over query blocks per layer scan; a policy that
    saves attention's output and log-sum-exp leaves the backward pass without a rerun of it,
    as no remat does, while `full` reruns it."""
    toks = tokens(BLOCKWISE, 2, 17)

    def loops(policy):
        config = dataclasses.replace(BLOCKWISE, remat=policy)
        loss = lambda p: jnp.sum(llama_jax.forward(config, p, toks))  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(params["gqa"]).as_text().count("stablehlo.while")

    none = loops("none")
    assert loops("full") > none
    assert loops("attention") == loops("dots_with_attention") == none


def test_bf16_compute_with_fp32_params_equals_bf16_params(params):
    """fp32 master weights are cast to the compute dtype at use: the bf16 reference is the same
    model with its parameters stored in bf16, and the results are identical."""
    config = TINY.with_execution(compute_dtype="bfloat16")
    toks = tokens(TINY, 2, 16)
    out = forward(config, params["gqa"], toks)
    assert out.dtype == jnp.float32  # logits stay fp32 for the loss
    bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params["gqa"])
    stored = forward(TINY.with_execution(param_dtype="bfloat16", compute_dtype="bfloat16"), bf16,
                     toks)
    np.testing.assert_array_equal(out, stored)
    assert relative_error(out, forward(TINY, params["gqa"], toks)) > 1e-4  # bf16 really used


def test_bf16_params():
    config = dataclasses.replace(TINY, param_dtype="bfloat16", compute_dtype="bfloat16")
    p = llama_jax.init_params(config, jax.random.key(0))
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(p))
    assert np.isfinite(forward(config, p, tokens(config, 1, 8))).all()


def test_init_matches_the_description(params):
    for name, config in CONFIGS.items():
        specs = param_specs(config)
        shapes = jax.tree.map(lambda s: s.shape, specs, is_leaf=lambda s: hasattr(s, "axes"))
        assert jax.tree.map(lambda a: a.shape, params[name]) == shapes
        assert ("lm_head" not in params[name]) == config.tie_embeddings
    block = params["gqa"]["groups"][0]
    p = params["gqa"]
    np.testing.assert_array_equal(block["attn_norm"]["scale"], 1.0)
    assert float(jnp.std(block["attn"]["wq"])) == pytest.approx(TINY.init_std, rel=0.05)
    assert float(jnp.std(block["attn"]["wo"])) == pytest.approx(
        TINY.init_std / np.sqrt(2 * TINY.n_layers), rel=0.05)
    again = llama_jax.init_params(TINY, jax.random.key(0))
    chex.assert_trees_all_equal(p, again)
