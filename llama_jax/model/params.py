"""Parameters: a tree of arrays built from the components' tensor descriptions.

    {"embed": {"table": [V, D]},
     "positions": {"table": [P, D]},                        # learned positions only
     "groups": ({"attn_norm": {...}, "attn": {"wq": [L, D, N, H], ...},  # (MLA: nn/attention/mla.py)
                 "mlp_norm": {...}, "mlp": {"w_up": [L, D, F], ...}}, ...),  # (MoE: nn/moe.py)
     "final_norm": {"scale": [D], ...},                     # pre-norm only
     "lm_head": {"w": [D, V]},                              # untied LM head only
     "head": {"w": [D, O], "b": [O]}}                       # or a task head (nn/heads.py)

A model is a sequence of layer groups (`layer_groups`); the blocks of one group share their
structure, so their weights are stacked along a leading L axis and run by one `lax.scan`.
`param_specs` is the single description every other part derives from: init, abstract shapes,
shardings, the weight-decay mask, parameter counts and FLOPs, memory plans, and the checkpoint
layouts. Projections keep the head axes explicit (`wq: [D, N, H]`), so einsums read like the
math and the logical axes can shard heads without reshapes.

Initialisation (Meta publishes none): N(0, init_std²) for embeddings and input projections, and
init_std/√(2L) for the two projections that write into the residual stream (W_O, W_down), as in
GPT-2 and OLMo, so the residual variance stays O(1) with depth. Gains start at one, biases at 0.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from llama_jax.config import ModelConfig
from llama_jax.nn.heads import head_specs
from llama_jax.nn.attention.mixers import mixer_of
from llama_jax.nn.mlp import mlp_specs
from llama_jax.nn.moe import moe_specs
from llama_jax.nn.norms import norm_specs
from llama_jax.nn.positions import position_specs
from llama_jax.quant import Int8, is_int8, to_int8
from llama_jax.spec import TensorSpec, is_spec, map_specs, spec_leaves, weight

Params = dict[str, Any]  # the tree above; leaves are arrays (or TensorSpecs, ShapeDtypeStructs)


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Consecutive blocks of the same structure, stacked and run by one scan."""

    n_layers: int
    moe: bool = False  # the block's MLP is the MoE (else the dense MLP)


def layer_groups(config: ModelConfig) -> tuple[LayerGroup, ...]:
    """One group, or with MoE its `first_dense_layers` dense blocks and then the MoE blocks."""
    if config.mlp != "moe":
        return (LayerGroup(config.n_layers),)
    dense = config.moe.first_dense_layers
    return ((LayerGroup(dense),) if dense else ()) + (LayerGroup(config.n_layers - dense, True),)


def block_specs(config: ModelConfig, group: LayerGroup) -> dict:
    """One block's tensors (unstacked): a norm and attention (GQA or MLA), a norm and an MLP
    (or MoE)."""
    residual_out = 1 / math.sqrt(2 * config.n_layers)
    mlp = (moe_specs if group.moe else mlp_specs)(config, residual_out)
    return {"attn_norm": norm_specs(config), "attn": mixer_of(config).specs(config, residual_out),
            "mlp_norm": norm_specs(config), "mlp": mlp}


def param_specs(config: ModelConfig) -> Params:
    """The parameter tree with a `TensorSpec` at every leaf."""
    dims = config.dims
    specs: Params = {"embed": {"table": weight(dims, "VD", ("vocab", "embed"), contract="D")}}
    positions = position_specs(config)
    if positions:
        specs["positions"] = positions
    specs["groups"] = tuple(map_specs(lambda s, n=group.n_layers: s.stacked(n),
                                      block_specs(config, group))
                            for group in layer_groups(config))
    if config.norm_position == "pre":
        specs["final_norm"] = norm_specs(config)
    specs = {**specs, **head_specs(config)}
    return _stored_as(config, specs) if config.quantize else specs


def _stored_as(config: ModelConfig, specs: Params) -> Params:
    """The specs with the matmul weights `config.quantize` stores as int8 marked so: the
    blocks' (attention, MLPs, experts; not the MoE router, whose logits pick experts), and with
    `quantize_head` the LM head and the embedding table."""
    def mark(spec: TensorSpec) -> TensorSpec:
        return dataclasses.replace(spec, dtype=config.quantize) if spec.contract else spec
    marked = {**specs, "groups": map_specs(mark, specs["groups"])}
    for name in ("embed", "lm_head") if config.quantize_head else ():
        if name in specs:
            marked[name] = map_specs(mark, specs[name])
    return marked


def init_params(config: ModelConfig, key: jax.Array) -> Params:
    """Random parameters in `config.param_dtype` (jit it with out_shardings to create them
    sharded; `jax.eval_shape` it to get shapes without allocating)."""
    return init_tensors(config, param_specs(config), key)


def init_tensors(config: ModelConfig, specs, key: jax.Array):
    """Random arrays for a tree of `TensorSpec`s (a part of the parameter tree), as
    `init_params` makes them."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    dtype = jnp.dtype(config.param_dtype)

    def init_one(spec: TensorSpec, k: jax.Array) -> jax.Array | Int8:
        if spec.init == "ones":
            return jnp.ones(spec.shape, dtype)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, dtype)
        std = config.init_std * spec.scale
        w = (std * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)
        return to_int8(w, spec.contract_axes) if spec.dtype == "int8" else w

    return jax.tree.unflatten(treedef, [init_one(s, k) for s, k in zip(leaves, keys)])


def abstract_params(config: ModelConfig) -> Params:
    """`jax.ShapeDtypeStruct`s of the parameters, from their descriptions (an `Int8` of two
    for a quantized weight)."""
    def abstract(spec: TensorSpec) -> jax.ShapeDtypeStruct | Int8:
        if spec.dtype == "int8":
            return Int8(jax.ShapeDtypeStruct(spec.shape, jnp.int8),
                        jax.ShapeDtypeStruct(spec.scale_shape, jnp.float32))
        return jax.ShapeDtypeStruct(spec.shape, jnp.dtype(config.param_dtype))
    return map_specs(abstract, param_specs(config))


def quantize_params(config: ModelConfig, params: Params, quantize: str = "int8",
                    head: bool = False) -> tuple[ModelConfig, Params]:
    """The quantized model of a float model: its config with `quantize` (and `quantize_head`)
    set, and its parameters with those weights stored so."""
    config = config.with_execution(quantize=quantize, quantize_head=head)
    specs = param_specs(config)
    leaves = [to_int8(w, spec.contract_axes) if spec.dtype == "int8" and not is_int8(w) else w
              for spec, w in zip(spec_leaves(specs), jax.tree.leaves(params, is_leaf=is_int8))]
    return config, jax.tree.unflatten(jax.tree.structure(specs, is_leaf=is_spec), leaves)


def flat_paths(tree, whole_int8: bool = False) -> dict[str, Any]:
    """`{"groups/0/attn/wq": leaf, ...}`: every leaf of a parameter tree by its path (an int8
    weight's two arrays as `.../wq/values` and `.../wq/scale`, or as one `Int8` at `.../wq`
    when `whole_int8`)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: is_spec(x) or (whole_int8 and is_int8(x)))
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                     for k in path): leaf
            for path, leaf in flat}
