"""Checkpoints written before parameters became a tree of components (llama_jax 0.1: a flat
`Params(embed, layers=LayerParams(attn_norm, wq, ...), final_norm, lm_head)` of LLaMA tensors).

Their parameters restore into today's tree: the same arrays, moved to their new paths. Only
LLaMA-architecture models existed then, so every old leaf has exactly one new place.
"""

from __future__ import annotations

from typing import Any

from llama_jax.config import ModelConfig
from llama_jax.formats.loading import unflatten
from llama_jax.model.params import Params, flat_paths

# old path -> today's path
PATHS = {
    "embed": "embed/table", "final_norm": "final_norm/scale", "lm_head": "lm_head/w",
    "layers/attn_norm": "groups/0/attn_norm/scale", "layers/wq": "groups/0/attn/wq",
    "layers/wk": "groups/0/attn/wk", "layers/wv": "groups/0/attn/wv",
    "layers/wo": "groups/0/attn/wo", "layers/ffn_norm": "groups/0/mlp_norm/scale",
    "layers/w_gate": "groups/0/mlp/w_gate", "layers/w_up": "groups/0/mlp/w_up",
    "layers/w_down": "groups/0/mlp/w_down",
}


def is_legacy(stored: Any) -> bool:
    """Whether an orbax metadata tree (or restored tree) has the old flat layout."""
    return isinstance(stored, dict) and "layers" in stored and "groups" not in stored


def legacy_target(target: Params) -> dict:
    """A tree of today's layout — an abstract restore target (shapes, dtypes, shardings) or
    arrays — rearranged into the old layout, leaf for leaf."""
    leaves = flat_paths(target)
    tree: dict = {}
    for old, new in PATHS.items():
        if new in leaves:
            *parents, name = old.split("/")
            node = tree
            for parent in parents:
                node = node.setdefault(parent, {})
            node[name] = leaves[new]
    return tree


def from_legacy(config: ModelConfig, restored: dict) -> Params:
    """A tree restored in the old layout, as today's parameter tree."""
    leaves = flat_paths(restored)
    return unflatten(config, {PATHS[old]: leaf for old, leaf in leaves.items()})
