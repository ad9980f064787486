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
stacked adapters `[L, ..]`: the layer scan slices them with their weights. A MoE's routed
experts `[L, E, ..]` get an adapter each (`[L, E, K.., r]`, `[L, E, r, N..]`), computed by the
experts' batched or grouped matmuls as their weights are (ops.einsum_f32, ops.grouped_f32).

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
from llama_jax.spec import TensorSpec, is_spec


@struct.dataclass
class Lora:
    """A frozen weight and its low-rank adapter (see the module doc)."""

    base: jax.Array | Int8
    a: jax.Array  # [K.., r]: W's contracted (input) axes, then the rank
    b: jax.Array  # [r, N..]: the rank, then W's output axes
    scale: float = struct.field(pytree_node=False)  # alpha / rank
    n_in: int = struct.field(pytree_node=False, default=1)  # W's contracted axes
    # dropout on the adapter's inputs while training: the probability, and the key of its
    # mask (`[L]` keys for a stacked weight); None: no dropout
    key: jax.Array | None = None
    dropout: float = struct.field(pytree_node=False, default=0.0)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)


def is_lora(w: Any) -> bool:
    return isinstance(w, Lora)


def dropped(x: jax.Array, w: Lora) -> jax.Array:
    """The adapter's input: `x` with its dropout applied (when it has a key), else `x`."""
    if w.key is None or w.dropout == 0:
        return x
    keep = jax.random.bernoulli(w.key, 1.0 - w.dropout, x.shape)
    return jnp.where(keep, x / (1.0 - w.dropout), 0).astype(x.dtype)


def delta_equations(equation: str) -> tuple[str, str]:
    """The two einsums of an adapter's path for the weight einsum `equation` ("BECD,EDM->BECM":
    per-expert weights, batched over E): x·A into the rank ("BECD,EDr->BECr"), then ·B out of
    it ("BECr,ErM->BECM")."""
    inputs, out = equation.split("->")
    lhs, rhs = inputs.split(",")
    batched = [c for c in rhs if c in lhs and c in out]
    contracted = [c for c in rhs if c in lhs and c not in out]
    outputs = [c for c in rhs if c not in lhs]
    mid = "".join(c for c in lhs if c not in contracted) + "r"
    return (f"{lhs},{''.join(batched + contracted)}r->{mid}",
            f"{mid},{''.join(batched)}r{''.join(outputs)}->{out}")


def delta(x_MK: jax.Array, w: Lora) -> jax.Array:
    """scale · (x·A)·B for rows `x_MK` of W's contracted size: `[M, N]` in fp32."""
    r = w.a.shape[-1]
    x_MK = dropped(x_MK, w)
    a_Kr = w.a.reshape(-1, r).astype(x_MK.dtype)
    b_rN = w.b.reshape(r, -1).astype(x_MK.dtype)
    x_Mr = jnp.einsum("MK,Kr->Mr", x_MK, a_Kr, preferred_element_type=jnp.float32)
    return w.scale * jnp.einsum("Mr,rN->MN", x_Mr.astype(x_MK.dtype), b_rN,
                                preferred_element_type=jnp.float32)


def target_paths(params: dict, targets: Sequence[str]) -> list[str]:
    """The paths ("GROUP/BLOCK/NAME" into `params["groups"]`, "GROUP/LAYER/BLOCK/NAME" for
    per-layer weights) of every layer's weights named `targets`: a weight's name ("w_gate"),
    or the end of its path ("shared/w_gate": a MoE layer's shared experts alone). A
    ConfigError names a target the layers do not have."""
    paths = list(_leaves(params["groups"], is_int8))

    def named(path: str, target: str) -> bool:
        return ("/" + path).endswith("/" + target)
    missing = [t for t in targets if not any(named(p, t) for p in paths)]
    if missing:
        names = sorted({_name(p) for p in paths})
        raise ConfigError(f"lora.targets: {', '.join(map(repr, missing))} is not a weight of the "
                          f"model's layers (they have {', '.join(names)})")
    return [p for p in paths if any(named(p, t) for t in targets)]


def adapter_specs(params: dict, specs: dict, targets: Sequence[str],
                  rank: int) -> dict[str, dict[str, TensorSpec]]:
    """The adapters' descriptions `{path: {"a", "b"}}` for `targets` (`target_paths`): their
    shapes, and logical axes that place them on a mesh as their weight is placed (A along W's
    inputs, B along its outputs; the rank is "lora_rank", replicated by default). `specs` are
    the parameters' TensorSpecs (model.params.param_specs): a target must be a matmul weight
    (its spec names the axes its matmul contracts). Their init is `init_adapters`'."""
    if rank < 1:
        raise ConfigError(f"lora.rank={rank} must be >= 1")
    layer_specs = _leaves(specs["groups"], is_spec)
    out = {}
    for path in target_paths(params, targets):
        spec = layer_specs[_spec_path(path)]
        if not spec.contract:
            raise ConfigError(f"lora.targets: {_name(path)!r} is not a matmul weight")
        lead = "" if _stacked(path) else "L"  # a per-layer weight's spec has no L
        letters = [c for c in spec.letters if c not in lead]
        # the layers' and (MoE) the experts' axes: each has adapters of its own
        stack = [c for c in letters if c in "LE"]
        inputs = [c for c in letters if c in spec.contract]
        outputs = [c for c in letters if c not in spec.contract and c not in stack]

        def part(chosen: list[str], zeros: bool) -> TensorSpec:
            dims = {**dict(zip(spec.letters, spec.shape)), "r": rank}
            axes = {**dict(zip(spec.letters, spec.axes)), "r": "lora_rank"}
            return TensorSpec("".join(chosen), tuple(dims[c] for c in chosen),
                              tuple(axes[c] for c in chosen), "zeros" if zeros else "normal")
        out[path] = {"a": part(stack + inputs + ["r"], False),
                     "b": part(stack + ["r"] + outputs, True)}
    return out


def init_adapters(params: dict, specs: dict, targets: Sequence[str], rank: int,
                  key: jax.Array, dtype=jnp.float32) -> dict:
    """Fresh adapters for `targets` (`adapter_specs`): A uniform in ±1/√K (PEFT's
    Kaiming-uniform bound over W's K contracted inputs), B zero."""
    return init_from_specs(adapter_specs(params, specs, targets, rank), key, dtype)


def init_from_specs(specs: dict[str, dict[str, TensorSpec]], key: jax.Array,
                    dtype=jnp.float32) -> dict:
    """Fresh adapters of these descriptions (`adapter_specs`): A uniform in ±1/√K, B zero."""
    adapters = {}
    for i, (path, ab) in enumerate(specs.items()):
        a, b = ab["a"], ab["b"]
        n_in = len(a.letters) - 1 - a.letters.count("L") - a.letters.count("E")
        bound = 1.0 / math.sqrt(math.prod(a.shape[-1 - n_in:-1]))
        adapters[path] = {"a": jax.random.uniform(jax.random.fold_in(key, i), a.shape, dtype,
                                                  -bound, bound),
                          "b": jnp.zeros(b.shape, dtype)}
    return adapters


def with_adapters(params: dict, adapters: dict, scale: float, dropout: float = 0.0,
                  key: jax.Array | None = None) -> dict:
    """`params` with each adapted weight replaced by `Lora(W, A, B, scale)`; with a `key` and a
    `dropout` probability, each adapter drops its inputs with a mask of its own (each layer's
    own, for a stacked weight), as PEFT's `lora_dropout` does while training."""
    paths = list(adapters)

    def put(keys, w):
        path = _path(keys)
        ab = adapters.get(path)
        if ab is None:
            return w
        lead = _stacked(path)
        mask_key = None
        if key is not None and dropout > 0:
            mask_key = jax.random.fold_in(key, paths.index(path))
            if lead:
                mask_key = jax.random.split(mask_key, ab["a"].shape[0])
        return Lora(w, ab["a"], ab["b"], scale, ab["a"].ndim - 1 - _lead(path), mask_key,
                    dropout)
    groups = jax.tree_util.tree_map_with_path(put, params["groups"], is_leaf=is_int8)
    return {**params, "groups": groups}


def merged(params: dict) -> dict:
    """`params` with every `Lora` folded into its weight: W + scale·A·B in fp32, then in W's
    dtype (an int8 weight's sum is its scales' float dtype: the sum is not int8)."""
    def fold(w):
        if not is_lora(w):
            return w
        base = w.base.values * w.base.scale if is_int8(w.base) else w.base
        lead = w.a.ndim - 1 - w.n_in  # a stacked group's layers' axis, a MoE's experts'
        r = w.a.shape[-1]
        a = w.a.reshape(*w.a.shape[:lead], -1, r).astype(jnp.float32)
        b = w.b.reshape(*w.b.shape[:lead + 1], -1).astype(jnp.float32)
        ab = jnp.einsum("...kr,...rn->...kn", a, b, precision=jax.lax.Precision.HIGHEST)
        total = base.astype(jnp.float32) + w.scale * ab.reshape(base.shape)
        return total.astype(base.dtype)
    return jax.tree.map(fold, params, is_leaf=is_lora)


def _stacked(path: str) -> int:
    """1 for a scanned group's weight ("GROUP/BLOCK/../NAME": `[L, ..]`), 0 for a layer's own
    ("GROUP/LAYER/BLOCK/../NAME": its second part is the layer's index)."""
    return int(not path.split("/")[1].isdigit())


def _path(keys) -> str:
    """A tree path of `params["groups"]` as "GROUP[/LAYER]/BLOCK/NAME"."""
    return "/".join(str(k.idx if hasattr(k, "idx") else k.key) for k in keys)


def _lead(path: str) -> int:
    """How many leading axes of a weight have adapters of their own: a stacked group's layers,
    and a MoE block's experts."""
    return _stacked(path) + int("experts" in path.split("/"))


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
