"""Tiny random checkpoints for the interop tests: HF models built by transformers, and the same
weights written in Meta's layout by an index-by-index permutation (independent of llama_jax's)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# Where real models are kept (make chat's MODELS)
MODELS = Path(os.environ.get("LLAMA_JAX_MODELS", Path.home() / ".cache" / "llama_jax"))
SMOLLM2 = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF, fetched by make chat's rule the first time."""
    if not SMOLLM2.is_file():
        subprocess.run(["make", "-s", f"MODELS={MODELS}", str(SMOLLM2)], cwd=ROOT, check=True,
                       timeout=600)
    return SMOLLM2


# A tokenizer's training text for the tiny SentencePiece checkpoint.
TEXT = ["The cat sat on the mat and looked at the dog.",
        "A dog is a good friend; a cat is a proud one.", "Numbers: 12 34 56 78 90."] * 40


def tiny_checkpoint_with_tokenizer(path: Path) -> Path:
    """The tiny preset (vocabulary 320) with random weights, saved natively at `path` with a
    SentencePiece tokenizer (300 pieces, byte fallback) whose EOS is the model's."""
    import dataclasses
    import io

    import jax
    import sentencepiece as spm

    import llama_jax

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_writer=model,
                                   vocab_size=300, model_type="bpe", byte_fallback=True,
                                   minloglevel=2)
    file = path.with_name(path.name + ".tokenizer.model")
    file.write_bytes(model.getvalue())
    tokenizer = llama_jax.load_tokenizer(file)
    config = dataclasses.replace(llama_jax.load_model_config("tiny"), vocab_size=320,
                                 eos_ids=tokenizer.eos_ids)
    llama_jax.save_native(config, llama_jax.init_params(config, jax.random.key(0)), path)
    (path / "tokenizer.model").write_bytes(model.getvalue())
    return path


HF_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5)
HF_CASES = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(num_key_value_heads=2),
    "mqa": dict(num_key_value_heads=1),
    "theta500k": dict(num_key_value_heads=2, rope_parameters=dict(rope_type="default",
                                                                  rope_theta=500000.0)),
    "llama3.1-tied": dict(num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32)),
    # Meta's params.json cannot say original_max_position_embeddings: it is always 8192.
    "llama3.2-tied": dict(num_key_value_heads=1, tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=8192)),
}


def hf_model(case: str, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**HF_BASE, **HF_CASES[case]})
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF's init is tiny (std 0.02); larger weights make logits distinct
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def enlarge_weights(model) -> None:
    """Weights larger than transformers' init (in place): distinct logits and decisive MoE
    routers (near-uniform router logits would let rounding flip top-k choices)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 1.0 if ".gate." in name else 0.1)


def assert_greedy_tokens_equal_generate(model, config, params, prompts, new_tokens=20):
    """Our greedy tokens under both decode implementations equal transformers' `generate`."""
    import torch

    import llama_jax

    for impl in ("scan", "unrolled"):
        ours = llama_jax.generate(config, params, prompts, new_tokens, stop_tokens=[],
                                  cache_dtype="float32", decode_impl=impl)
        for prompt, out in zip(prompts, ours):
            ids = torch.tensor([prompt])
            hf = model.generate(ids, attention_mask=torch.ones_like(ids),
                                max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
            assert out == hf[0, len(prompt):].tolist(), impl


def to_legacy_config(path: Path) -> None:
    """Rewrites a transformers 5 config.json in the 4.x form (rope_theta + rope_scaling)."""
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    (path / "config.json").write_text(json.dumps(cfg))


def meta_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rows (h, j·H/2 + i) → Meta rows (h, 2i + j), one index at a time."""
    out = np.empty_like(w)
    H = w.shape[0] // heads
    for h in range(heads):
        for i in range(H // 2):
            for j in range(2):
                out[h * H + 2 * i + j] = w[h * H + j * (H // 2) + i]
    return out


def write_meta(model, path: Path, n_shards: int = 2, vocab_parallel_embedding: bool = False):
    """Writes `model`'s weights as Meta's consolidated.NN.pth model-parallel shards."""
    import torch

    c = model.config
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    full = {"tok_embeddings.weight": sd["model.embed_tokens.weight"],
            "norm.weight": sd["model.norm.weight"]}
    if not c.tie_word_embeddings:
        full["output.weight"] = sd["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        p, m = f"model.layers.{i}.", f"layers.{i}."
        full[m + "attention.wq.weight"] = meta_rows(sd[p + "self_attn.q_proj.weight"],
                                                    c.num_attention_heads)
        full[m + "attention.wk.weight"] = meta_rows(sd[p + "self_attn.k_proj.weight"],
                                                    c.num_key_value_heads)
        full[m + "attention.wv.weight"] = sd[p + "self_attn.v_proj.weight"]
        full[m + "attention.wo.weight"] = sd[p + "self_attn.o_proj.weight"]
        full[m + "feed_forward.w1.weight"] = sd[p + "mlp.gate_proj.weight"]
        full[m + "feed_forward.w3.weight"] = sd[p + "mlp.up_proj.weight"]
        full[m + "feed_forward.w2.weight"] = sd[p + "mlp.down_proj.weight"]
        full[m + "attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        full[m + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]

    def split_axis(name):  # Meta's fairscale layers: column-, row-parallel, or replicated
        if "norm" in name:
            return None
        if name == "tok_embeddings.weight":
            return 0 if vocab_parallel_embedding else 1
        return 1 if name.endswith(("wo.weight", "w2.weight")) else 0

    path.mkdir(parents=True, exist_ok=True)
    for s in range(n_shards):
        shard = {}
        for name, w in full.items():
            axis = split_axis(name)
            part = w if axis is None else np.split(w, n_shards, axis=axis)[s]
            shard[name] = torch.from_numpy(np.ascontiguousarray(part))
        torch.save(shard, path / f"consolidated.{s:02d}.pth")
    rope = c.rope_parameters
    params = {"dim": c.hidden_size, "n_layers": c.num_hidden_layers,
              "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads,
              "vocab_size": -1 if not vocab_parallel_embedding else c.vocab_size,
              "multiple_of": 32, "ffn_dim_multiplier": 0.5, "norm_eps": c.rms_norm_eps,
              "rope_theta": rope["rope_theta"], "max_seq_len": c.max_position_embeddings}
    if rope.get("rope_type") == "llama3":
        params.update(use_scaled_rope=True, rope_scaling_factor=rope["factor"])
    (path / "params.json").write_text(json.dumps(params))


def load_onto_a_mesh(path):
    """Loads `path` straight onto an FSDP=4 x TP=2 mesh and checks every tensor arrives in its
    sharding with the values of an unsharded load; returns the placed parameters."""
    import jax

    import llama_jax
    from llama_jax.config import MeshConfig
    from llama_jax.parallel.sharding import make_mesh, param_shardings

    rules = MeshConfig(data=1, fsdp=4, tensor=2)
    mesh = make_mesh(rules)
    config, placed = llama_jax.load_checkpoint(path, mesh=mesh, mesh_config=rules)
    _, plain = llama_jax.load_checkpoint(path)
    shardings = param_shardings(llama_jax.param_specs(config), mesh, rules)
    for got, want, sharding in zip(jax.tree.leaves(placed), jax.tree.leaves(plain),
                                   jax.tree.leaves(shardings)):
        assert got.sharding == sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    return placed



def gguf_variants() -> dict[str, dict]:
    """Architectures GGUF export writes beyond the tiny preset's (fields replaced): Mixtral-
    style experts, and Llama-3.1's RoPE scaling (heads of 64 features, so the fit of its
    low/high factors from the file's divisors is used)."""
    from llama_jax.config import MoeConfig, RopeScaling

    return {"dense": {}, "moe": dict(mlp="moe", moe=MoeConfig(n_experts=4, top_k=2)),
            "llama3": dict(dim=128, n_heads=2, n_kv_heads=1, head_dim=64, rope_type="llama3",
                           rope_scaling=RopeScaling(
                               factor=4.0, original_max_position_embeddings=2048,
                               low_freq_factor=2.0, high_freq_factor=8.0))}


def stdlib_tokenizer() -> tuple[bytes, list[str]]:
    """A SentencePiece model (400 pieces) trained on Python's standard library, and its text."""
    from corpus import STDLIB
    from llama_jax.data.tokenizer import train_sentencepiece

    texts = [f.read_text(errors="replace")[:4000] for f in sorted(STDLIB.glob("[n-z]*.py"))[:20]]
    return train_sentencepiece(texts, 400), texts


def save_trained_here(path: Path, variant: str, tokenizer_model: bytes) -> Path:
    """A model as this library trains one: random weights (`gguf_variants()[variant]` on the
    tiny preset) and a SentencePiece tokenizer, saved natively at `path`."""
    import dataclasses

    import jax

    import llama_jax

    config = dataclasses.replace(llama_jax.load_model_config("tiny"), vocab_size=400,
                                 eos_ids=(2,), **gguf_variants()[variant])
    llama_jax.save_native(config, llama_jax.init_params(config, jax.random.key(0)), path)
    (path / "tokenizer.model").write_bytes(tokenizer_model)
    return path
