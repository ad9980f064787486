"""DeepSeek interop: tiny random transformers DeepseekV2ForCausalLM (with and without a query
latent) and DeepseekV3ForCausalLM checkpoints load with its logits — under YaRN, at positions
past the original context — and its greedy tokens under both decode implementations (absorbed
MLA decoding), and export back to files it loads with the same logits."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

import llama_jax
from llama_jax.config import MlaConfig, RopeScaling
from checkpoints import assert_greedy_tokens_equal_generate, enlarge_weights, hf_logits
from reference import relative_error

forward = jax.jit(llama_jax.forward, static_argnums=0)
TOKENS = np.random.default_rng(2).integers(0, 128, (2, 40))  # past the original context (16)
YARN = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32, beta_slow=1)
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, n_routed_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=24, first_k_dense_replace=1,
              max_position_embeddings=64)
MODELS = {
    # V2 as released: a query latent, group-limited greedy routing, shared experts, YaRN with
    # DeepSeek's mscale = mscale_all_dim
    "v2": ("DeepseekV2", dict(q_lora_rank=32, topk_method="group_limited_greedy", n_group=2,
                              topk_group=1, n_shared_experts=2, routed_scaling_factor=1.5,
                              rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707))),
    # V2-Lite's form: plain queries, greedy routing, plain RoPE
    "v2-lite": ("DeepseekV2", dict(q_lora_rank=None, topk_method="greedy", n_shared_experts=1,
                                   rope_parameters=dict(rope_type="default", rope_theta=1e4))),
    # V3: sigmoid routing with the correction bias, groups scored by their two best experts
    "v3": ("DeepseekV3", dict(q_lora_rank=32, n_group=2, topk_group=1, n_shared_experts=1,
                              routed_scaling_factor=2.5, norm_topk_prob=True,
                              rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0))),
}


def deepseek(name: str, seed: int = 0):
    import torch
    import transformers

    kind, fields = MODELS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, kind + "Config")(**COMMON, **fields)
    model = getattr(transformers, kind + "ForCausalLM")(config).eval()
    enlarge_weights(model)
    with torch.no_grad():
        for buffer_name, b in model.named_buffers():
            if "e_score_correction_bias" in buffer_name:  # a selection bias that matters
                b.copy_(0.3 * torch.randn_like(b))
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name in MODELS:
        model = deepseek(name)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (model, path)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_deepseek_checkpoint_matches_transformers(name, models):
    model, path = models[name]
    config, params = llama_jax.load_checkpoint(path)
    assert config.attention == "mla" and config.mlp == "moe"
    assert config.mla.q_lora_rank == (None if name == "v2-lite" else 32)
    assert config.moe.router == ("sigmoid" if name == "v3" else "softmax")
    assert (config.rope_type == "yarn") == (name != "v2-lite")
    err = relative_error(forward(config, params, TOKENS), hf_logits(model, TOKENS))
    assert err <= 1e-4, err


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_greedy_tokens_equal_transformers_generate(name, models):
    model, path = models[name]
    config, params = llama_jax.load_checkpoint(path)
    assert_greedy_tokens_equal_generate(model, config, params,
                                        [TOKENS[0, :7].tolist(), TOKENS[1, :12].tolist()])


def test_released_config_form_reads_the_same(models, tmp_path):
    """Released DeepSeek config.json files carry `rope_scaling` (with the legacy `type`) and a
    top-level `rope_theta`, where transformers 5 writes `rope_parameters`."""
    _, path = models["v3"]
    released = tmp_path / "released"
    shutil.copytree(path, released)
    cfg = json.loads((released / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **{k: v for k, v in rope.items()
                                                          if k != "type"}}
    (released / "config.json").write_text(json.dumps(cfg))
    assert llama_jax.load_checkpoint(released)[0] == llama_jax.load_checkpoint(path)[0]


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_export_loads_in_transformers_with_the_same_logits(name, models, tmp_path):
    import transformers
    from safetensors import safe_open

    model, path = models[name]
    config, params = llama_jax.load_checkpoint(path)
    llama_jax.export_hf(config, params, tmp_path / "out")
    with safe_open(path / "model.safetensors", "np") as a, \
            safe_open(tmp_path / "out" / "model.safetensors", "np") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():  # RoPE rows back in DeepSeek's interleaved order, bit for bit
            np.testing.assert_array_equal(a.get_tensor(key), b.get_tensor(key))
    kind = MODELS[name][0]
    back = getattr(transformers, kind + "ForCausalLM").from_pretrained(tmp_path / "out").eval()
    assert relative_error(hf_logits(back, TOKENS), hf_logits(model, TOKENS)) < 1e-6


def test_a_dense_mla_model_exports_as_deepseek_v3(tmp_path):
    """Ours → transformers: a dense MLA model (plain queries, YaRN with mscale_all_dim) is
    written as DeepSeek-V3 with every layer dense, and computes the same logits there."""
    import transformers

    config = dataclasses.replace(
        llama_jax.load_model_config("tiny"), attention="mla", n_kv_heads=None, head_dim=None,
        init_std=0.1,
        mla=MlaConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12),
        rope_type="yarn", rope_scaling=RopeScaling(factor=2.0, original_max_position_embeddings=16,
                                                   mscale=1.0, mscale_all_dim=1.0))
    params = llama_jax.init_params(config, jax.random.key(3))
    llama_jax.export_hf(config, params, tmp_path / "out")
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = TOKENS * 3  # ids up to the tiny vocabulary
    assert relative_error(hf_logits(model, tokens), forward(config, params, tokens)) <= 1e-4
    assert llama_jax.load_checkpoint(tmp_path / "out")[0].architecture() == config.architecture()


@pytest.mark.parametrize("preset, total, active", [
    ("deepseek-v2-lite", 15_706_484_224, 2_661_150_208),  # published: 15.7B, 2.4B active
    ("deepseek-v3", 671_026_419_200, 37_552_297_472),  # 671B, 37B (without the MTP module)
])
def test_deepseek_presets_match_transformers_parameter_count(preset, total, active):
    """The presets written as config.json (our writer) build transformers models of exactly
    our size (V3's e_score_correction_bias is a buffer there, our selection bias)."""
    import torch
    import transformers
    from llama_jax.plan import costs
    from llama_jax.formats.hf import hf_config

    config = llama_jax.load_model_config(preset)
    counts = costs.param_counts(config)
    assert (counts.total, counts.active) == (total, active)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**hf_config(config)))
    theirs = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for name, b in model.named_buffers() if "e_score_correction_bias" in name)
    assert theirs == total


@pytest.mark.parametrize("edit, message", [
    (dict(quantization_config={"quant_method": "fp8"}), "quantized weights .*'fp8'"),
    (dict(rope_interleave=False), "rope_interleave=false is not supported"),
    (dict(topk_method="noaux_tc", model_type="deepseek_v2"), "topk_method 'noaux_tc'"),
])
def test_unsupported_deepseek_configs_are_refused(edit, message, models, tmp_path):
    from llama_jax.errors import CheckpointError

    path = tmp_path / "ckpt"
    shutil.copytree(models["v3"][1], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(CheckpointError, match=message):
        llama_jax.load_checkpoint(path)


def test_v3_multi_token_prediction_layers_are_skipped(models, tmp_path):
    """V3's release stores its MTP module as layer n_layers (transformers skips it too); a
    stray tensor inside the model's layers is still refused."""
    from safetensors.numpy import load_file, save_file
    from llama_jax.errors import CheckpointError

    _, path = models["v3"]
    for extra, ok in (("model.layers.3.eh_proj.weight", True), ("model.layers.1.eh_proj.weight",
                                                                False)):
        copy = tmp_path / extra
        shutil.copytree(path, copy)
        tensors = load_file(copy / "model.safetensors")
        save_file({**tensors, extra: np.ones((4, 4), np.float32)}, copy / "model.safetensors",
                  metadata={"format": "pt"})
        if ok:
            assert llama_jax.load_checkpoint(copy)[0] == llama_jax.load_checkpoint(path)[0]
        else:
            with pytest.raises(CheckpointError, match="model.layers.1.eh_proj.weight"):
                llama_jax.load_checkpoint(copy)


def test_the_converter_gate_passes_a_deepseek_checkpoint(models, tmp_path):
    from llama_jax.formats import convert

    report = convert.convert(models["v3"][1], tmp_path / "native")
    assert report["vs_transformers"] < 1e-4 and report["round_trip"] <= 1e-6
    assert llama_jax.load_checkpoint(tmp_path / "native")[0].attention == "mla"
