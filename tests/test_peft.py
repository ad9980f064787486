"""LoRA adapters exchanged with Hugging Face PEFT (formats/peft.py): a LoRA run's adapters
written for PEFT give, on the transformers base, our merged model's logits; an adapter PEFT
wrote loads as its merged model and starts a LoRA run; `--to hf` writes the merged model;
what PEFT computes differently is refused by name."""

import json

import chex
import jax
import numpy as np
import pytest
import yaml

import llama_jax
from llama_jax.errors import CheckpointError, ConfigError
from llama_jax.formats import peft as peft_format, workdir as run_dir
from llama_jax.formats.convert import convert, float32_logits, peft_logits
from llama_jax.parallel import sharding
from llama_jax.training import finetune, trainer

from chats import chats
from checkpoints import hf_logits, hf_model, tiny_checkpoint_with_tokenizer

peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")

TOKENS = np.random.default_rng(0).integers(0, 320, (2, 20))


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """A transformers Llama (GQA, vocabulary 320) saved with a SentencePiece tokenizer."""
    root = tmp_path_factory.mktemp("peft")
    with_tokenizer = tiny_checkpoint_with_tokenizer(root / "tokenizer")
    model = hf_model("gqa")
    model.resize_token_embeddings(320)
    torch.nn.init.normal_(model.model.embed_tokens.weight, 0, 0.1)
    torch.nn.init.normal_(model.lm_head.weight, 0, 0.1)
    model.save_pretrained(root / "base")
    (root / "base" / "tokenizer.model").write_bytes(
        (with_tokenizer / "tokenizer.model").read_bytes())
    return root, root / "base", model


def lora_tree(root, init_from, **lora) -> dict:
    return {"init_from": str(init_from),
            "lora": {"rank": 4, "alpha": 8, "targets": ["wq", "wk", "wv", "wo", "w_gate",
                                                       "w_up", "w_down"], **lora},
            "task": {"kind": "chat", "train": chats(root / "train.jsonl", 48, 0),
                     "val": chats(root / "val.jsonl", 8, 1)},
            "train": {"seq_len": 128, "batch_size": 8, "steps": 8, "learning_rate": 1e-2,
                      "warmup_steps": 0, "eval_every": 8, "checkpoint_every": 8}}


def load_run(root, tree, name) -> llama_jax.RunConfig:
    (root / f"{name}.yaml").write_text(yaml.safe_dump(tree))
    return finetune.load_run_config(root / f"{name}.yaml")


@pytest.fixture(scope="module")
def lora_run(hf_base):
    root, base, _ = hf_base
    run = load_run(root, lora_tree(root, base), "lora")
    trainer.train(run, root / "run", log=lambda _: None, progress=False)
    return root / "run"


def test_our_adapter_on_the_transformers_base_through_peft_gives_our_merged_logits(
        hf_base, lora_run, tmp_path):
    root, base, model = hf_base
    report = convert(lora_run, tmp_path / "adapter", to="peft")
    assert report["vs_peft"] < 1e-5, report
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (settings["r"], settings["lora_alpha"], settings["target_modules"]) == (
        4, 8.0, sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    theirs = peft_logits(str(base), tmp_path / "adapter", TOKENS)
    config, merged = llama_jax.load_checkpoint(lora_run, "float32")
    np.testing.assert_allclose(float32_logits(config, merged, TOKENS), theirs, rtol=1e-4,
                               atol=1e-4)
    assert np.abs(theirs - hf_logits(model, TOKENS)).max() > 1e-2  # the adapter is not zero
    assert (tmp_path / "adapter" / "tokenizer.model").is_file()


def test_a_lora_run_converts_to_its_merged_hugging_face_model(hf_base, lora_run, tmp_path):
    import transformers

    convert(lora_run, tmp_path / "merged", to="hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                              dtype=torch.float32)
    config, merged = llama_jax.load_checkpoint(lora_run, "float32")
    np.testing.assert_allclose(hf_logits(model, TOKENS),
                               float32_logits(config, merged, TOKENS), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def their_adapter(hf_base, tmp_path_factory):
    """An adapter made and saved by PEFT itself, its B random (a fresh one computes the
    base)."""
    import transformers

    _, base, _ = hf_base
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(0)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False))
    path = tmp_path_factory.mktemp("theirs") / "adapter"
    wrapped.save_pretrained(path)
    with torch.no_grad():
        logits = wrapped.eval()(torch.as_tensor(TOKENS)).logits.numpy()
    return path, logits


def test_a_peft_adapter_loads_as_its_merged_model(their_adapter):
    path, theirs = their_adapter
    config, params = llama_jax.load_checkpoint(path, "float32")
    assert config == llama_jax.checkpoint_config(path)
    np.testing.assert_allclose(float32_logits(config, params, TOKENS), theirs, rtol=1e-4,
                               atol=1e-4)


def test_a_lora_run_continues_a_peft_adapter(hf_base, their_adapter):
    """`init_from: PEFT_DIR`: the base is the adapter's, the adapters start as PEFT saved
    them; a lora section of another shape is refused, naming the field."""
    root, _, _ = hf_base
    path, _ = their_adapter
    tree = lora_tree(root, path, targets=["wq", "wv", "w_down"])
    run = load_run(root, tree, "continued")
    mesh = sharding.make_mesh(run.mesh)
    state = trainer.initializer(run, mesh).init(jax.random.key(0))
    _, adapters = peft_format.load(path, run.model)
    chex.assert_trees_all_equal(jax.device_get(state.params), adapters)
    bad = load_run(root, {**tree, "lora": {**tree["lora"], "rank": 8}}, "bad")
    with pytest.raises(ConfigError, match=r"lora.rank=8, but the init_from PEFT adapter .* "
                                          r"has 4"):
        trainer.train(bad, root / "bad", log=lambda _: None, progress=False)
    assert not (root / "bad").exists()


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, r"use_dora=True is not supported"),
    ({"use_rslora": True}, r"use_rslora=True is not supported"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, r"target_modules .* are not \(all\) Linear"),
    ({"base_model_name_or_path": "someone/some-model"},
     r"base_model_name_or_path 'someone/some-model' is not a checkpoint on this machine"),
])
def test_what_peft_computes_differently_is_refused(their_adapter, tmp_path, change, message):
    import shutil

    path, _ = their_adapter
    copy = tmp_path / "adapter"
    shutil.copytree(path, copy)
    settings = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**settings, **change}))
    with pytest.raises(CheckpointError, match=message):
        llama_jax.load_checkpoint(copy)


def test_to_peft_refuses_a_run_without_adapters(tmp_path):
    base = tiny_checkpoint_with_tokenizer(tmp_path / "base")
    with pytest.raises(CheckpointError, match=r"--to peft writes a LoRA run's adapters"):
        convert(base, tmp_path / "out", to="peft")
    assert not (tmp_path / "out").exists()


def test_a_lora_runs_adapters_match_peft_after_a_round_trip(lora_run, tmp_path):
    """Written and read back: the same arrays (the gate's check, made here on its own)."""
    convert(lora_run, tmp_path / "adapter", to="peft", reference=False)
    chex.assert_trees_all_equal(peft_format.load(tmp_path / "adapter",
                                                 run_dir.run_config(lora_run).model)[1],
                                run_dir.load_adapters(lora_run))
