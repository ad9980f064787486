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
from typing import Callable, Iterator

import jax
import numpy as np

from llama_jax.config import ModelConfig
from llama_jax.formats import CheckpointError
from llama_jax.nn.spec import TensorSpec
from llama_jax.params import Params, abstract_params, flat_paths, layer_groups, param_specs


@dataclasses.dataclass(frozen=True)
class TorchTensor:
    """How one of our tensors is stored in PyTorch checkpoints. `path` is its place in the
    parameter tree — relative to the block for per-layer tensors ("attn/wq"), from the root
    otherwise ("embed/table")."""

    path: str
    hf: str  # Hugging Face name; "{i}" is the layer index
    meta: str  # Meta name
    linear_in_axes: int = 0  # >0: an nn.Linear weight whose `in` is our first axes (after L)
    rope_heads: str = ""  # "N" or "K": q/k rows in Meta's interleaved RoPE layout
    per_layer: bool = False


def _layer(path: str, hf: str, meta: str, linear_in_axes: int = 0, rope_heads: str = ""):
    return TorchTensor(path, "model.layers.{i}." + hf, "layers.{i}." + meta, linear_in_axes,
                       rope_heads, per_layer=True)


# LLaMA's tensors: every tensor of a LLaMA-architecture parameter tree, by path.
LLAMA = {t.path: t for t in (
    TorchTensor("embed/table", "model.embed_tokens.weight", "tok_embeddings.weight"),
    TorchTensor("final_norm/scale", "model.norm.weight", "norm.weight"),
    TorchTensor("lm_head/w", "lm_head.weight", "output.weight", linear_in_axes=1),
    _layer("attn_norm/scale", "input_layernorm.weight", "attention_norm.weight"),
    _layer("attn/wq", "self_attn.q_proj.weight", "attention.wq.weight", 1, "N"),
    _layer("attn/wk", "self_attn.k_proj.weight", "attention.wk.weight", 1, "K"),
    _layer("attn/wv", "self_attn.v_proj.weight", "attention.wv.weight", 1),
    _layer("attn/wo", "self_attn.o_proj.weight", "attention.wo.weight", 2),
    _layer("mlp_norm/scale", "post_attention_layernorm.weight", "ffn_norm.weight"),
    _layer("mlp/w_gate", "mlp.gate_proj.weight", "feed_forward.w1.weight", 1),
    _layer("mlp/w_up", "mlp.up_proj.weight", "feed_forward.w3.weight", 1),
    _layer("mlp/w_down", "mlp.down_proj.weight", "feed_forward.w2.weight", 1),
)}


@dataclasses.dataclass(frozen=True)
class Slot:
    """One tensor of a checkpoint: where it goes in our tree and how it is stored."""

    tree_path: str  # "groups/0/attn/wq"
    tensor: TorchTensor
    spec: TensorSpec
    layers: range  # checkpoint layer indices of a stacked leaf (empty for the others)

    @property
    def shape(self) -> tuple[int, ...]:
        """Our shape of one layer's slice (or of the whole leaf)."""
        return self.spec.shape[1:] if self.layers else self.spec.shape


def slots(config: ModelConfig, table: dict[str, TorchTensor] = LLAMA) -> list[Slot]:
    """Every tensor of `config`'s parameter tree, matched with its checkpoint description. A
    tensor the table has no name for is an error naming the architecture field to blame."""
    offsets = np.cumsum([0] + [g.n_layers for g in layer_groups(config)])
    out = []
    for tree_path, spec in flat_paths(param_specs(config)).items():
        parts = tree_path.split("/")
        stacked = parts[0] == "groups"
        key = "/".join(parts[2:]) if stacked else tree_path
        if key not in table:
            raise CheckpointError(
                f"tensor {tree_path} has no name in this checkpoint format: the format stores "
                f"LLaMA-architecture models (norm={config.norm!r}, mlp={config.mlp!r}, "
                f"positions={config.positions!r}, bias={config.bias} is not one)")
        layers = (range(offsets[int(parts[1])], offsets[int(parts[1]) + 1]) if stacked
                  else range(0))
        out.append(Slot(tree_path, table[key], spec, layers))
    return out


def torch_shape(slot: Slot) -> tuple[int, ...]:
    shape = slot.shape
    if not slot.tensor.linear_in_axes:
        return shape
    k = slot.tensor.linear_in_axes
    return (math.prod(shape[k:]), math.prod(shape[:k]))


def interleaved_to_half(w: np.ndarray, heads: int) -> np.ndarray:
    """Meta q/k rows (head, 2i + j) → half-split rows (head, j·H/2 + i)."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def half_to_interleaved(w: np.ndarray, heads: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def from_torch(config: ModelConfig, slot: Slot, w: np.ndarray, meta: bool) -> np.ndarray:
    """One checkpoint tensor (torch layout) → our layout for that leaf (one layer's slice)."""
    tensor = slot.tensor
    if meta and tensor.rope_heads:
        w = interleaved_to_half(w, getattr(config, tensor.rope_heads))
    if tensor.linear_in_axes:
        w = w.T
    return w.reshape(slot.shape)


def to_torch(config: ModelConfig, slot: Slot, a: np.ndarray, meta: bool) -> np.ndarray:
    """Inverse of `from_torch`: our slice → a contiguous tensor in HF (or Meta) layout."""
    tensor = slot.tensor
    if tensor.linear_in_axes:
        a = a.reshape(math.prod(a.shape[:tensor.linear_in_axes]), -1).T
    if meta and tensor.rope_heads:
        a = half_to_interleaved(a, getattr(config, tensor.rope_heads))
    return np.ascontiguousarray(a)


def names(slot: Slot, meta: bool = False) -> list[str]:
    """The checkpoint name(s) of a slot: one per layer for stacked leaves."""
    name = slot.tensor.meta if meta else slot.tensor.hf
    return [name.format(i=i) for i in slot.layers] if slot.layers else [name]


Reader = Callable[[Slot, "int | None"], np.ndarray]


Placement = Callable[[ModelConfig], "Params | None"]  # config -> a sharding per leaf, or None


def assemble(config: ModelConfig, read: Reader, dtype: np.dtype, meta: bool,
             placement: Placement | None = None) -> Params:
    """Builds the parameter tree leaf by leaf from `read(slot, layer)` (torch layout,
    shape-checked by the reader). Each stacked leaf is filled layer by layer in `dtype` and
    moved to the devices — straight into its target sharding when `placement` gives one, each
    device receiving only its shard — before the next is read, so host memory holds one leaf
    at a time."""
    shardings = flat_paths(placement(config)) if placement else {}
    leaves = {}
    for slot in slots(config):
        if slot.layers:
            out = np.empty(slot.spec.shape, dtype)
            for j, i in enumerate(slot.layers):
                out[j] = from_torch(config, slot, read(slot, i), meta)
        else:
            out = from_torch(config, slot, read(slot, None), meta).astype(dtype)
        leaves[slot.tree_path] = jax.device_put(out, shardings.get(slot.tree_path))
        del out
    return unflatten(config, leaves)


def unflatten(config: ModelConfig, leaves: dict[str, jax.Array]) -> Params:
    """The parameter tree of `config` from its leaves by path."""
    specs = param_specs(config)
    treedef = jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, TensorSpec))
    return jax.tree.unflatten(treedef, [leaves[path] for path in flat_paths(specs)])


def torch_tensors(config: ModelConfig, params: Params, meta: bool = False
                  ) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, tensor) in torch layout for every weight, one at a time (for writers)."""
    leaves = flat_paths(params)
    for slot in slots(config):
        leaf = leaves[slot.tree_path]
        if slot.layers:
            for j, name in enumerate(names(slot, meta)):
                yield name, to_torch(config, slot, np.asarray(leaf[j]), meta)
        else:
            yield names(slot, meta)[0], to_torch(config, slot, np.asarray(leaf), meta)


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
    return config.with_execution(param_dtype=dtype, compute_dtype=dtype)
