"""Config validation, presets and YAML inheritance."""

import dataclasses

import jax
import pytest

from llama_jax.config import (ModelConfig, RopeScaling, list_presets, load_model_config, default_ffn_dim)
from llama_jax.errors import ConfigError

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4)


def test_defaults_follow_meta():
    c = ModelConfig(**TINY)
    assert (c.K, c.H, c.G) == (4, 8, 1)
    assert c.F == default_ffn_dim("swiglu", 32, 256, None) == 256


@pytest.mark.parametrize("dim, multiple_of, mult, expected", [
    (4096, 256, None, 11008), (5120, 256, None, 13824), (6656, 256, None, 17920),
    (8192, 256, None, 22016), (8192, 4096, 1.3, 28672), (4096, 1024, 1.3, 14336),
    (16384, 4096, 1.2, 53248), (2048, 256, 1.5, 8192), (3072, 256, 1.0, 8192)])
def test_meta_ffn_rule(dim, multiple_of, mult, expected):
    assert default_ffn_dim("swiglu", dim, multiple_of, mult) == expected


def test_config_is_hashable_and_static_under_jit():
    a, b = ModelConfig(**TINY), ModelConfig(**TINY)
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    f = jax.jit(lambda c, x: x * c.n_heads, static_argnums=0)
    assert f(a, 2.0) == 8.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.dim = 3


@pytest.mark.parametrize("overrides, field", [
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(dim=36, n_heads=4), "head_dim"),  # head dim 9 is odd
    (dict(dim=30), "n_heads"),
    (dict(vocab_size=-5), "vocab_size"),
    (dict(n_layers=0), "n_layers"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(norm_eps="tiny"), "norm_eps"),
    (dict(rope_type="yarn"), "rope_type"),
    (dict(rope_type="llama3"), "rope_scaling"),
    (dict(rope_scaling=RopeScaling()), "rope_scaling"),
    (dict(rope_type="llama3", rope_scaling=8.0), "rope_scaling"),
    (dict(tie_embeddings="yes"), "tie_embeddings"),
    (dict(param_dtype="float64"), "param_dtype"),
    (dict(remat="sometimes"), "remat"),
])
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{**TINY, **overrides})


def test_bad_rope_scaling_names_the_field():
    with pytest.raises(ConfigError, match=r"rope_scaling\.high_freq_factor"):
        RopeScaling(low_freq_factor=4.0, high_freq_factor=1.0)


def test_moe_fields_with_a_dense_mlp_are_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: tiny\nmodel: {mlp: swiglu, moe: {n_experts: 4}}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: model\.moe: the section applies only to "
                                          r"mlp 'moe', not 'swiglu'"):
        load_model_config(bad)
    bad.write_text("base: tiny\nmodel: {mlp: moe, bias: true}\n")
    with pytest.raises(ConfigError, match=r"model\.bias=True is not supported with mlp 'moe'"):
        load_model_config(bad)


@pytest.mark.parametrize("model, message", [
    ("{mlp: moe, moe: {top_k: 9}}",
     r"model\.moe\.top_k=9 must be <= n_experts \(8\)"),
    ("{mlp: moe, moe: {n_groups: 3}}",
     r"model\.moe\.n_groups=3 must divide n_experts \(8\)"),
    ("{mlp: moe, moe: {n_groups: 2, top_k_groups: 3}}",
     r"model\.moe\.top_k_groups=3 must be <= n_groups"),
    ("{mlp: moe, moe: {capacity_factor: 0}}",
     r"model\.moe\.capacity_factor=0\.0 must be > 0"),
    ("{mlp: moe, moe: {capacity_factor: -1.5}}",
     r"model\.moe\.capacity_factor=-1\.5 must be > 0"),
    ("{mlp: moe, moe: {router: relu}}",
     r"model\.moe\.router='relu' is not one of"),
    ("{mlp: moe, moe: {expert_mlp: moe}}",
     r"model\.moe\.expert_mlp='moe' is not one of"),
    ("{mlp: moe, moe: {first_dense_layers: 2}}",
     r"model\.moe\.first_dense_layers=2 must be < n_layers \(2\)"),
    ("{mlp: moe, moe: {n_expert: 4}}",
     r"model\.moe: unknown key 'n_expert' \(did you mean 'n_experts'\?\)"),
    ("{attention: mla, mla: {kv_lora_rank: 0}}", r"model\.mla\.kv_lora_rank=0 must be a positive"),
    ("{attention: mla, mla: {q_lora_rank: -8}}", r"model\.mla\.q_lora_rank=-8 must be a positive"),
    ("{attention: mla, mla: {v_head_dim: 1.5}}", r"model\.mla\.v_head_dim=1\.5 must be a posit"),
    ("{attention: mla, mla: {qk_rope_head_dim: 7}}",
     r"model\.mla\.qk_rope_head_dim=7 must be even"),
    ("{attention: mla, mla: {kv_rank: 8}}", r"model\.mla: unknown key 'kv_rank'"),
    ("{attention: gqa, mla: {kv_lora_rank: 8}}",
     r"model\.mla: the section applies only to attention 'mla', not 'gqa'"),
    ("{mla: {kv_lora_rank: 8}}", r"model\.mla: the section applies only to attention 'mla'"),
    ("{attention: mla, n_kv_heads: 2}", r"model\.n_kv_heads=2 does not apply to attention"),
    ("{attention: mla, n_kv_heads: null, head_dim: 64}",
     r"model\.head_dim=64 is mla\.qk_nope_head_dim \+ mla"),
    ("{attention: mla, n_kv_heads: null, positions: learned}",
     r"model\.positions='learned' must be 'rope'"),
    ("{attention: latent}", r"model\.attention='latent' is not one of"),
    ("{rope_type: llama3, rope_scaling: {factor: 8, beta_fast: 32}}",
     r"model\.rope_scaling\.beta_fast=32\.0 applies only to rope_type 'yarn', not 'llama3'"),
    ("{rope_type: yarn, rope_scaling: {factor: 4, low_freq_factor: 1}}",
     r"model\.rope_scaling\.low_freq_factor=1\.0 applies only to rope_type 'llama3'"),
    ("{rope_type: yarn, rope_scaling: {factor: 4, beta_fast: 1, beta_slow: 2}}",
     r"model\.rope_scaling\.beta_fast=1\.0 must be >= beta_slow"),
    ("{rope_type: yarn}", r"model\.rope_scaling=None must be given exactly when rope_type"),
])
def test_bad_moe_mla_and_yarn_fields_name_the_file_and_field(model, message, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"base: tiny\nmodel: {model}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: " + message):
        load_model_config(bad)


def test_mla_fixes_the_head_layout():
    c = ModelConfig(**TINY, attention="mla")
    assert (c.K, c.H, c.v_head_dim, c.rope_dim) == (4, 128 + 64, 128, 64)
    assert ModelConfig.from_dict(c.to_dict()) == c


def test_yaml_numbers_without_dot_are_accepted():
    # YAML 1.1 reads `1e-5` as a string; the config turns it into a float.
    c = ModelConfig.from_dict({**TINY, "norm_eps": "1e-5", "rope_theta": 500000})
    assert c.norm_eps == 1e-5 and isinstance(c.rope_theta, float)


def test_from_dict_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"unknown key 'n_head'.*did you mean 'n_heads'"):
        ModelConfig.from_dict({**TINY, "n_head": 4})
    with pytest.raises(ConfigError, match=r"model\.rope_scaling: unknown key 'factr'"):
        ModelConfig.from_dict({**TINY, "rope_type": "llama3", "rope_scaling": {"factr": 8}})
    with pytest.raises(ConfigError, match="missing required key"):
        ModelConfig.from_dict({"dim": 32})


def test_every_preset_loads_and_family_bases_are_not_presets():
    presets = list_presets()
    assert {"llama1-7b", "llama2-70b", "llama3.1-405b", "llama3.2-1b", "tiny"} <= set(presets)
    assert not any(p.startswith("_") for p in presets)
    for name in presets:
        assert isinstance(load_model_config(name), ModelConfig)


def test_inheritance_overrides_key_by_key(tmp_path):
    (tmp_path / "ablation.yaml").write_text("base: llama3.1-8b\nmodel:\n  n_layers: 4\n"
                                            "  rope_scaling: {factor: 16.0}\n")
    c = load_model_config(tmp_path / "ablation.yaml")
    assert c.n_layers == 4 and c.dim == 4096 and c.rope_theta == 500000.0
    assert c.rope_scaling == RopeScaling(factor=16.0, original_max_position_embeddings=8192,
                                         low_freq_factor=1.0, high_freq_factor=4.0)
    (tmp_path / "child.yaml").write_text("base: ablation.yaml\nmodel: {n_heads: 16}\n")
    assert load_model_config(tmp_path / "child.yaml").head_dim == 256


def test_file_errors_name_the_file_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: tiny\nmodel: {n_kv_heads: 3}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: model\.n_kv_heads=3 must divide n_heads"):
        load_model_config(bad)
    bad.write_text("base: tiny\nmodle: {dim: 3}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: unknown top-level key"):
        load_model_config(bad)
    bad.write_text("base: bad.yaml\n")
    with pytest.raises(ConfigError, match="chain loops"):
        load_model_config(bad)
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: cannot read config"):
        load_model_config(bad)
    with pytest.raises(ConfigError, match="neither a file nor a preset"):
        load_model_config("llama9-1t")


def test_set_overrides_reach_empty_sections_and_refuse_scalars(tmp_path):
    from llama_jax import load_run_config

    path = tmp_path / "run.yaml"
    path.write_text("base: tiny\ndata:\n")  # an empty section is None in YAML
    assert load_run_config(path, ["data.corpus=/texts"]).data.corpus == "/texts"
    with pytest.raises(ConfigError, match="rope_theta is 10000.0 .* not a mapping"):
        load_run_config("tiny", ["model.rope_theta.x=1"])


def _declared_sections():
    from llama_jax.config import reference
    return [cls for _, cls in reference.SECTIONS]


@pytest.mark.parametrize("cls", _declared_sections(), ids=lambda c: c.__name__)
def test_every_field_declares_its_rule_and_meaning(cls):
    for f in dataclasses.fields(cls):
        assert "rule" in f.metadata and f.metadata["doc"], f"{cls.__name__}.{f.name}"


def _int_fields():
    from llama_jax.config.run import DataConfig, MeshConfig, TaskConfig, TrainConfig
    from llama_jax.config import MlaConfig, MoeConfig
    required = {ModelConfig: TINY, TaskConfig: dict(kind="regression", train="t.jsonl")}
    for cls in (ModelConfig, RopeScaling, MlaConfig, MoeConfig, TrainConfig, DataConfig,
                MeshConfig, TaskConfig):
        for f in dataclasses.fields(cls):
            if f.metadata["rule"].type == "int":
                yield pytest.param(cls, required.get(cls, {}), f.name,
                                   id=f"{cls.__name__}.{f.name}")


@pytest.mark.parametrize("cls, required, name", list(_int_fields()))
def test_a_bool_is_never_an_integer(cls, required, name):
    with pytest.raises(ConfigError, match=rf"{name}=True "):
        cls(**{**required, name: True})


def test_the_config_reference_is_generated_from_the_code():
    from llama_jax.config import reference
    assert reference.DOCUMENT.read_text() == reference.render(), (
        "docs/config-reference.md is stale: run `python -m llama_jax.config.reference --write`")
