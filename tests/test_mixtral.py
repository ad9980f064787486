"""Mixtral interop: transformers' MixtralForCausalLM checkpoints load with its logits under
both MoE dispatch implementations and its greedy tokens, and export back to files it loads
with the same logits."""

import dataclasses
import json

import jax
import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

import llama_jax
from llama_jax.config import MoeConfig
from llama_jax.errors import CheckpointError
from checkpoints import assert_greedy_tokens_equal_generate, enlarge_weights, hf_logits
from reference import relative_error

forward = jax.jit(llama_jax.forward, static_argnums=0)
TOKENS = np.random.default_rng(1).integers(0, 128, (2, 40))


def mixtral(seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128, rope_parameters=dict(
            rope_type="default", rope_theta=1e6))
    model = transformers.MixtralForCausalLM(config).eval()
    enlarge_weights(model)
    return model


@pytest.fixture(scope="module")
def model():
    return mixtral()


@pytest.fixture(scope="module")
def hf_dir(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_mixtral_checkpoint_matches_transformers(dispatch, model, hf_dir):
    config, params = llama_jax.load_checkpoint(hf_dir)
    assert config.mlp == "moe" and (config.moe.n_experts, config.moe.top_k) == (4, 2)
    assert config.moe.capacity_factor is None  # Mixtral drops nothing
    config = config.with_execution(moe_dispatch=dispatch)
    err = relative_error(forward(config, params, TOKENS), hf_logits(model, TOKENS))
    assert err <= 1e-4, err


def test_greedy_tokens_equal_transformers_generate(model, hf_dir):
    config, params = llama_jax.load_checkpoint(hf_dir)
    assert_greedy_tokens_equal_generate(model, config, params,
                                        [TOKENS[0, :7].tolist(), TOKENS[1, :12].tolist()])


def test_export_loads_in_transformers_with_the_same_logits(model, hf_dir, tmp_path):
    import transformers
    from safetensors import safe_open

    config, params = llama_jax.load_checkpoint(hf_dir)
    llama_jax.export_hf(config, params, tmp_path / "out")
    with safe_open(hf_dir / "model.safetensors", "np") as a, \
            safe_open(tmp_path / "out" / "model.safetensors", "np") as b:
        assert sorted(a.keys()) == sorted(b.keys())  # the released (per-expert) names
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.num_local_experts == 4 and back.config.num_experts_per_tok == 2
    assert relative_error(hf_logits(back, TOKENS), hf_logits(model, TOKENS)) < 1e-6


def test_other_moe_architectures_are_not_written_as_mixtral(tmp_path):
    config = llama_jax.load_model_config("tiny")
    config = dataclasses.replace(config, mlp="moe", moe=MoeConfig(router="sigmoid"))
    params = llama_jax.init_params(config, jax.random.key(0))
    with pytest.raises(CheckpointError, match=r"moe\.router='sigmoid' should be 'softmax'"):
        llama_jax.export_hf(config, params, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_sliding_window_mixtral_is_refused(hf_dir, tmp_path):
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(hf_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "sliding_window": 4096}))
    with pytest.raises(CheckpointError, match="sliding_window=4096 is not supported"):
        llama_jax.load_checkpoint(path)
