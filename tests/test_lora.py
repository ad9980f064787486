"""Low-rank adapters (nn/lora.py): a matmul with an adapter is W plus (alpha/rank)·A·B against
float64; a fresh adapter (B = 0) computes the base model bit for bit, float or int8; the
model with adapters is the model with them merged; their gradients are the merged weight's
gradient through A·B; bad targets are named."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax.errors import ConfigError
from llama_jax.model.params import param_specs, quantize_params
from llama_jax.model.transformer import forward, unstack_layers
from llama_jax.nn.lora import Lora, init_adapters, merged, with_adapters
from llama_jax.nn.ops import dense
from models import MLA_TINY, SERVING, TINY, prompts, random_params

TARGETS = ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]


def f64(x) -> np.ndarray:
    return np.asarray(x, np.float64)


@pytest.mark.parametrize("equation, w_shape, n_in", [
    ("BTD,DNH->BTNH", (16, 4, 8), 1), ("BTNH,NHD->BTD", (4, 8, 16), 2)])
def test_a_matmul_with_an_adapter_is_the_weight_plus_its_low_rank_product(equation, w_shape,
                                                                          n_in):
    rng = np.random.default_rng(0)
    r, scale = 3, 2.5
    x = rng.standard_normal((2, 5, *w_shape[:n_in]))
    w, a, b = (rng.standard_normal(s) for s in (w_shape, (*w_shape[:n_in], r),
                                                (r, *w_shape[n_in:])))
    got = dense(equation, jnp.asarray(x, jnp.float32),
                Lora(*(jnp.asarray(v, jnp.float32) for v in (w, a, b)), scale, n_in))
    K, N = np.prod(w_shape[:n_in]), np.prod(w_shape[n_in:])
    w_eff = w.reshape(K, N) + scale * a.reshape(K, r) @ b.reshape(r, N)
    want = (x.reshape(-1, K) @ w_eff).reshape(*x.shape[:2], *w_shape[n_in:])
    np.testing.assert_allclose(f64(got), want, rtol=2e-5, atol=2e-5)


@pytest.fixture(scope="module")
def base():
    return random_params({"m": TINY})["m"]


def adapters_for(params, key=0, b_scale=0.0):
    """Adapters on every target, B drawn at random (× b_scale: 0 is a fresh adapter)."""
    adapters = init_adapters(params, param_specs(TINY), TARGETS, 4, jax.random.key(key))
    rng = np.random.default_rng(key)
    return {p: {"a": ab["a"], "b": jnp.asarray(b_scale * rng.standard_normal(ab["b"].shape),
                                               jnp.float32)} for p, ab in adapters.items()}


def test_a_fresh_adapter_computes_the_base_model_bit_for_bit(base):
    tokens = jnp.asarray(prompts([12, 12], seed=1))
    for config, params in ((TINY, base), quantize_params(TINY, base)):
        adapted = with_adapters(params, adapters_for(params), scale=2.0)
        np.testing.assert_array_equal(np.asarray(forward(config, adapted, tokens)),
                                      np.asarray(forward(config, params, tokens)))


@pytest.mark.parametrize("layout", ["stacked", "per_layer"])
def test_the_model_with_adapters_is_the_model_with_them_merged(base, layout):
    tokens = jnp.asarray(prompts([12, 12], seed=2))
    base = base if layout == "stacked" else unstack_layers(base)
    adapted = with_adapters(base, adapters_for(base, b_scale=0.05), scale=2.0)
    with_lora = f64(forward(TINY, adapted, tokens))
    folded = f64(forward(TINY, merged(adapted), tokens))
    plain = f64(forward(TINY, base, tokens))
    np.testing.assert_allclose(with_lora, folded, rtol=1e-4, atol=1e-4)
    assert np.abs(with_lora - plain).max() > 1e-2  # the adapters change the model


def test_adapter_gradients_are_the_merged_weights_gradient_through_a_and_b(base):
    """dL/dA = s·dL/dW·Bᵀ and dL/dB = s·Aᵀ·dL/dW at W + s·A·B, for a stacked weight: only A
    and B are differentiated (the base is a constant of the loss)."""
    tokens = jnp.asarray(prompts([12, 12], seed=3))
    adapters = adapters_for(base, b_scale=0.05)
    s = 2.0

    def loss_of_adapters(ad):
        return jnp.sum(forward(TINY, with_adapters(base, ad, s), tokens) ** 2) * 1e-3

    grads = jax.grad(loss_of_adapters)(adapters)
    path = "0/attn/wq"  # [L, D, N, H]: contracts D
    folded = merged(with_adapters(base, adapters, s))

    def loss_of_weight(w):
        params = {**folded, "groups": ({**folded["groups"][0], "attn": {
            **folded["groups"][0]["attn"], "wq": w}},)}
        return jnp.sum(forward(TINY, params, tokens) ** 2) * 1e-3

    g_w = f64(jax.grad(loss_of_weight)(folded["groups"][0]["attn"]["wq"]))  # [L, D, N, H]
    a, b = f64(adapters[path]["a"]), f64(adapters[path]["b"])  # [L, D, r], [L, r, N, H]
    np.testing.assert_allclose(f64(grads[path]["a"]),
                               s * np.einsum("ldnh,lrnh->ldr", g_w, b), rtol=2e-3, atol=2e-6)
    np.testing.assert_allclose(f64(grads[path]["b"]),
                               s * np.einsum("ldr,ldnh->lrnh", a, g_w), rtol=2e-3, atol=2e-6)


def test_bad_targets_and_ranks_are_named(base):
    specs = param_specs(TINY)
    with pytest.raises(ConfigError, match=r"lora.targets: 'w1' is not a weight of the model's "
                                          r"layers \(they have scale, w_down, w_gate"):
        init_adapters(base, specs, ["wq", "w1"], 4, jax.random.key(0))
    with pytest.raises(ConfigError, match=r"'scale' is not a matmul weight"):
        init_adapters(base, specs, ["scale"], 4, jax.random.key(0))
    with pytest.raises(ConfigError, match=r"lora.rank=0 must be >= 1"):
        init_adapters(base, specs, ["wq"], 0, jax.random.key(0))


def test_adapter_dropout_masks_the_adapters_inputs_and_keeps_their_mean():
    """With `dropout` p and a key, each input feature of the adapter's path is dropped with
    probability p and the rest scaled by 1/(1-p): the output over many keys averages to the
    undropped one, one key's output differs from it, and the base path is never dropped."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((6, 16)), jnp.float32)
    w, a, b = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((16, 8), (16, 4), (4, 8)))
    p, scale = 0.25, 2.0
    plain = f64(dense("MK,KN->MN", x, Lora(w, a, b, scale)))
    outs = np.stack([f64(dense("MK,KN->MN", x, Lora(w, a, b, scale, 1, jax.random.key(k), p)))
                     for k in range(400)])
    assert np.abs(outs[0] - plain).max() > 0.1
    delta = plain - f64(x) @ f64(w)
    # the mean of 400 masks: within a few standard errors of the undropped delta
    np.testing.assert_allclose(outs.mean(0), plain, atol=0.15 * np.abs(delta).max())
    same_key = f64(dense("MK,KN->MN", x, Lora(w, a, b, scale, 1, jax.random.key(0), p)))
    np.testing.assert_array_equal(same_key, outs[0])
    zero = Lora(w, a, jnp.zeros_like(b), scale, 1, jax.random.key(0), p)
    np.testing.assert_allclose(f64(dense("MK,KN->MN", x, zero)), f64(x) @ f64(w), rtol=1e-5,
                               atol=1e-5)


MOE_SHARED = dataclasses.replace(SERVING["moe"], moe=dataclasses.replace(
    SERVING["moe"].moe, n_shared_experts=1))


@pytest.mark.parametrize("config, targets", [
    (MLA_TINY, ["wq_nope", "wq_rope", "w_dkv", "w_kr", "w_uk", "w_uv", "wo", "w_up"]),
    (MOE_SHARED, ["wq", "wo", "w_gate", "w_up", "w_down"]),
    (MOE_SHARED.with_execution(moe_dispatch="dropless"), ["experts/w_up", "shared/w_down"]),
], ids=["mla", "moe-experts-and-shared", "moe-dropless"])
def test_mla_and_moe_layers_compute_their_adapters_as_merged_weights(config, targets):
    """MLA's projections, and a MoE's routed experts (an adapter each, batched or grouped
    like their weights) and shared experts: the model with adapters is the model with them
    merged. A path's end ("experts/w_up") names those weights alone."""
    params = random_params({"m": config})["m"]
    tokens = jnp.asarray(prompts([12, 12], seed=5, vocab=config.vocab_size))
    adapters = init_adapters(params, param_specs(config), targets, 4, jax.random.key(1))
    rng = np.random.default_rng(1)
    adapters = {p: {"a": ab["a"], "b": jnp.asarray(0.05 * rng.standard_normal(ab["b"].shape),
                                                   jnp.float32)}
                for p, ab in adapters.items()}
    if config.moe is not None:  # the routed experts' adapters are per expert: [L, E, ..]
        expert = next(ab for p, ab in adapters.items() if "/experts/" in p)
        assert expert["a"].shape[:2] == expert["b"].shape[:2] == (config.n_layers,
                                                                  config.moe.n_experts)
    adapted = with_adapters(params, adapters, scale=2.0)
    with_lora = f64(forward(config, adapted, tokens))
    np.testing.assert_allclose(with_lora, f64(forward(config, merged(adapted), tokens)),
                               rtol=1e-4, atol=1e-4)
    assert np.abs(with_lora - f64(forward(config, params, tokens))).max() > 1e-2


def test_moe_expert_adapters_compute_the_same_on_a_mesh():
    """The dropless experts run per device (shard_map): their adapters go in with their
    weights, and the sharded forward pass is the single-device one."""
    import functools

    import llama_jax
    from llama_jax.parallel import sharding

    config = MOE_SHARED.with_execution(moe_dispatch="dropless")
    params = random_params({"m": config})["m"]
    adapters = init_adapters(params, param_specs(config), ["experts/w_gate", "wq"], 4,
                             jax.random.key(2))
    rng = np.random.default_rng(2)
    adapters = {p: {"a": ab["a"], "b": jnp.asarray(0.05 * rng.standard_normal(ab["b"].shape),
                                                   jnp.float32)} for p, ab in adapters.items()}
    adapted = with_adapters(params, adapters, scale=2.0)
    tokens = jnp.asarray(prompts([12] * 4, seed=6, vocab=config.vocab_size))
    expected = f64(forward(config, adapted, tokens))
    mesh_config = llama_jax.MeshConfig(data=2, expert=2, tensor=2)
    mesh = sharding.make_mesh(mesh_config)
    with sharding.use_mesh(mesh, mesh_config):
        got = f64(jax.jit(functools.partial(forward, config))(adapted, tokens))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
