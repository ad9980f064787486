"""Low-rank adapters (LoRA, Hu et al. 2021) on the model's matmul weights.

A target weight `W` (any of the layers' dense weights, e.g. attention's wq/wk/wv/wo and the
MLP's w_gate/w_up/w_down, float or int8) is replaced in the parameter tree by `Lora(W, A, B,
scale)`, which the matmuls (`ops.dense`) compute as

    x·W + scale · (x·A)·B,    scale = alpha / rank,

`A` over W's contracted axes and the rank (`[K.., r]`, PEFT's `lora_A` transposed), `B` over
the rank and W's output axes (`[r, N..]`, PEFT's `lora_B`). W is never widened, copied or
merged while training: the adapters' path costs 2·r·(K + N) FLOPs per token against W's 2·K·N.
`A` is initialised at random (Kaiming-uniform, as PEFT) and `B` at zero, so a fresh adapter
computes exactly the base model (the delta is an exact zero). Stacked weights `[L, ..]` get
stacked adapters `[L, ..]`: the layer scan slices them with their weights.

`with_adapters(params, adapters)` puts them in place (the adapters are a tree beside the
parameters, `{path: {"a", "b"}}`: a loss of `with_adapters(base, adapters)` differentiated by
the adapters never computes a gradient for the base); `merged(params)` folds them into plain
weights (W + scale·A·B) for decoding and export.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from llama_jax.errors import ConfigError
from llama_jax.quant import Int8, is_int8
from llama_jax.spec import is_spec


@struct.dataclass
class Lora:
    """A frozen weight and its low-rank adapter (see the module doc)."""

    base: jax.Array | Int8
    a: jax.Array  # [K.., r]: W's contracted (input) axes, then the rank
    b: jax.Array  # [r, N..]: the rank, then W's output axes
    scale: float = struct.field(pytree_node=False)  # alpha / rank
    n_in: int = struct.field(pytree_node=False, default=1)  # W's contracted axes


def is_lora(w: Any) -> bool:
    return isinstance(w, Lora)


def delta(x_MK: jax.Array, w: Lora) -> jax.Array:
    """scale · (x·A)·B for rows `x_MK` of W's contracted size: `[M, N]` in fp32."""
    r = w.a.shape[-1]
    a_Kr = w.a.reshape(-1, r).astype(x_MK.dtype)
    b_rN = w.b.reshape(r, -1).astype(x_MK.dtype)
    x_Mr = jnp.einsum("MK,Kr->Mr", x_MK, a_Kr, preferred_element_type=jnp.float32)
    return w.scale * jnp.einsum("Mr,rN->MN", x_Mr.astype(x_MK.dtype), b_rN,
                                preferred_element_type=jnp.float32)


def target_paths(params: dict, targets: Sequence[str]) -> list[str]:
    """The paths ("GROUP/BLOCK/NAME" into `params["groups"]`, "GROUP/LAYER/BLOCK/NAME" for
    per-layer weights) of every layer's weights named `targets`; a ConfigError names a target
    the layers do not have."""
    paths = list(_leaves(params["groups"], is_int8))
    names = {_name(p) for p in paths}
    missing = [t for t in targets if t not in names]
    if missing:
        raise ConfigError(f"lora.targets: {', '.join(map(repr, missing))} is not a weight of the "
                          f"model's layers (they have {', '.join(sorted(names))})")
    return [p for p in paths if _name(p) in targets]


def init_adapters(params: dict, specs: dict, targets: Sequence[str], rank: int,
                  key: jax.Array, dtype=jnp.float32) -> dict:
    """Fresh adapters for `targets`: `{path: {"a", "b"}}` (`target_paths`), A uniform in
    ±1/√K (PEFT's Kaiming-uniform bound over W's K contracted inputs), B zero. `specs` are the
    parameters' TensorSpecs (model.params.param_specs): a target must be a matmul weight (its
    spec names the axes its matmul contracts)."""
    if rank < 1:
        raise ConfigError(f"lora.rank={rank} must be >= 1")
    weights, specs = _leaves(params["groups"], is_int8), _leaves(specs["groups"], is_spec)
    adapters = {}
    for i, path in enumerate(target_paths(params, targets)):
        w, spec = weights[path], specs[_spec_path(path)]
        if not spec.contract:
            raise ConfigError(f"lora.targets: {_name(path)!r} is not a matmul "
                              "weight")
        lead = _stacked(path)
        shape = (w.values if is_int8(w) else w).shape
        n_in = len(spec.contract)
        inputs, outputs = shape[lead:lead + n_in], shape[lead + n_in:]
        bound = 1.0 / math.sqrt(math.prod(inputs))
        adapters[path] = {
            "a": jax.random.uniform(jax.random.fold_in(key, i), (*shape[:lead], *inputs, rank),
                                    dtype, -bound, bound),
            "b": jnp.zeros((*shape[:lead], rank, *outputs), dtype)}
    return adapters


def with_adapters(params: dict, adapters: dict, scale: float) -> dict:
    """`params` with each adapted weight replaced by `Lora(W, A, B, scale)`."""
    def put(path, w):
        ab = adapters.get(_path(path))
        if ab is None:
            return w
        return Lora(w, ab["a"], ab["b"], scale, ab["a"].ndim - 1 - _stacked(_path(path)))
    groups = jax.tree_util.tree_map_with_path(put, params["groups"], is_leaf=is_int8)
    return {**params, "groups": groups}


def merged(params: dict) -> dict:
    """`params` with every `Lora` folded into its weight: W + scale·A·B in fp32, then in W's
    dtype (an int8 weight's sum is its scales' float dtype: the sum is not int8)."""
    def fold(w):
        if not is_lora(w):
            return w
        base = w.base.values * w.base.scale if is_int8(w.base) else w.base
        lead = w.a.ndim - 1 - w.n_in  # a stacked group's layers' axis
        r = w.a.shape[-1]
        a = w.a.reshape(*w.a.shape[:lead], -1, r).astype(jnp.float32)
        b = w.b.reshape(*w.b.shape[:lead + 1], -1).astype(jnp.float32)
        ab = jnp.einsum("...kr,...rn->...kn", a, b, precision=jax.lax.Precision.HIGHEST)
        total = base.astype(jnp.float32) + w.scale * ab.reshape(base.shape)
        return total.astype(base.dtype)
    return jax.tree.map(fold, params, is_leaf=is_lora)


def _stacked(path: str) -> int:
    """1 for a scanned group's weight ("GROUP/BLOCK/NAME": `[L, ..]`), 0 for a layer's own."""
    return int(path.count("/") == 2)


def _path(keys) -> str:
    """A tree path of `params["groups"]` as "GROUP[/LAYER]/BLOCK/NAME"."""
    return "/".join(str(k.idx if hasattr(k, "idx") else k.key) for k in keys)


def _spec_path(path: str) -> str:
    """The path of a weight's spec: a stacked group's spec describes each of its layers, so a
    per-layer path ("GROUP/LAYER/BLOCK/NAME") drops its LAYER."""
    if _stacked(path):
        return path
    group, _, *rest = path.split("/")
    return "/".join([group, *rest])


def _name(path: str) -> str:
    return path.rsplit("/", 1)[1]


def _leaves(groups, is_leaf) -> dict[str, Any]:
    """The layer groups' leaves (`is_leaf`: an int8 weight or a spec is one) by path."""
    flat, _ = jax.tree_util.tree_flatten_with_path(groups, is_leaf=is_leaf)
    return {_path(keys): leaf for keys, leaf in flat}
