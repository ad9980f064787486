"""Checkpoint interop: HF and Meta loading, HF export and the convert CLI's parity gate, against
transformers' LlamaForCausalLM on tiny random models."""

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
from llama_jax.formats import native, torch_layout
from llama_jax.errors import CheckpointError
from checkpoints import (HF_CASES, hf_logits, hf_model, load_onto_a_mesh, to_legacy_config,
                         write_meta)
from reference import relative_error

forward = jax.jit(llama_jax.forward, static_argnums=0)
TOKENS = np.random.default_rng(0).integers(0, 128, (2, 80))  # 80 > original context of 32


@pytest.fixture(scope="module")
def models():
    return {case: hf_model(case, seed=i) for i, case in enumerate(HF_CASES)}


@pytest.fixture(scope="module")
def hf_dirs(models, tmp_path_factory):
    dirs = {}
    for case, model in models.items():
        dirs[case] = tmp_path_factory.mktemp(case)
        model.save_pretrained(dirs[case])
    return dirs


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_checkpoint_matches_transformers(case, models, hf_dirs):
    config, params = load_checkpoint(hf_dirs[case])
    assert config.n_kv_heads == models[case].config.num_key_value_heads
    assert config.tie_embeddings == ("lm_head" not in params) == ("tied" in case)
    err = relative_error(forward(config, params, TOKENS), hf_logits(models[case], TOKENS))
    assert err <= 1e-4, err


def test_transformers_4x_config_form_and_sharded_safetensors(models, tmp_path):
    model = models["llama3.1-tied"]
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    to_legacy_config(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    config, params = load_checkpoint(tmp_path)
    assert config.rope_type == "llama3" and config.rope_scaling.original_max_position_embeddings \
        == 32 and config.rope_theta == 500000.0
    assert relative_error(forward(config, params, TOKENS), hf_logits(model, TOKENS)) <= 1e-4


@pytest.mark.parametrize("case, vocab_parallel", [("gqa", False), ("mha", False),
                                                  ("llama3.2-tied", True)])
def test_meta_checkpoint_matches_transformers(case, vocab_parallel, models, tmp_path):
    write_meta(models[case], tmp_path, n_shards=2, vocab_parallel_embedding=vocab_parallel)
    config, params = load_checkpoint(tmp_path)
    assert config.ffn_dim == 96  # Meta's rule from dim, multiple_of, ffn_dim_multiplier
    err = relative_error(forward(config, params, TOKENS), hf_logits(models[case], TOKENS))
    assert err <= 1e-4, err


def test_export_hf_loads_in_transformers_with_the_same_logits(models, hf_dirs, tmp_path):
    import transformers

    for case in ("gqa", "llama3.1-tied"):
        config, params = load_checkpoint(hf_dirs[case])
        llama_jax.export_hf(config, params, tmp_path / case)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / case).eval()
        assert relative_error(hf_logits(reloaded, TOKENS), hf_logits(models[case], TOKENS)) < 1e-6


def test_export_hf_shards_large_models(hf_dirs, tmp_path):
    config, params = load_checkpoint(hf_dirs["gqa"])
    from llama_jax.formats import hf
    (tmp_path / "out").mkdir()
    hf.save(config, params, tmp_path / "out", max_shard_bytes=60_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    config2, params2 = load_checkpoint(tmp_path / "out")
    np.testing.assert_array_equal(forward(config2, params2, TOKENS),
                                  forward(config, params, TOKENS))


def test_bf16_loading_is_as_accurate_as_transformers_in_bf16(hf_dirs, models):
    """Against a bf16 reference: transformers running the same weights in bf16. Both are
    measured against the fp32 logits; ours must lose about as much (not far more: a bf16
    softmax or norm statistic would; not far less: that would mean bf16 was not used)."""
    config, params = load_checkpoint(hf_dirs["gqa"], dtype="bfloat16")
    assert config.param_dtype == config.compute_dtype == "bfloat16"
    assert all(leaf.dtype == jax.numpy.bfloat16 for leaf in jax.tree.leaves(params))
    fp32 = hf_logits(models["gqa"], TOKENS)
    theirs = relative_error(_bf16_logits(models["gqa"]), fp32)
    ours = relative_error(forward(config, params, TOKENS), fp32)
    assert 0.2 * theirs < ours < 1.5 * theirs, (ours, theirs)


def _bf16_logits(model) -> np.ndarray:
    import copy

    import torch

    with torch.no_grad():
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        return bf16(torch.as_tensor(TOKENS, dtype=torch.long)).logits.float().numpy()


# --------------------------------------------------------------------------------- convert CLI

@pytest.mark.parametrize("to", ["native", "hf"])
def test_convert_hf_round_trip(to, hf_dirs, models, tmp_path):
    report = convert_mod.convert(hf_dirs["llama3.1-tied"], tmp_path / "out", to=to)
    assert report["vs_transformers"] < 1e-4 and report["round_trip"] <= 1e-6
    config, params = load_checkpoint(tmp_path / "out")
    assert relative_error(forward(config, params, TOKENS),
                          hf_logits(models["llama3.1-tied"], TOKENS)) <= 1e-4


def test_convert_meta_to_native_bf16(models, tmp_path):
    write_meta(models["gqa"], tmp_path / "meta")
    report = convert_mod.convert(tmp_path / "meta", tmp_path / "out", dtype="bfloat16")
    assert report["dtype"] == "bfloat16" and report["vs_transformers"] < 3e-2
    config, params = load_checkpoint(tmp_path / "out")
    assert config.param_dtype == "bfloat16"
    assert params["embed"]["table"].dtype == jax.numpy.bfloat16


def test_convert_refuses_tampered_weights_and_leaves_nothing(hf_dirs, tmp_path, monkeypatch):
    def tampering_writer(config, params, path):
        block = params["groups"][0]
        attn = {**block["attn"], "wq": block["attn"]["wq"].at[0, 0, 0, 0].add(1.0)}
        native.save(config, {**params, "groups": ({**block, "attn": attn},)}, path)

    monkeypatch.setitem(convert_mod.WRITERS, "native", tampering_writer)
    with pytest.raises(convert_mod.ParityError, match="nothing written"):
        convert_mod.convert(hf_dirs["gqa"], tmp_path / "out", to="native")
    assert list(tmp_path.iterdir()) == []


def test_convert_gate_catches_a_wrong_rope_permutation(models, tmp_path, monkeypatch):
    write_meta(models["gqa"], tmp_path / "meta")
    monkeypatch.setattr(torch_layout, "interleaved_to_half", lambda w, heads: w)  # the classic bug
    with pytest.raises(convert_mod.ParityError, match="transformers"):
        convert_mod.convert(tmp_path / "meta", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_convert_cli_never_overwrites(hf_dirs, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    assert convert_mod.main([str(hf_dirs["gqa"]), str(tmp_path / "out")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").read_text() == "precious"


def test_convert_cli_success_message(hf_dirs, tmp_path, capsys):
    assert convert_mod.main([str(hf_dirs["mqa"]), str(tmp_path / "out"), "--to", "hf"]) == 0
    assert "parity gate passed" in capsys.readouterr().out


# --------------------------------------------------------------------------------- bad input

def copy_hf(hf_dirs, tmp_path, case="gqa"):
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_dirs[case], dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint llama_jax reads"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "missing")


def test_pickled_hf_weights_are_not_read(hf_dirs, tmp_path):
    path = copy_hf(hf_dirs, tmp_path)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only safetensors weights are read"):
        load_checkpoint(path)


def test_missing_shard(models, tmp_path):
    models["gqa"].save_pretrained(tmp_path, max_shard_size="40KB")
    next(tmp_path.glob("model-00002-of-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard.*missing.*model-00002"):
        load_checkpoint(tmp_path)


def test_shape_mismatch_names_tensor_and_file(hf_dirs, tmp_path):
    path = copy_hf(hf_dirs, tmp_path)
    edit_config(path, intermediate_size=128)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp"
                                              r"\.down_proj\.weight' has shape \(64, 96\), "
                                              r"expected \(64, 128\)"):
        load_checkpoint(path)


@pytest.mark.parametrize("changes, message", [
    (dict(model_type="mistral", sliding_window=4096), "model_type 'mistral'"),
    (dict(model_type="qwen2"), "model_type 'qwen2'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)), "yarn"),
])
def test_non_llama_architectures_are_refused(changes, message, hf_dirs, tmp_path):
    path = copy_hf(hf_dirs, tmp_path)
    edit_config(path, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)


def test_corrupt_safetensors(hf_dirs, tmp_path):
    path = copy_hf(hf_dirs, tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_checkpoint(path)


def test_unexpected_tensors_are_refused(models, tmp_path):
    import torch
    from safetensors.torch import save_file

    models["gqa"].save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in models["gqa"].state_dict().items()}
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)  # Qwen-style bias
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="not Llama weights.*q_proj.bias"):
        load_checkpoint(tmp_path)


def test_corrupt_meta_shard(models, tmp_path):
    write_meta(models["gqa"], tmp_path)
    (tmp_path / "consolidated.01.pth").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"consolidated\.01\.pth"):
        load_checkpoint(tmp_path)


def test_native_shape_mismatch(hf_dirs, tmp_path):
    config, params = load_checkpoint(hf_dirs["gqa"])
    llama_jax.save_native(config, params, tmp_path / "n")
    text = (tmp_path / "n" / "config.yaml").read_text().replace("ffn_dim: 96", "ffn_dim: 128")
    (tmp_path / "n" / "config.yaml").write_text(text)
    with pytest.raises(CheckpointError, match="do not match"):
        load_checkpoint(tmp_path / "n")


def test_bad_dtype():
    with pytest.raises(CheckpointError, match="float64"):
        load_checkpoint(".", dtype="float64")


def test_hf_loading_holds_the_weights_about_once(tmp_path):
    """Peak resident memory while loading stays near one copy of the weights (bench/
    load_memory.py measures every format; this guards the streaming HF path)."""
    import subprocess
    import sys
    from pathlib import Path

    config = llama_jax.ModelConfig(vocab_size=32000, dim=512, n_layers=4, n_heads=8)
    llama_jax.export_hf(config, llama_jax.init_params(config, jax.random.key(0)), tmp_path / "m")
    bench = Path(__file__).parent.parent / "bench" / "load_memory.py"
    out = subprocess.run([sys.executable, str(bench), "--child", "hf", str(tmp_path / "m"),
                          "float32"], check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["extra_bytes"] < 1.5 * result["weight_bytes"], result


@pytest.mark.parametrize("fmt", ["hf", "meta", "native"])
def test_loading_places_tensors_straight_into_a_mesh(fmt, models, hf_dirs, tmp_path):
    """With a mesh, every tensor arrives in its sharding (FSDP x TP here) with the values of an
    unsharded load."""
    if fmt == "meta":
        write_meta(models["gqa"], tmp_path / "m", n_shards=2)
        path = tmp_path / "m"
    elif fmt == "native":
        llama_jax.save_native(*load_checkpoint(hf_dirs["gqa"]), tmp_path / "n")
        path = tmp_path / "n"
    else:
        path = hf_dirs["gqa"]
    placed = load_onto_a_mesh(path)
    assert placed["groups"][0]["attn"]["wq"].sharding.spec[1:3] == ("fsdp", "tensor")


def test_writers_take_an_existing_empty_directory_and_refuse_a_full_one(hf_dirs, tmp_path):
    config, params = load_checkpoint(hf_dirs["gqa"], dtype=jax.numpy.float32)  # a dtype-like
    for write, name in ((llama_jax.export_hf, "hf"), (llama_jax.save_native, "native")):
        empty = tmp_path / name
        empty.mkdir()
        write(config, params, empty)
        _, again = load_checkpoint(empty)
        chex.assert_trees_all_equal(again, params)
        full = tmp_path / f"{name}-full"
        full.mkdir()
        (full / "notes.txt").write_text("keep me")
        with pytest.raises(CheckpointError, match="not an empty directory"):
            write(config, params, full)
        assert [p.name for p in full.iterdir()] == ["notes.txt"]


def test_native_checkpoints_of_the_flat_layout_load(hf_dirs, tmp_path):
    """A native directory written before the component tree (flat `layers` of LLaMA tensors)."""
    import orbax.checkpoint as ocp
    import yaml
    from llama_jax.formats.legacy import legacy_target

    config, params = load_checkpoint(hf_dirs["gqa"])
    legacy = jax.tree.map(np.asarray, legacy_target(params))
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.yaml").write_text(yaml.safe_dump({"model": config.to_dict()}))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((tmp_path / "old" / "params").absolute(), legacy)
    checkpointer.wait_until_finished()
    _, loaded = load_checkpoint(tmp_path / "old", dtype="bfloat16")
    chex.assert_trees_all_equal(loaded, jax.tree.map(lambda b: b.astype(jax.numpy.bfloat16),
                                                     params))
