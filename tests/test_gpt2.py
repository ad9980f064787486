"""GPT-2 checkpoint interop: HF `GPT2LMHeadModel` loading, export and the convert CLI's parity
gate, against transformers on tiny random models."""

import dataclasses
import json
import shutil

import chex
import jax
import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

import llama_jax
from llama_jax.formats import convert as convert_mod
from llama_jax.formats.checkpoint import load_checkpoint
from llama_jax.formats import torch_layout
from llama_jax.errors import CheckpointError
from checkpoints import hf_logits, load_onto_a_mesh
from reference import relative_error

forward = jax.jit(llama_jax.forward, static_argnums=0)
VOCAB, EOS = 256, 255
BASE = dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB,
            bos_token_id=EOS, eos_token_id=EOS)  # transformers' default 50256 is outside VOCAB
# case -> (GPT2Config fields, the mlp it loads as)
CASES = {
    "gelu_new": ({}, "gelu_tanh"),  # GPT-2's own
    "gelu": (dict(activation_function="gelu"), "gelu"),
    "gelu_pytorch_tanh": (dict(activation_function="gelu_pytorch_tanh"), "gelu_tanh"),
    "relu": (dict(activation_function="relu"), "relu"),
    "untied": (dict(tie_word_embeddings=False, n_inner=96), "gelu_tanh"),
}
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 64))  # every learned position


def gpt2_model(fields: dict, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**BASE, **fields})).eval()
    with torch.no_grad():  # HF zeroes biases and sets gains to one, which would hide mistakes
        for name, p in model.named_parameters():
            if ".ln_" in name and name.endswith("weight"):
                torch.nn.init.normal_(p, 1.0, 0.1)
            else:  # large enough that greedy generation wanders instead of repeating a token
                torch.nn.init.normal_(p, 0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """case -> (transformers model, its save_pretrained directory)."""
    out = {}
    for seed, (case, (fields, _)) in enumerate(CASES.items()):
        model = gpt2_model(fields, seed)
        path = tmp_path_factory.mktemp(case)
        model.save_pretrained(path, safe_serialization=True)
        out[case] = model, path
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, gpt2):
    # c_proj is square [D, D]: a transposed Conv1D read passes every shape check, and only
    # these logits catch it.
    model, path = gpt2[case]
    config, params = load_checkpoint(path)
    fields, mlp = CASES[case]
    assert (config.norm, config.norm_position, config.positions, config.bias) == (
        "layernorm", "pre", "learned", True)
    assert config.mlp == mlp and config.ffn_dim == fields.get("n_inner", 4 * 64)
    assert config.n_kv_heads == config.n_heads == 4 and config.max_seq_len == 64
    assert config.tie_embeddings == ("lm_head" not in params) == (case != "untied")
    assert config.eos_ids == (EOS,)
    err = relative_error(forward(config, params, TOKENS), hf_logits(model, TOKENS))
    assert err <= 1e-4, err


def test_a_bare_gpt2model_save_loads_the_same(gpt2, tmp_path):
    """GPT2Model's names lack the `transformer.` prefix (and it has no head: GPT-2 ties it)."""
    model, path = gpt2["gelu_new"]
    model.transformer.save_pretrained(tmp_path, safe_serialization=True)
    config, params = load_checkpoint(tmp_path)
    _, expected = load_checkpoint(path)
    chex.assert_trees_all_equal(params, expected)


@pytest.mark.parametrize("decode_impl", ["scan", "unrolled"])
def test_greedy_generation_matches_transformers(decode_impl, gpt2):
    import torch

    model, path = gpt2["gelu_new"]
    config, params = load_checkpoint(path)
    prompts = [[5, 17, 200], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    ours = llama_jax.generate(config, params, prompts, 20, stop_tokens=[],
                              decode_impl=decode_impl)
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                                 do_sample=False, eos_token_id=None, pad_token_id=EOS)
        assert got == out[0, len(prompt):].tolist()
    assert len(set(ours[1])) > 3  # a wandering continuation, not one repeated token


@pytest.mark.parametrize("case", ["gelu_new", "gelu", "untied"])
def test_export_hf_round_trip(case, gpt2, tmp_path):
    import transformers

    model, path = gpt2[case]
    config, params = load_checkpoint(path)
    llama_jax.export_hf(config, params, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert isinstance(reloaded, transformers.GPT2LMHeadModel)
    assert reloaded.config.activation_function == model.config.activation_function
    assert relative_error(hf_logits(reloaded, TOKENS), hf_logits(model, TOKENS)) < 1e-6
    config2, params2 = load_checkpoint(tmp_path / "out")
    assert config2 == config
    chex.assert_trees_all_equal(params2, params)


@pytest.mark.parametrize("changes, field", [
    (dict(norm_position="post"), "norm_position='post'"),
    (dict(positions="sinusoidal"), "positions='sinusoidal'"),
    (dict(mlp="geglu"), "mlp='geglu'"),
    (dict(n_kv_heads=2), "n_kv_heads=2"),  # c_attn's thirds are q, k, v of equal width
    (dict(bias=False), "bias=False"),
])
def test_export_hf_refuses_other_architectures(changes, field, gpt2, tmp_path):
    config, _ = load_checkpoint(gpt2["gelu_new"][1])
    config = dataclasses.replace(config, **changes)
    params = llama_jax.init_params(config, jax.random.key(0))
    with pytest.raises(CheckpointError, match=f"neither.*As GPT-2: .*{field}"):
        llama_jax.export_hf(config, params, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_export_hf_refuses_the_classic_transformer(tmp_path):
    """The original Transformer recipe: post-norm, sinusoidal positions, no final norm."""
    config = llama_jax.load_model_config("transformer")
    with pytest.raises(CheckpointError, match=r"As Llama: .*norm=.layernorm.*As GPT-2: "
                                              r"norm_position='post'.*positions='sinusoidal'"):
        llama_jax.export_hf(config, llama_jax.init_params(config, jax.random.key(0)),
                            tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------- convert CLI

@pytest.mark.parametrize("to", ["native", "hf"])
def test_convert_gpt2(to, gpt2, tmp_path):
    model, path = gpt2["gelu_new"]
    report = convert_mod.convert(path, tmp_path / "out", to=to)
    assert report["vs_transformers"] < 1e-4 and report["round_trip"] <= 1e-6
    config, params = load_checkpoint(tmp_path / "out")
    assert relative_error(forward(config, params, TOKENS), hf_logits(model, TOKENS)) <= 1e-4


def test_convert_gate_catches_swapped_q_and_k(gpt2, tmp_path, monkeypatch):
    wq, wk = torch_layout.GPT2["attn/wq"], torch_layout.GPT2["attn/wk"]
    monkeypatch.setitem(torch_layout.GPT2, "attn/wq", dataclasses.replace(wq, part=wk.part))
    monkeypatch.setitem(torch_layout.GPT2, "attn/wk", dataclasses.replace(wk, part=wq.part))
    with pytest.raises(convert_mod.ParityError, match="transformers"):
        convert_mod.convert(gpt2["gelu_new"][1], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------- bad input

def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, message", [
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True"),
    (dict(scale_attn_weights=False), "scale_attn_weights=False"),
    (dict(add_cross_attention=True), "add_cross_attention=True"),
    (dict(activation_function="gelu_fast"), "activation_function 'gelu_fast'"),
])
def test_unsupported_gpt2_configs_are_refused(changes, message, gpt2, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(gpt2["gelu_new"][1], path)
    (path / "generation_config.json").unlink()  # so config.json's eos_token_id is the one read
    edit_config(path, **changes)
    with pytest.raises(CheckpointError, match=rf"config\.json: .*{message}"):
        load_checkpoint(path)


def test_stored_causal_masks_are_ignored_and_other_tensors_refused(gpt2, tmp_path):
    import torch
    from safetensors.torch import save_file

    model, _ = gpt2["gelu_new"]
    model.save_pretrained(tmp_path, safe_serialization=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    mask = torch.tril(torch.ones(64, 64, dtype=torch.bool))[None, None]
    state["transformer.h.0.attn.bias"] = mask  # buffers older transformers versions saved
    state["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, tmp_path / "model.safetensors")
    config, params = load_checkpoint(tmp_path)
    assert relative_error(forward(config, params, TOKENS), hf_logits(model, TOKENS)) <= 1e-4

    state["transformer.h.0.crossattention.c_attn.weight"] = torch.zeros(64, 128)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="not GPT-2 weights.*crossattention"):
        load_checkpoint(tmp_path)


def test_loading_places_gpt2_tensors_straight_into_a_mesh(gpt2):
    """Each of wq, wk, wv (a third of c_attn) arrives in its own sharding (FSDP x TP here)
    with the values of an unsharded load."""
    placed = load_onto_a_mesh(gpt2["gelu_new"][1])
    assert placed["groups"][0]["attn"]["wk"].sharding.spec[1:3] == ("fsdp", "tensor")
