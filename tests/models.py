"""The tiny models the model, decode and server tests share: the tiny preset and its variants
(by KV heads; the serving mixers and MLPs), their random parameters, and random prompts."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

import llama_jax
from llama_jax.config import MoeConfig

TINY = llama_jax.load_model_config("tiny")  # GQA (N=4, K=2), untied, rope_theta 10000
# Multi-head, grouped-query and multi-query attention: N=4 query heads over K KV heads
BY_KV_HEADS = {name: dataclasses.replace(TINY, n_kv_heads=k)
               for name, k in {"mha": 4, "gqa": 2, "mqa": 1}.items()}
# The cache kinds and MLPs a server's programs must carry: GQA, MLA's latent cache, an MoE with
# a capacity factor (so rows could compete for experts, and must not)
MLA_TINY = dataclasses.replace(TINY, attention="mla", n_kv_heads=None, head_dim=None,
                               mla=llama_jax.MlaConfig(kv_lora_rank=24, qk_nope_head_dim=12,
                                                       qk_rope_head_dim=8, v_head_dim=16))
SERVING = {
    "gqa": TINY,
    "mla": MLA_TINY,
    "moe": dataclasses.replace(TINY, mlp="moe", moe=MoeConfig(n_experts=4, top_k=2,
                                                              capacity_factor=1.0)),
}


def random_params(configs: dict, seed: int = 0) -> dict:
    """Each named config's parameters, initialised from key seed + its index."""
    return {name: llama_jax.init_params(config, jax.random.key(seed + i))
            for i, (name, config) in enumerate(configs.items())}


def prompts(lengths, seed: int = 0, vocab: int = TINY.vocab_size) -> list[list[int]]:
    """Random token-id prompts of the given lengths."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]
