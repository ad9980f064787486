"""Special token ids outside a model's vocabulary (transformers' own test configs pair a small
vocab_size with a default eos_token_id such as GPT-2's 50256): every family's loader reads the
checkpoint with one warning, generation ignores those ids, and exporting writes them back."""

import dataclasses
import json
import warnings
from pathlib import Path

import jax
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

import llama_jax
from checkpoints import HF_BASE, write_meta
from llama_jax.formats.checkpoint import load_checkpoint

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=4, max_position_embeddings=64)
# family -> (transformers model class, config fields, the eos ids its config.json names)
HF_FAMILIES = {
    "llama": ("LlamaForCausalLM", dict(TINY, num_key_value_heads=2, bos_token_id=128000,
                            eos_token_id=[128001, 128009]), (128001, 128009)),
    "mixtral": ("MixtralForCausalLM", dict(TINY, num_key_value_heads=2, num_local_experts=2,
                                num_experts_per_tok=1, eos_token_id=32000), (32000,)),
    "gpt2": ("GPT2LMHeadModel", dict(n_embd=32, n_layer=1, n_head=4, n_positions=64, vocab_size=128),
             (50256,)),  # GPT2Config's defaults: bos = eos = 50256
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(TINY, num_key_value_heads=4, kv_lora_rank=16,
                                       qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                       n_routed_experts=2, num_experts_per_tok=1,
                                       moe_intermediate_size=16, first_k_dense_replace=1,
                                       n_group=1, topk_group=1, eos_token_id=100001),
                    (100001,)),
}
PROMPT = [[5, 17, 3, 99]]


def load_warning_once(path):
    """The checkpoint and its config, asserting one warning that names the ignored ids."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # as a user's process: each message once
        config, params = load_checkpoint(path)
    messages = [str(w.message) for w in caught if "outside the vocabulary" in str(w.message)]
    assert len(messages) == 1, messages
    outside = [token for token in config.eos_ids if token not in config.stop_ids]
    assert f"eos_ids {outside} are outside the vocabulary" in messages[0]
    return config, params


def generates_without_stopping(config, params):
    assert config.stop_ids == ()
    assert len(llama_jax.generate(config, params, PROMPT, 6)[0]) == 6  # no stop id to emit


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_checkpoints_load_and_export_their_out_of_vocabulary_ids(family, tmp_path):
    import transformers

    model_class, fields, eos_ids = HF_FAMILIES[family]
    model_class = getattr(transformers, model_class)
    model = model_class(model_class.config_class(**fields))
    model.save_pretrained(tmp_path / "hf")
    config, params = load_warning_once(tmp_path / "hf")
    assert config.eos_ids == eos_ids
    generates_without_stopping(config, params)

    llama_jax.export_hf(config, params, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    expected = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["eos_token_id"] == expected["eos_token_id"]
    if family == "gpt2":
        assert written["bos_token_id"] == expected["bos_token_id"] == 50256
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.config.eos_token_id == expected["eos_token_id"]


def test_meta_checkpoint_with_a_larger_tokenizer(tmp_path):
    """Meta's params.json has no EOS ids: they come from the tokenizer beside it, here LLaMA 3's
    (EOS 128001, 128008, 128009) beside a 128-token model."""
    import transformers

    llama_models = pytest.importorskip("llama_models")

    torch_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**HF_BASE, "num_key_value_heads": 2}))
    write_meta(torch_model, tmp_path, n_shards=1)
    tokenizer = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
    (tmp_path / "tokenizer.model").write_bytes(tokenizer.read_bytes())
    config, params = load_warning_once(tmp_path)
    assert config.eos_ids == (128001, 128008, 128009)
    generates_without_stopping(config, params)
    llama_jax.export_hf(config, params, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["eos_token_id"] == [128001, 128008, 128009]


def test_native_checkpoint_round_trips_its_ids(tmp_path):
    with pytest.warns(UserWarning, match=r"eos_ids \[300\] are outside"):
        config = dataclasses.replace(llama_jax.load_model_config("tiny"), vocab_size=128,
                                     eos_ids=(300, 7))
    llama_jax.save_native(config, llama_jax.init_params(config, jax.random.key(0)),
                          tmp_path / "m")
    loaded, params = load_warning_once(tmp_path / "m")
    assert loaded.eos_ids == (300, 7) and loaded.stop_ids == (7,)
