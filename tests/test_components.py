"""The component kit: every norm, position and MLP kind (alone and in combinations) runs through
the same checks — a float64 reference written from the papers' formulas, cached decode equal
to the full forward under both decode implementations, sharded equal to unsharded,
spec-derived parameter counts equal to the real leaves and to `costs`, and the loss falling
when overfitting one batch. A new component kind gets all of them by adding a config here.

Attention runs chunked (the CPU's `auto`) with blocks small enough that every check crosses
block boundaries; the float64 comparison runs under the dense `xla` path too."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax.plan import costs
from llama_jax.parallel import sharding
from llama_jax.config import MeshConfig, MlaConfig, ModelConfig, MoeConfig, RopeScaling
from llama_jax.errors import ConfigError
from llama_jax.model.kv_cache import init_cache
from llama_jax.model.transformer import apply, unstack_layers
from llama_jax.nn.heads import lm_head
from llama_jax.nn.norms import layer_norm, rms_norm
from llama_jax.nn.positions import sinusoids
from llama_jax.spec import spec_leaves
import reference as ref
from models import COMPONENTS_BASE as BASE, randomised_params as random_params
from reference import relative_error

# Each kind once against the LLaMA baseline, then the classic recipes and a few mixtures.
KINDS = {
    "llama": {},
    "layernorm": dict(norm="layernorm"),
    "post-norm": dict(norm_position="post"),
    "sinusoidal": dict(positions="sinusoidal"),
    "learned": dict(positions="learned"),
    "nope": dict(positions="none"),
    "geglu": dict(mlp="geglu"),
    "gelu": dict(mlp="gelu"),
    "gelu_tanh": dict(mlp="gelu_tanh"),
    "relu": dict(mlp="relu"),
    "bias": dict(bias=True),
    "transformer": dict(norm="layernorm", norm_position="post", positions="sinusoidal",
                        mlp="relu", bias=True, n_kv_heads=4, tie_embeddings=True,
                        embed_scale=True),
    "gpt2": dict(norm="layernorm", positions="learned", mlp="gelu_tanh", bias=True,
                 n_kv_heads=4, tie_embeddings=True),
    "mix-post-rms-geglu-learned": dict(norm_position="post", mlp="geglu", positions="learned",
                                       n_kv_heads=1),
    "mix-ln-nope-swiglu-bias": dict(norm="layernorm", positions="none", bias=True),
    # MoE: Mixtral's routing, on the dropless grouped matmuls and on capacity buffers (holding
    # every token: no capacity factor); DeepSeek-V3's (sigmoid with a selection bias, groups,
    # scaling, a shared expert, a dense first layer) with GeGLU experts of their own width.
    "moe-mixtral": dict(mlp="moe", moe=MoeConfig(n_experts=4, top_k=2)),
    "moe-mixtral-capacity": dict(mlp="moe", moe=MoeConfig(n_experts=4, top_k=2),
                                 moe_dispatch="capacity"),
    "moe-deepseek": dict(mlp="moe", moe=MoeConfig(
        n_experts=8, top_k=3, expert_mlp="geglu", expert_ffn_dim=24, n_shared_experts=1,
        router="sigmoid", routed_scaling=2.5, n_groups=4, top_k_groups=2, first_dense_layers=1)),
    # YaRN (its cos/sin temperature and softmax scale), past its original context of 8.
    "yarn": dict(rope_type="yarn", rope_scaling=RopeScaling(
        factor=4.0, original_max_position_embeddings=8, mscale_all_dim=0.5)),
    # MLA: the V2-Lite form (plain queries), and the V2/V3 form (a query latent) under YaRN
    # with DeepSeek's mscale = mscale_all_dim (the softmax scale's mscale²); value heads
    # narrower than query/key heads.
    "mla": dict(attention="mla", n_kv_heads=None, head_dim=None, mla=MlaConfig(
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=10)),
    "mla-qlora-yarn": dict(attention="mla", n_kv_heads=None, head_dim=None, mla=MlaConfig(
        q_lora_rank=20, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10),
        rope_type="yarn", rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=8,
                                                   mscale=0.707, mscale_all_dim=0.707)),
}
CONFIGS = {name: dataclasses.replace(BASE, **kw) for name, kw in KINDS.items()}
forward = jax.jit(llama_jax.forward, static_argnums=0)


@pytest.fixture(scope="module")
def params():
    return {name: random_params(c, i) for i, (name, c) in enumerate(CONFIGS.items())}


def tokens(config, batch, length, seed=0):
    return np.random.default_rng(seed).integers(0, config.vocab_size, (batch, length),
                                                dtype=np.int32)


@pytest.mark.parametrize("attention_impl", ["chunked", "xla"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_matches_the_float64_reference(name, attention_impl, params):
    config = CONFIGS[name].with_execution(attention_impl=attention_impl)
    toks = tokens(config, 2, 24, seed=1)
    segments = np.repeat([[1] * 10 + [2] * 14], 2, axis=0)
    positions = np.concatenate([np.arange(10), np.arange(14)])[None].repeat(2, 0)
    out = forward(config, params[name], toks, positions_BT=positions, segment_ids_BT=segments)
    expected = ref.forward(config, params[name], toks, positions, segments)
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("decode_impl", ["scan", "unrolled"])
@pytest.mark.parametrize("name", [*CONFIGS, "mla-qlora-yarn:expanded"])
def test_cached_decode_equals_the_full_forward(name, decode_impl, params):
    """Prefill a ragged (left-padded) batch, then decode one token per step: every position's
    logits equal those of the full forward pass of that row alone, computed by the float64
    reference (MLA: absorbed decode, and with `:expanded` the expanded one)."""
    name, _, mla_decode = name.partition(":")
    config, p = CONFIGS[name], params[name]
    if mla_decode:
        config = config.with_execution(mla_decode=mla_decode)
    lengths, T, steps = (9, 5), 9, 6
    rows = [tokens(config, 1, T + steps - 1, seed=10 + n)[0] for n in lengths]
    layers, layout = ((p, "stacked") if decode_impl == "scan" else
                      (unstack_layers(p), "per_layer"))
    start = np.array([T - n for n in lengths], np.int32)
    prompt = np.zeros((2, T), np.int32)
    for b, (row, n) in enumerate(zip(rows, lengths)):
        prompt[b, T - n:] = row[:n]
    cache = init_cache(config, 2, T + steps, start_B=jnp.asarray(start), layout=layout)
    h, cache, _ = cached(config, layers, prompt, cache)
    logits = [lm_head(config, p, h)[:, -1]]
    for t in range(steps - 1):
        step_tokens = np.array([[row[n + t]] for row, n in zip(rows, lengths)], np.int32)
        h, cache, _ = cached(config, layers, step_tokens, cache)
        logits.append(lm_head(config, p, h)[:, -1])
    got = np.stack(logits, axis=1)
    for b, (row, n) in enumerate(zip(rows, lengths)):
        full = ref.forward(config, p, row[None, :n + steps - 1])[0, n - 1:]
        assert relative_error(got[b], full) < 1e-5, b


cached = jax.jit(lambda c, p, toks, cache: apply(c, p, toks, cache=cache), static_argnums=0)


@pytest.mark.parametrize("name", ["transformer", "gpt2", "mix-post-rms-geglu-learned",
                                  "moe-deepseek", "mla-qlora-yarn"])
def test_greedy_generation_is_the_same_under_both_decode_implementations(name, params):
    config, p = CONFIGS[name], params[name]
    prompts = [tokens(config, 1, n, seed=n)[0].tolist() for n in (3, 11, 6)]
    outs = {impl: llama_jax.generate(config, p, prompts, 10, stop_tokens=[], decode_impl=impl,
                                     return_logprobs=True) for impl in ("scan", "unrolled")}
    assert outs["scan"][0] == outs["unrolled"][0]
    np.testing.assert_allclose(np.array(outs["scan"][1]), np.array(outs["unrolled"][1]),
                               rtol=1e-5, atol=1e-5)


MESHES = {"dp8": MeshConfig(data=8), "fsdp8": MeshConfig(data=1, fsdp=8),
          "tp4-dp2": MeshConfig(data=2, tensor=4), "ep4-dp2": MeshConfig(data=2, expert=4)}
SHARDED = ([(name, mesh) for name in ("transformer", "gpt2", "mix-ln-nope-swiglu-bias")
            for mesh in ("dp8", "fsdp8", "tp4-dp2")]
           + [("moe-mixtral", "fsdp8"), ("moe-mixtral-capacity", "ep4-dp2"),
              ("moe-deepseek", "ep4-dp2"), ("moe-deepseek", "tp4-dp2"),
              ("mla-qlora-yarn", "tp4-dp2"), ("mla", "fsdp8")])


@pytest.mark.parametrize("name, mesh_name", SHARDED)
def test_sharded_forward_equals_unsharded(name, mesh_name, params):
    config, mesh_config = CONFIGS[name], MESHES[mesh_name]
    mesh = sharding.make_mesh(mesh_config)
    shardings = sharding.param_shardings(llama_jax.param_specs(config), mesh, mesh_config)
    placed = jax.device_put(params[name], shardings)
    toks = tokens(config, 8, 16, seed=3)
    with sharding.use_mesh(mesh, mesh_config):
        out = jax.jit(llama_jax.forward, static_argnums=0)(config, placed, toks)
    assert relative_error(out, forward(config, params[name], toks)) < 1e-5


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_counts_from_the_specs_equal_the_leaves(name, params):
    config = CONFIGS[name]
    leaves = sum(x.size for x in jax.tree.leaves(params[name]))
    specs = llama_jax.param_specs(config)
    assert sum(s.size for s in spec_leaves(specs)) == leaves == costs.param_counts(config).total
    abstract = llama_jax.abstract_params(config)
    assert jax.tree.map(lambda a: a.shape, abstract) == jax.tree.map(lambda a: a.shape,
                                                                     params[name])


def test_default_mlp_widths_keep_parameters_equal_across_kinds():
    """Gated MLPs default to 2/3 of the plain MLPs' 4·D (Shazeer 2020): ~8·D² either way."""
    sizes = {}
    for mlp in ("swiglu", "geglu", "gelu", "relu"):
        config = ModelConfig(vocab_size=256, dim=768, n_layers=1, n_heads=12, mlp=mlp,
                             multiple_of=1)
        sizes[mlp] = costs.param_counts(config).matmul
        assert config.ffn_dim == (4 * 768 if mlp in ("gelu", "relu") else 2048)
    assert len(set(sizes.values())) == 1


@pytest.mark.parametrize("mlp, bias, remat, platform", [
    ("swiglu", False, "full", "cpu"), ("geglu", True, "dots_no_batch", "cpu"),
    ("swiglu", False, "full", "gpu"), ("geglu", True, "dots_no_batch", "gpu")])
def test_a_gated_mlps_gradients_are_the_float64_ones(mlp, bias, remat, platform, monkeypatch):
    """The gated MLP runs under its own backward rule (`nn.mlp._glu_down`, the hidden state
    written beside both gradients): its gradients for every weight, bias and the input, against
    float64 ones of the plain expression, with the up matmuls recomputed or saved. Traced for a
    GPU, a few tokens' gate and up are one matmul over both matrices (`nn.mlp._merges`)."""
    from llama_jax.model.params import init_params
    from llama_jax.nn.mlp import MLPS, apply_mlp
    from llama_jax.parallel import target
    monkeypatch.setattr(target, "platform", lambda: platform)
    config = ModelConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2, ffn_dim=24, mlp=mlp,
                         bias=bias, remat=remat)
    p = jax.tree.map(lambda w: w[0], init_params(config, jax.random.key(0))["groups"][0]["mlp"])
    p = jax.tree.map(lambda w: w + 0.1 * jax.random.normal(jax.random.key(1), w.shape), p)
    x = jax.random.normal(jax.random.key(2), (2, 3, 16))
    grads = jax.grad(lambda p, x: jnp.sum(jnp.sin(apply_mlp(config, p, x))), (0, 1))(p, x)
    forward = str(jax.make_jaxpr(lambda p, x: apply_mlp(config, p, x))(p, x))  # nested too
    assert forward.count("dot_general[") == (2 if platform == "gpu" else 3), forward

    def plain(p, x):  # float64 autodiff of the plain expression
        hidden = MLPS[mlp].activation(x @ p["w_gate"] + p.get("b_gate", 0)) * (
            x @ p["w_up"] + p.get("b_up", 0))
        return jnp.sum(jnp.sin(hidden @ p["w_down"] + p.get("b_down", 0)))
    with jax.enable_x64():
        p64, x64 = jax.tree.map(lambda a: np.asarray(a, np.float64), (p, x))
        want = jax.grad(plain, (0, 1))(p64, x64)
    wanted = dict(jax.tree_util.tree_leaves_with_path(want))
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        assert relative_error(got, wanted[path]) < 1e-5, jax.tree_util.keystr(path)


def test_the_published_gpt2_small_parameter_count():
    assert costs.param_counts(llama_jax.load_model_config("gpt2-small")).total == 124_439_808


@pytest.mark.parametrize("name", ["transformer", "gpt2", "nope", "moe-mixtral"])
def test_loss_falls_when_overfitting_one_batch(name):
    import optax

    config = CONFIGS[name]
    p = llama_jax.init_params(config, jax.random.key(0))
    batch = tokens(config, 4, 17, seed=5)
    optimizer = optax.adam(3e-3)

    @jax.jit
    def step(p, opt_state):
        def loss(p):
            logits = llama_jax.forward(config, p, batch[:, :-1])
            logp = jax.nn.log_softmax(logits)
            return -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1).mean()
        value, grads = jax.value_and_grad(loss)(p)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(p, updates), opt_state, value

    opt_state = optimizer.init(p)
    losses = []
    for _ in range(80):
        p, opt_state, value = step(p, opt_state)
        losses.append(float(value))
    assert losses[0] == pytest.approx(np.log(config.vocab_size), abs=0.5)
    assert losses[-1] < 0.3 * losses[0]


# ---------------------------------------------------------------- the components' own formulas

def test_sinusoids_match_vaswani():
    positions = np.array([[0, 1, 7, 63, 500]])
    for dim in (48, 7):
        assert relative_error(sinusoids(dim, positions), ref.sinusoids(positions, dim)) < 1e-6


@pytest.mark.parametrize("mlp", ["swiglu", "geglu", "gelu", "gelu_tanh", "relu"])
def test_mlp_kinds_match_their_formulas(mlp):
    """Pre-activations of order 3, where GELU's erf and tanh forms differ by ~1e-3."""
    from llama_jax.nn.mlp import apply_mlp

    config = dataclasses.replace(BASE, mlp=mlp, bias=True)
    p = random_params(config, 7)["groups"][0]["mlp"]
    p = jax.tree.map(lambda w: w[0] * (20.0 if w.ndim == 3 else 1.0), p)  # layer 0, large
    x = np.random.default_rng(3).standard_normal((2, 5, BASE.dim))
    act = ref.ACTIVATIONS[mlp]
    w = {k: np.asarray(v, np.float64) for k, v in p.items()}
    up = x @ w["w_up"] + w["b_up"]
    hidden = act(x @ w["w_gate"] + w["b_gate"]) * up if "w_gate" in w else act(up)
    want = hidden @ w["w_down"] + w["b_down"]
    # float32 against float64 with weights x20: the matmuls' rounding (measured 3e-7) is
    # relative to their large terms; GELU's erf and tanh forms differ by 1e-4 here
    assert relative_error(apply_mlp(config, p, jnp.asarray(x, jnp.float32)), want) < 1e-5


def test_layer_norm_matches_ba_et_al():
    rng = np.random.default_rng(0)
    x = 3 * rng.standard_normal((3, 5, 64)) + 2
    g, b = rng.standard_normal(64), rng.standard_normal(64)
    out = layer_norm(jnp.asarray(x, jnp.float32), g, b, 1e-5)
    assert relative_error(out, ref.layer_norm(x, g, b, 1e-5)) < 1e-6


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_norm_statistics_are_fp32_under_bf16(norm):
    """bf16 inputs: the result is the fp32-statistics value rounded to bf16 (within one bf16
    ulp) — statistics in bf16 (or a bf16 mean of squares) are off by many ulps."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((8, 512)) * 3 + 40).astype(np.float32)  # a large mean
    x16 = jnp.asarray(x, jnp.bfloat16)
    x32 = np.asarray(x16, np.float64)
    ones, zeros = np.ones(512, np.float32), np.zeros(512, np.float32)
    if norm == "rmsnorm":
        out = rms_norm(x16, jnp.asarray(ones, jnp.bfloat16), 1e-5)
        want = ref.rms_norm(x32, ones, 1e-5)
    else:
        out = layer_norm(x16, jnp.asarray(ones, jnp.bfloat16), jnp.asarray(zeros, jnp.bfloat16),
                         1e-5)
        want = ref.layer_norm(x32, ones, zeros, 1e-5)
    ulp = np.abs(np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64)) * 2.0 ** -7
    assert np.all(np.abs(np.asarray(out, np.float64) - want) <= ulp + 1e-30)


# ---------------------------------------------------------------- config values

@pytest.mark.parametrize("fields, message", [
    (dict(positions="sinusoidal", rope_theta=500000.0),
     "rope_theta=500000.0 applies only to positions 'rope', not 'sinusoidal'"),
    (dict(positions="learned", rope_type="llama3"), "rope_type='llama3' applies only"),
    (dict(norm="batchnorm"), "norm='batchnorm' is not one of"),
    (dict(mlp="swish"), "mlp='swish' is not one of"),
    (dict(positions="alibi"), "positions='alibi' is not one of"),
    (dict(norm_position="sandwich"), "norm_position='sandwich' is not one of"),
    (dict(bias="yes"), "bias='yes' must be true or false"),
])
def test_bad_component_values_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(BASE, **fields)


def test_every_value_is_one_set_away():
    run = llama_jax.load_run_config("demo", ["model.norm=layernorm", "model.norm_position=post",
                                             "model.positions=learned", "model.mlp=gelu",
                                             "model.bias=true"])
    m = run.model
    assert (m.norm, m.norm_position, m.positions, m.mlp, m.bias) == (
        "layernorm", "post", "learned", "gelu", True)
    assert m.rope_theta is None and m.ffn_dim == 768  # demo's explicit width stays
    with pytest.raises(ConfigError, match="rope_theta=500000.0 applies only"):
        llama_jax.load_run_config("llama3-8b", ["model.positions=sinusoidal"])


def test_architecture_and_execution_are_apart():
    a = BASE.with_execution(compute_dtype="bfloat16", remat="full", scan_layers=False)
    assert a.architecture() == BASE.architecture() and a != BASE
    assert "compute_dtype" not in BASE.architecture() and "norm" in BASE.architecture()
    with pytest.raises(ConfigError, match="dim=.* is not an execution setting"):
        BASE.with_execution(dim=8)


@pytest.mark.parametrize("dtype", [jnp.float32, np.float32, jnp.bfloat16, "float16",
                                   jnp.dtype("bfloat16")])
def test_dtype_arguments_accept_any_dtype_like(dtype):
    name = jnp.dtype(dtype).name
    assert dataclasses.replace(BASE, param_dtype=dtype).param_dtype == name
    assert init_cache(BASE, 1, 4, dtype).groups[0].k.dtype == jnp.dtype(dtype)


def test_a_misspelt_logical_axis_is_an_error_not_a_silent_replication():
    from llama_jax.spec import TensorSpec

    mesh_config = MeshConfig(data=1, fsdp=8)
    mesh = sharding.make_mesh(mesh_config)
    specs = {"w": TensorSpec("DF", (48, 64), ("embd", "mlp"))}
    with pytest.raises(ValueError, match=r"\['embd'\] are not weight axes"):
        sharding.param_shardings(specs, mesh, mesh_config)


def test_scan_decoding_of_unstacked_parameters_is_refused(params):
    config = CONFIGS["llama"]
    with pytest.raises(llama_jax.GenerateError, match="decode_impl='scan' needs stacked"):
        llama_jax.generate(config, unstack_layers(params["llama"]), [[1, 2]], 2,
                           decode_impl="scan")


def test_positions_with_a_cache_are_refused(params):
    config = CONFIGS["llama"]
    cache = init_cache(config, 1, 8)
    with pytest.raises(ValueError, match="positions and the mask come from the cache"):
        apply(config, params["llama"], np.zeros((1, 2), np.int32), cache=cache,
              positions_BT=np.zeros((1, 2), np.int32))


@pytest.mark.parametrize("name", ["llama3-8b", "tiny-llama3.2", "llama2-70b", "gpt2-small"])
def test_the_architecture_survives_the_hf_config_file(name, tmp_path):
    """What an exported config.json reads back as: init-only fields (multiple_of,
    ffn_dim_multiplier, init_std) are not architecture, so the resolved ffn_dim is enough."""
    import json

    from llama_jax.formats import hf

    config = llama_jax.load_model_config(name)
    (tmp_path / hf.CONFIG).write_text(json.dumps(hf.hf_config(config)))
    assert hf.read_config(tmp_path).architecture() == config.architecture()


def test_a_run_with_llama3_rope_scaling_resumes(tmp_path):
    from llama_jax.formats import workdir

    run = llama_jax.load_run_config("tiny-llama3.2")
    assert workdir.config_differences(run, run) == []
    changed = llama_jax.load_run_config("tiny-llama3.2", ["model.compute_dtype=bfloat16",
                                                          "model.remat=full",
                                                          "model.init_std=0.01"])
    assert workdir.config_differences(run, changed) == []
    other = llama_jax.load_run_config("tiny-llama3.2", ["model.norm=layernorm"])
    assert workdir.config_differences(run, other) == ["model.norm: 'rmsnorm' -> 'layernorm'"]


README_EXAMPLE_CHECK = """
import re, sys
import numpy as np
import jax
sys.path.insert(0, {tests!r})
readme = open({readme!r}).read()
section = readme.split("## Adding a component", 1)[1].split("\\n## ", 1)[0]
exec(re.search(r"```python\\n(.*?)```", section, re.S).group(1), {{}})

import llama_jax
import reference as ref
from llama_jax.config import ModelConfig
from llama_jax.plan import costs
from models import COMPONENTS_BASE as BASE, randomised_params as random_params
from reference import relative_error

# ScaleNorm from the paper, in float64: g * sqrt(D) * x / ||x||.
ref.NORMS["scalenorm"] = lambda x, p, eps: p["scale"] * np.sqrt(x.shape[-1]) * x / np.sqrt(
    np.sum(x * x, axis=-1, keepdims=True) + eps)
config = ModelConfig(**{{**BASE.__dict__, "norm": "scalenorm"}})
params = random_params(config)
assert params["final_norm"]["scale"].shape == ()
tokens = np.random.default_rng(3).integers(0, config.vocab_size, (2, 24), dtype=np.int32)
out = jax.jit(llama_jax.forward, static_argnums=0)(config, params, tokens)
assert relative_error(out, ref.forward(config, params, tokens)) < 1e-5
leaves = sum(x.size for x in jax.tree.leaves(params))
assert costs.param_counts(config).total == leaves == costs.param_counts(BASE).total - (
    2 * BASE.n_layers + 1) * (BASE.dim - 1)
greedy = llama_jax.generate(config, params, [list(tokens[0, :5])], 6)
expected = list(tokens[0, :5])
for _ in range(6):
    expected.append(int(np.argmax(ref.forward(config, params, np.array([expected]))[0, -1])))
assert greedy == [expected[5:]], (greedy, expected)
print("ok")
"""


def test_the_readme_example_adds_a_norm_kind_in_one_place():
    """The README's "Adding a component" block, run as written in a fresh process: the
    registered kind is a config choice, and the model, its counts and greedy decoding follow
    (against a float64 reference of the paper's formula)."""
    import subprocess
    import sys
    from pathlib import Path
    tests = Path(__file__).resolve().parent
    code = README_EXAMPLE_CHECK.format(tests=str(tests), readme=str(tests.parent / "README.md"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_an_unregistered_kind_is_an_error_naming_the_registered_ones():
    for field in ("norm", "positions", "mlp", "attention", "head"):
        with pytest.raises(ConfigError, match=rf"{field}='nonesuch' is not one of \("):
            dataclasses.replace(BASE, **{field: "nonesuch"})
    with pytest.raises(ConfigError, match=r"moe.router='nonesuch' is not one of \('softmax'"):
        MoeConfig(router="nonesuch")
