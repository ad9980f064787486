"""The tiny models the model, component, decode and server tests share: the tiny preset and its
variants (by KV heads; the serving mixers and MLPs), the components' base, their random
parameters (every leaf random, for comparing paths), and random prompts."""

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
# The component tests' base: small, with attention blocks smaller than its sequences.
COMPONENTS_BASE = llama_jax.ModelConfig(vocab_size=256, dim=48, n_layers=2, n_heads=4,
                                        n_kv_heads=2, multiple_of=16, max_seq_len=64,
                                        attention_block_q=8, attention_block_kv=16)
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


def randomised_params(config, seed: int = 0):
    """Parameters with every leaf random — gains and biases too, which init sets to 1 and 0 —
    so that each one matters to the comparisons; MoE routers decisive (near-uniform router
    logits would let rounding noise flip top-k choices between paths)."""
    params = llama_jax.init_params(config, jax.random.key(seed))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))

    def randomised(path, leaf, k):
        if "router" in jax.tree_util.keystr(path):
            return 30 * leaf
        if leaf.ndim <= 3 and _constant(leaf):
            return leaf + 0.3 * jax.random.normal(k, leaf.shape, leaf.dtype)
        return leaf
    return jax.tree.unflatten(treedef, [randomised(path, leaf, k)
                                        for (path, leaf), k in zip(leaves, keys)])


def _constant(leaf) -> bool:
    return leaf.std() == 0  # exactly the constant-initialised gains and biases


def one_step_each_way(run, batch, frozen=lambda run, mesh: ()) -> list[tuple[dict, float]]:
    """(trained tensors after one step, its loss) of `run` from the same initial state on one
    device and on a data=2, fsdp=2, tensor=2 mesh of 8; `frozen(run, mesh)` gives the step's
    further arguments (a LoRA run's base)."""
    from llama_jax.parallel import sharding
    from llama_jax.training import trainer

    results = []
    for mesh_config, devices in ((llama_jax.MeshConfig(data=1), jax.devices()[:1]),
                                 (llama_jax.MeshConfig(data=2, fsdp=2, tensor=2), jax.devices())):
        placed = dataclasses.replace(run, mesh=mesh_config)
        mesh = sharding.make_mesh(mesh_config, devices)
        programs = trainer.compile_programs(placed, 1, mesh, evaluate=False)
        state, metrics = programs.step(programs.init(jax.random.key(0)),
                                       jax.device_put(batch, programs.batch_sharding),
                                       *frozen(placed, mesh))
        results.append((jax.device_get(state.params), float(metrics["loss"])))
    return results
