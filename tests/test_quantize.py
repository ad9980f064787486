"""int8 weights and KV cache: the quantizer's error bound, the quantized forward against the float
forward on the dequantized weights (the matmul formulations) and on the original ones (the
quantization error), every loader's quantize-as-you-read against quantizing the loaded model,
native save and load, int8-cache decode against a float cache of the dequantized entries and
against the full forward, cache bytes against the formula, sharded quantized decode, peak
memory while loading, and the refusals."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax.config import (DataConfig, MeshConfig, MlaConfig, ModelConfig, MoeConfig,
                              RunConfig, TrainConfig)
from llama_jax.errors import CheckpointError, ConfigError
from llama_jax.model.kv_cache import init_cache
from llama_jax.model.params import flat_paths, quantize_params
from llama_jax.model.transformer import apply, unstack_layers
from llama_jax.nn.attention import kv_storage
from llama_jax.nn.heads import lm_head
from llama_jax.parallel import sharding
from llama_jax.plan import costs
from llama_jax.quant import INT8_MAX, Int8, is_int8, to_int8, to_int8_vectors
from llama_jax.training import trainer
from reference import assert_close, relative_error

MODELS = {
    "gqa": ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       ffn_dim=96, max_seq_len=64),
    "tied-bias": ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=96,
                             max_seq_len=64, tie_embeddings=True, bias=True, mlp="gelu"),
    "mla": ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=96,
                       max_seq_len=64, attention="mla", mla=MlaConfig(
                           q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                           qk_rope_head_dim=8, v_head_dim=16)),
    "moe": ModelConfig(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2,
                       ffn_dim=96, max_seq_len=64, mlp="moe", moe=MoeConfig(
                           n_experts=4, top_k=2, n_shared_experts=1, first_dense_layers=1)),
}


def random_params(config, seed=0):
    """Weights larger than the init (std 0.1, gains near 1): decisive logits and routers."""
    params = llama_jax.init_params(config, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(treedef, [
        jnp.asarray(1 + 0.1 * rng.standard_normal(w.shape) if np.all(np.asarray(w) == 1) else
                    0.1 * rng.standard_normal(w.shape), w.dtype) for w in leaves])


def dequantized(params):
    return jax.tree.map(lambda w: w.dequantize() if is_int8(w) else w, params, is_leaf=is_int8)


def tokens(batch=2, length=16, seed=1):
    return np.random.default_rng(seed).integers(0, 256, (batch, length))


@pytest.mark.parametrize("shape, axes", [((48, 40), (0,)), ((8, 6, 5, 7), (1, 2)),
                                         ((3, 16, 12), (1,))])
def test_quantize_error_is_at_most_half_a_step(shape, axes):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    w[(0,) * len(shape)] = 0.0
    q = to_int8(w, axes)
    assert q.values.dtype == np.int8 and q.scale.shape == tuple(
        1 if a in axes else n for a, n in enumerate(shape))
    np.testing.assert_allclose(q.scale, np.abs(w).max(axis=axes, keepdims=True) / INT8_MAX,
                               rtol=2e-7)  # times the rounded reciprocal
    assert np.abs(q.values).max() == INT8_MAX  # each channel's largest value uses the range
    err = np.abs(q.values * q.scale - w)
    assert np.all(err <= q.scale / 2 * (1 + 1e-6))
    jq = to_int8(jnp.asarray(w), axes)  # the same code in jit and on the host
    np.testing.assert_array_equal(np.asarray(jq.values), q.values)
    np.testing.assert_array_equal(np.asarray(jq.scale), q.scale)


def test_an_all_zero_channel_quantizes_to_zero():
    q = to_int8(np.zeros((4, 3), np.float32), (0,))
    assert np.all(q.values == 0) and np.all(q.dequantize() == 0)


@pytest.mark.parametrize("name, head", [(name, False) for name in MODELS] + [
    ("gqa", True), ("tied-bias", True), ("mla", True)])
def test_quantized_forward_equals_the_forward_on_dequantized_weights(name, head):
    """The matmuls that take int8 values and scales compute the float model of the
    dequantized weights: the scales go on the right side of every matmul."""
    config = MODELS[name]
    params = random_params(config)
    qconfig, qparams = quantize_params(config, params, head=head)
    quantized = [path for path, w in flat_paths(jax.tree.map(
        lambda w: "int8" if is_int8(w) else "float", qparams, is_leaf=is_int8)).items()
        if w == "int8"]
    assert any("attn" in p for p in quantized) and any("mlp" in p for p in quantized)
    assert ("embed/table" in quantized) == head and not any("router" in p for p in quantized)
    toks = tokens()
    out = np.asarray(llama_jax.forward(qconfig, qparams, toks))
    ref = np.asarray(llama_jax.forward(config, dequantized(qparams), toks))
    assert_close(out, ref, 1e-5)
    # and within int8's error of the float model: ~0.4% per weight, summed over the layers
    assert_close(out, np.asarray(llama_jax.forward(config, params, toks)), 0.05)


@pytest.mark.parametrize("equation, shape", [("MK,KN->MN", (3, 512)),
                                             ("BTK,KN->BTN", (2, 5, 1024))])
def test_int8_matmul_in_k_slices_equals_the_dequantized_one(equation, shape):
    """On CPU an int8 weight with K a multiple of CPU_INT8_SLICE (beyond one slice) is widened
    and multiplied a slice of rows at a time, in a scan: the matmul with the dequantized
    weight, to fp32 rounding."""
    from llama_jax.nn import ops

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    w = to_int8(rng.standard_normal((shape[-1], 96)).astype(np.float32), (0,))
    assert shape[-1] % ops.CPU_INT8_SLICE == 0 < shape[-1] // ops.CPU_INT8_SLICE - 1
    assert "scan" in str(jax.make_jaxpr(lambda x: ops.dense(equation, x, w))(x))
    assert_close(ops.dense(equation, x, w), x @ w.dequantize(), 1e-5)


def test_mla_absorbed_decode_scales_the_query_side():
    """W_UK [Z, N, J] has a scale per (N, J), the output channels of c·W_UK; absorbed decode
    contracts it along J, across its scales, so they multiply the query instead. Cached
    decode equals the expanded form and the full forward (causal: one pass over the prompts
    and the generated tokens gives each step's logits)."""
    config = MODELS["mla"]
    qconfig, qparams = quantize_params(config, random_params(config))
    prompts = tokens(2, 9).tolist()
    greedy = llama_jax.generate(qconfig, qparams, prompts, 6, stop_tokens=[])
    expanded = llama_jax.generate(qconfig.with_execution(mla_decode="expanded"), qparams,
                                  prompts, 6, stop_tokens=[])
    assert greedy == expanded
    full = np.concatenate([prompts, greedy], axis=1)
    logits = np.asarray(llama_jax.forward(qconfig, qparams, full[:, :-1]))
    assert logits[:, 8:].argmax(-1).tolist() == greedy


KV_CASES = {"gqa": MODELS["gqa"], "mla": MODELS["mla"],
            "mla-expanded": MODELS["mla"].with_execution(mla_decode="expanded"),
            "moe": MODELS["moe"]}


def decode_logits(config, params, toks, cache_dtype, layout, prefill=7):
    """Logits of a prefill of `prefill` tokens, then of one token per step, through a cache."""
    step = jax.jit(lambda p, t, cache: apply(config, p, t, cache=cache)[:2])
    layers = params if layout == "stacked" else unstack_layers(params)
    cache = init_cache(config, toks.shape[0], toks.shape[1], cache_dtype, layout=layout)
    h, cache = step(layers, toks[:, :prefill], cache)
    hs = [h]
    for t in range(prefill, toks.shape[1]):
        h, cache = step(layers, toks[:, t:t + 1], cache)
        hs.append(h)
    return np.asarray(lm_head(config, params, jnp.concatenate(hs, axis=1)))


@pytest.mark.parametrize("layout", ["stacked", "per_layer"])
@pytest.mark.parametrize("case", list(KV_CASES))
def test_int8_kv_cache_decode(case, layout, monkeypatch):
    """An int8 cache computes what a float cache holding its dequantized entries computes
    (the scales go on the scores and the probabilities), within fp32 rounding; and stays within
    the stated bound of the float model's full forward: 1% relative error of the logits (each
    cached vector is off by at most 1/254 of its largest entry)."""
    config = KV_CASES[case]
    params = random_params(config)
    toks = tokens(2, 12, seed=3)
    got = decode_logits(config, params, toks, "int8", layout)
    write = kv_storage.write
    monkeypatch.setattr(kv_storage, "write", lambda cache, x, start, dtype, **rows: write(
        cache, to_int8_vectors(x).dequantize(x.dtype), start, dtype, **rows))
    assert_close(got, decode_logits(config, params, toks, "float32", layout), 1e-5)
    monkeypatch.undo()
    full = np.asarray(llama_jax.forward(config, params, toks))
    assert relative_error(got, full) < 0.01


@pytest.mark.parametrize("case", ["gqa", "mla"])
def test_int8_cache_bytes_equal_the_formula(case):
    """A byte per cached value and a float32 scale per vector (per token and KV head, for keys
    and values; per token's latent), in both layouts."""
    config = KV_CASES[case]
    stacked = init_cache(config, batch=3, max_len=40, dtype="int8").groups
    per_layer = init_cache(config, batch=3, max_len=40, dtype="int8", layout="per_layer").groups
    for layout in (stacked, per_layer):
        leaves = jax.tree.leaves(layout)
        assert {x.dtype for x in leaves} == {jnp.dtype(jnp.int8), jnp.dtype(jnp.float32)}
        assert sum(x.nbytes for x in leaves) == costs.kv_cache_bytes_per_token(
            config, "int8") * 3 * 40
    values = 2 * config.K * config.H if case == "gqa" else 32 + 8
    assert costs.kv_cache_bytes_per_token(config, "int8") == config.L * (
        values + 4 * (2 * config.K if case == "gqa" else 1))


@pytest.mark.parametrize("case", ["gqa", "llama3.1-tied"])
def test_perplexity_of_tiny_checkpoints_within_the_stated_bounds(case, tmp_path):
    """On the interop tests' tiny transformers checkpoints, loaded as bf16, perplexity of random
    text moves by less than 1% under int8 weights, 0.5% under an int8 KV cache, 1.5% under both
    (measured: under 0.1% each)."""
    from checkpoints import hf_model

    hf_model(case).save_pretrained(tmp_path)
    documents = (tokens(8, 96, seed=5) % 128).tolist()  # the checkpoints have V = 128
    ppl = {}
    for quantize in (None, "int8"):
        config, params = llama_jax.load_checkpoint(tmp_path, "bfloat16", quantize=quantize)
        for cache_dtype in ("bfloat16", "int8"):
            scored = llama_jax.perplexity(config, params, documents, window=96,
                                          cache_dtype=cache_dtype)
            ppl[quantize, cache_dtype] = np.exp(sum(p.nll for p in scored) / (8 * 95))
    change = {k: abs(v / ppl[None, "bfloat16"] - 1) for k, v in ppl.items()}
    assert change["int8", "bfloat16"] < 0.01 and change[None, "int8"] < 0.005
    assert change["int8", "int8"] < 0.015
    assert change["int8", "bfloat16"] > 0 and change[None, "int8"] > 0  # both applied


@pytest.mark.parametrize("name", ["moe", "tied-bias"])
def test_the_planner_counts_int8_values_and_scales(name, capsys, tmp_path):
    """Weight bytes equal the quantized model's arrays; the decode floor reads them (at batch
    1 the top_k of E experts, the embedding's one row) and the int8 cache; `info` reports
    both."""
    from llama_jax.plan import info

    config = MODELS[name]
    qconfig, qparams = quantize_params(config, random_params(config), head=True)
    assert costs.weight_bytes(qconfig, "float32") == sum(
        x.nbytes for x in jax.tree.leaves(qparams))
    specs = llama_jax.param_specs(qconfig)
    assert costs.decode_bytes_per_step(qconfig, 1, 10, "float32", "int8") == round(sum(
        costs.stored_bytes(s, "float32") * s.used for s in jax.tree.leaves(specs))
        - (0 if config.tie_embeddings else costs.stored_bytes(specs["embed"]["table"], "float32")
           * (1 - 1 / config.V))) + 10 * costs.kv_cache_bytes_per_token(config, "int8")
    path = tmp_path / "model.yaml"
    path.write_text(json.dumps({"model": config.to_dict()}))  # JSON is YAML
    assert info.main([str(path), "--quantize", "int8", "--quantize-head", "--cache-dtype",
                      "int8", "--dtype", "float32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weight_bytes_quantized"] == costs.weight_bytes(qconfig, "float32")
    assert out["kv_cache_bytes_per_token"] == costs.kv_cache_bytes_per_token(config, "int8")


@pytest.mark.parametrize("fmt", ["hf", "meta", "native", "run"])
def test_quantizing_while_loading_equals_quantizing_the_loaded_model(fmt, tmp_path,
                                                                      corpus_dir):
    from checkpoints import hf_model, write_meta

    if fmt in ("hf", "meta"):
        model = hf_model("gqa")
        model.save_pretrained(tmp_path / "hf")
        path = tmp_path / "hf"
        if fmt == "meta":
            write_meta(model, tmp_path / "meta")
            path = tmp_path / "meta"
    elif fmt == "native":
        config = MODELS["gqa"]
        llama_jax.save_native(config, random_params(config), tmp_path / "native")
        path = tmp_path / "native"
    else:
        path = tmp_path / "run"
        model = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            ffn_dim=96, max_seq_len=64)  # a tokenizer of the corpus needs 512
        run = RunConfig(model=model, data=DataConfig(corpus=str(corpus_dir)),
                        train=TrainConfig(seq_len=16, batch_size=8, steps=2, warmup_steps=1,
                                          log_every=1, eval_every=2, eval_batches=1,
                                          checkpoint_every=2))
        trainer.train(run, path, log=lambda _: None, progress=False)
    config, params = llama_jax.load_checkpoint(path, dtype="bfloat16")
    expected_config, expected = quantize_params(config, params, "int8", head=True)
    got_config, got = llama_jax.load_checkpoint(path, dtype="bfloat16", quantize="int8",
                                                quantize_head=True)
    assert got_config == expected_config
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_quantized_model_saves_and_loads_natively(tmp_path):
    config = MODELS["moe"]
    qconfig, qparams = quantize_params(config, random_params(config), head=True)
    llama_jax.save_native(qconfig, qparams, tmp_path / "q")
    loaded_config, loaded = llama_jax.load_checkpoint(tmp_path / "q")
    assert loaded_config == qconfig
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(qparams)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the same again when asked for it; another quantization is refused, naming both
    assert llama_jax.load_checkpoint(tmp_path / "q", quantize="int8",
                                     quantize_head=True)[0] == qconfig
    with pytest.raises(CheckpointError, match="stored with quantize=int8, quantize_head=True"):
        llama_jax.load_checkpoint(tmp_path / "q", quantize="int8")


@pytest.mark.parametrize("decode_impl", ["scan", "unrolled"])
def test_sharded_quantized_decode_equals_unsharded(decode_impl, tmp_path):
    config = MODELS["gqa"].with_execution()
    llama_jax.save_native(config, random_params(config), tmp_path / "m")
    qconfig, plain = llama_jax.load_checkpoint(tmp_path / "m", quantize="int8",
                                               quantize_head=True)
    rules = MeshConfig(data=2, fsdp=2, tensor=2)
    mesh = sharding.make_mesh(rules)
    _, placed = llama_jax.load_checkpoint(tmp_path / "m", quantize="int8", quantize_head=True,
                                          mesh=mesh, mesh_config=rules)
    wq = placed["groups"][0]["attn"]["wq"]
    assert isinstance(wq, Int8) and len(wq.values.sharding.device_set) == 8
    assert wq.values.sharding.shard_shape(wq.values.shape) != wq.values.shape  # really split
    prompts = [list(np.random.default_rng(i).integers(3, 256, n)) for i, n in
               enumerate((5, 11, 3, 8))]
    expected = llama_jax.generate(qconfig, plain, prompts, 10, stop_tokens=[],
                                  decode_impl=decode_impl, cache_dtype="int8")
    assert llama_jax.generate(qconfig, placed, prompts, 10, stop_tokens=[], cache_dtype="int8",
                              decode_impl=decode_impl, mesh_config=rules) == expected


@pytest.mark.parametrize("save", [llama_jax.save_native, llama_jax.export_hf])
def test_quantizing_while_loading_places_every_leaf_on_the_mesh(save, tmp_path):
    """Int8 values and scales go into their own shardings, from any format."""
    config = MODELS["gqa"].with_execution()
    save(config, random_params(config), tmp_path / "m")
    rules = MeshConfig(data=2, fsdp=2, tensor=2)
    mesh = sharding.make_mesh(rules)
    qconfig, placed = llama_jax.load_checkpoint(tmp_path / "m", quantize="int8",
                                                quantize_head=True, mesh=mesh, mesh_config=rules)
    expected = flat_paths(sharding.param_shardings(llama_jax.param_specs(qconfig), mesh, rules))
    for path, leaf in flat_paths(placed).items():
        assert leaf.sharding.is_equivalent_to(expected[path], leaf.ndim), path


PEAK_CHILD = """
import json, sys
import jax, llama_jax, llama_jax.formats.checkpoint
sys.path.insert(0, "bench")
from common import peak_rss_bytes, rss_bytes
before = rss_bytes()
_, params = llama_jax.load_checkpoint(sys.argv[1], quantize=sys.argv[2] or None,
                                      quantize_head=bool(sys.argv[2]))
jax.block_until_ready(params)
print(json.dumps({"extra": peak_rss_bytes() - before,
                  "weights": sum(x.nbytes for x in jax.tree.leaves(params))}))
"""


def test_loading_quantized_never_holds_the_float_model(tmp_path):
    """Peak RSS above the process's after imports, loading a 117 MB fp32 HF checkpoint: the
    float load holds at least the model; the int8 load stays well below it (one piece in
    float at a time, quantized in slices)."""
    fmt = "hf"
    config = ModelConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4,
                         ffn_dim=1536)
    params = llama_jax.init_params(config, jax.random.key(0))
    float_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    llama_jax.export_hf(config, params, tmp_path / fmt)
    del params

    def peak(quantize: str) -> dict:
        out = subprocess.run([sys.executable, "-c", PEAK_CHILD, str(tmp_path / fmt), quantize],
                             check=True, capture_output=True, text=True, timeout=300)
        return json.loads(out.stdout.strip().splitlines()[-1])

    floats, int8 = peak(""), peak("int8")
    assert floats["extra"] >= 0.95 * float_bytes
    assert int8["weights"] < 0.3 * float_bytes
    assert int8["extra"] < 0.55 * float_bytes, (int8, float_bytes)


def test_refusals():
    with pytest.raises(ConfigError, match="quantize='int4'"):
        ModelConfig.from_dict(dict(vocab_size=8, dim=8, n_layers=1, n_heads=1,
                                   quantize="int4"))
    with pytest.raises(ConfigError, match="quantize_head=True needs quantize"):
        ModelConfig(vocab_size=8, dim=8, n_layers=1, n_heads=1, quantize_head=True)
    with pytest.raises(ConfigError, match="a task head \\(sequence_classification\\) stays"):
        ModelConfig(vocab_size=8, dim=8, n_layers=1, n_heads=1, head="sequence_classification",
                    n_labels=2, quantize="int8", quantize_head=True)
    with pytest.raises(CheckpointError, match="quantize='int4' is not one of int8"):
        llama_jax.load_checkpoint("/nonexistent", quantize="int4")


def test_training_a_quantized_model_is_one_line_from_the_cli(tmp_path):
    out = subprocess.run([sys.executable, "train.py", "--config", "tiny", "--workdir",
                          str(tmp_path / "w"), "--set", "model.quantize=int8"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert "model.quantize='int8' is for inference" in out.stderr
    assert not (tmp_path / "w").exists()  # refused before the run began
