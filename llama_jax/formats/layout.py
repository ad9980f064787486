"""The one table that maps llama_jax parameters to the PyTorch checkpoints of HF and Meta.

Both ecosystems store `nn.Linear` weights as [out, in] and embeddings as [V, D]; llama_jax stores
[in..., out...] with head axes explicit (`wq: [D, N, H]`, `wo: [N, H, D]`), so a Linear weight
becomes ours by a transpose and a reshape. The only other difference is RoPE's layout: Meta's q/k
projection rows pair features (2i, 2i+1) of each head, HF's and ours pair (i, i + H/2). Loading
Meta weights permutes those rows per head — with the KV head count K for wk, which is where GQA
ports have gone wrong.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import numpy as np

from llama_jax.config import ModelConfig
from llama_jax.costs import abstract_params
from llama_jax.params import LayerParams, Params, param_specs


@dataclasses.dataclass(frozen=True)
class TorchTensor:
    leaf: str  # path in Params: "embed", "layers.wq", ...
    hf: str  # Hugging Face name; "{i}" is the layer index
    meta: str  # Meta name
    linear_in_axes: int = 0  # >0: an nn.Linear weight whose `in` is our first axes (after L)
    rope_heads: str = ""  # "N" or "K": q/k rows in Meta's interleaved RoPE layout

    @property
    def per_layer(self) -> bool:
        return self.leaf.startswith("layers.")


_LAYER = "model.layers.{i}."
TENSORS = (
    TorchTensor("embed", "model.embed_tokens.weight", "tok_embeddings.weight"),
    TorchTensor("final_norm", "model.norm.weight", "norm.weight"),
    TorchTensor("lm_head", "lm_head.weight", "output.weight", linear_in_axes=1),
    TorchTensor("layers.attn_norm", _LAYER + "input_layernorm.weight",
                "layers.{i}.attention_norm.weight"),
    TorchTensor("layers.wq", _LAYER + "self_attn.q_proj.weight", "layers.{i}.attention.wq.weight",
                1, "N"),
    TorchTensor("layers.wk", _LAYER + "self_attn.k_proj.weight", "layers.{i}.attention.wk.weight",
                1, "K"),
    TorchTensor("layers.wv", _LAYER + "self_attn.v_proj.weight", "layers.{i}.attention.wv.weight",
                1),
    TorchTensor("layers.wo", _LAYER + "self_attn.o_proj.weight", "layers.{i}.attention.wo.weight",
                2),
    TorchTensor("layers.ffn_norm", _LAYER + "post_attention_layernorm.weight",
                "layers.{i}.ffn_norm.weight"),
    TorchTensor("layers.w_gate", _LAYER + "mlp.gate_proj.weight",
                "layers.{i}.feed_forward.w1.weight", 1),
    TorchTensor("layers.w_up", _LAYER + "mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight",
                1),
    TorchTensor("layers.w_down", _LAYER + "mlp.down_proj.weight",
                "layers.{i}.feed_forward.w2.weight", 1),
)


def our_shape(config: ModelConfig, tensor: TorchTensor) -> tuple[int, ...] | None:
    """Shape of one layer's slice of the leaf (None: the leaf does not exist, e.g. tied head)."""
    spec = _get(param_specs(config), tensor.leaf)
    if spec is None:
        return None
    shape = spec.shape(config)
    return shape[1:] if tensor.per_layer else shape


def torch_shape(config: ModelConfig, tensor: TorchTensor) -> tuple[int, ...]:
    shape = our_shape(config, tensor)
    if not tensor.linear_in_axes:
        return shape
    k = tensor.linear_in_axes
    return (math.prod(shape[k:]), math.prod(shape[:k]))


def interleaved_to_half(w: np.ndarray, heads: int) -> np.ndarray:
    """Meta q/k rows (head, 2i + j) → half-split rows (head, j·H/2 + i)."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def half_to_interleaved(w: np.ndarray, heads: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def from_torch(config: ModelConfig, tensor: TorchTensor, w: np.ndarray, meta: bool) -> np.ndarray:
    """One checkpoint tensor (torch layout) → our layout for that leaf (one layer's slice)."""
    if meta and tensor.rope_heads:
        w = interleaved_to_half(w, getattr(config, tensor.rope_heads))
    if tensor.linear_in_axes:
        w = w.T
    return w.reshape(our_shape(config, tensor))


def to_torch(config: ModelConfig, tensor: TorchTensor, a: np.ndarray, meta: bool) -> np.ndarray:
    """Inverse of `from_torch`: our slice → a contiguous tensor in HF (or Meta) layout."""
    if tensor.linear_in_axes:
        a = a.reshape(math.prod(a.shape[:tensor.linear_in_axes]), -1).T
    if meta and tensor.rope_heads:
        a = half_to_interleaved(a, getattr(config, tensor.rope_heads))
    return np.ascontiguousarray(a)


Reader = Callable[[TorchTensor, "int | None"], np.ndarray]


Placement = Callable[[ModelConfig], "Params | None"]  # config -> a sharding per leaf, or None


def assemble(config: ModelConfig, read: Reader, dtype: np.dtype, meta: bool,
             placement: Placement | None = None) -> Params:
    """Builds Params leaf by leaf from `read(tensor, layer)` (torch layout, shape-checked by the
    reader). Each stacked leaf is filled layer by layer in `dtype` and moved to the devices —
    straight into its target sharding when `placement` gives one, each device receiving only
    its shard — before the next is read, so host memory holds one leaf at a time."""
    shardings = placement(config) if placement else None
    leaves = {}
    for tensor in TENSORS:
        shape = our_shape(config, tensor)
        if shape is None:
            continue
        if tensor.per_layer:
            out = np.empty((config.n_layers, *shape), dtype)
            for i in range(config.n_layers):
                out[i] = from_torch(config, tensor, read(tensor, i), meta)
        else:
            out = from_torch(config, tensor, read(tensor, None), meta).astype(dtype)
        leaves[tensor.leaf] = jax.device_put(
            out, _get(shardings, tensor.leaf) if shardings is not None else None)
        del out
    layers = {k.split(".", 1)[1]: v for k, v in leaves.items() if k.startswith("layers.")}
    return Params(embed=leaves["embed"], layers=LayerParams(**layers),
                  final_norm=leaves["final_norm"], lm_head=leaves.get("lm_head"))


def torch_tensors(config: ModelConfig, params: Params, meta: bool = False):
    """Yields (name, tensor) in torch layout for every weight, one at a time (for writers)."""
    for tensor in TENSORS:
        leaf = _get(params, tensor.leaf)
        if leaf is None:
            continue
        name = tensor.meta if meta else tensor.hf
        if tensor.per_layer:
            for i in range(config.n_layers):
                yield name.format(i=i), to_torch(config, tensor, np.asarray(leaf[i]), meta)
        else:
            yield name, to_torch(config, tensor, np.asarray(leaf), meta)


def placed_target(config: ModelConfig, placement: Placement | None) -> Params:
    """Abstract parameters for an orbax restore: on `placement`'s shardings, or on this
    process's first device (so a checkpoint saved on any mesh restores)."""
    shardings = placement(config) if placement else None
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract_params(config))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_params(config), shardings)


def with_dtype(config: ModelConfig, dtype: str) -> ModelConfig:
    """The loaded model's config: parameters stored and computed in `dtype`."""
    return dataclasses.replace(config, param_dtype=dtype, compute_dtype=dtype)


def _get(tree, path: str):
    for part in path.split("."):
        tree = getattr(tree, part)
    return tree
