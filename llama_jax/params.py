"""Parameters: each tensor described once (shape letters, logical axes, initialiser).

Shapes, abstract arrays (`jax.eval_shape`), initialisation and — in the sharding layer — mesh
placements are all derived from `param_specs`, so a new tensor is one line here.

Layer weights are stacked along a leading L axis so the decoder runs them with `lax.scan`.
Projections keep the head axes explicit (`wq: [L, D, N, H]`), so einsums read like the math and
the logical axes can shard heads without reshapes.

Initialisation (Meta publishes none): N(0, init_std²) for embeddings and input projections, and
init_std/√(2L) for the two projections that write into the residual stream (wo, w_down), as in
GPT-2 and OLMo, so the residual variance stays O(1) with depth. Norm gains start at one.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import struct

from llama_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One parameter: its dimension letters, logical axis names and initialiser."""

    letters: str
    axes: tuple[str, ...]
    init: str  # "normal" (std = init_std * scale) or "ones"
    scale: float = 1.0

    def __post_init__(self):
        assert len(self.letters) == len(self.axes), (self.letters, self.axes)
        assert self.init in ("normal", "ones"), self.init

    def shape(self, config: ModelConfig) -> tuple[int, ...]:
        return tuple(getattr(config, letter) for letter in self.letters)


@struct.dataclass
class LayerParams:
    """The weights of all L blocks, stacked along the leading axis."""

    attn_norm: jax.Array  # [L, D]
    wq: jax.Array  # [L, D, N, H]
    wk: jax.Array  # [L, D, K, H]
    wv: jax.Array  # [L, D, K, H]
    wo: jax.Array  # [L, N, H, D]
    ffn_norm: jax.Array  # [L, D]
    w_gate: jax.Array  # [L, D, F]
    w_up: jax.Array  # [L, D, F]
    w_down: jax.Array  # [L, F, D]


@struct.dataclass
class Params:
    embed: jax.Array  # [V, D]
    layers: LayerParams
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [D, V]; None when tied to `embed`


def param_specs(config: ModelConfig) -> Params:
    """A `Params` tree whose leaves are `TensorSpec`s."""
    residual_out = 1 / math.sqrt(2 * config.n_layers)
    layers = LayerParams(
        attn_norm=TensorSpec("LD", ("layers", "norm"), "ones"),
        wq=TensorSpec("LDNH", ("layers", "embed", "q_heads", "head_dim"), "normal"),
        wk=TensorSpec("LDKH", ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        wv=TensorSpec("LDKH", ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        wo=TensorSpec("LNHD", ("layers", "q_heads", "head_dim", "embed"), "normal", residual_out),
        ffn_norm=TensorSpec("LD", ("layers", "norm"), "ones"),
        w_gate=TensorSpec("LDF", ("layers", "embed", "mlp"), "normal"),
        w_up=TensorSpec("LDF", ("layers", "embed", "mlp"), "normal"),
        w_down=TensorSpec("LFD", ("layers", "mlp", "embed"), "normal", residual_out),
    )
    return Params(
        embed=TensorSpec("VD", ("vocab", "embed"), "normal"),
        layers=layers,
        final_norm=TensorSpec("D", ("norm",), "ones"),
        lm_head=None if config.tie_embeddings else TensorSpec("DV", ("embed", "vocab"), "normal"),
    )


def init_params(config: ModelConfig, key: jax.Array) -> Params:
    """Random parameters in `config.param_dtype` (jit it with out_shardings to create them
    sharded; `jax.eval_shape` it to get shapes without allocating)."""
    specs, treedef = jax.tree.flatten(param_specs(config))
    keys = jax.random.split(key, len(specs))
    dtype = jnp.dtype(config.param_dtype)

    def init_one(spec: TensorSpec, k: jax.Array) -> jax.Array:
        shape = spec.shape(config)
        if spec.init == "ones":
            return jnp.ones(shape, dtype)
        std = config.init_std * spec.scale
        return (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    return jax.tree.unflatten(treedef, [init_one(s, k) for s, k in zip(specs, keys)])
