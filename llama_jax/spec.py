"""`TensorSpec`: one parameter described once — shape (with its dimension letters), logical axes,
initialiser and whether weight decay applies. Everything about parameters is derived from trees
of these: initialisation, abstract shapes, shardings, the weight-decay mask, parameter counts,
memory plans and checkpoint layouts.

Dimension letters: V vocab, D model width, F MLP width, N query heads, K KV heads, H head dim, P
position-table rows (max_seq_len), L layers of a group; with MoE, E experts, M an expert's MLP
width, U the shared experts' width; with MLA, Z the KV latent, Q the query latent, J and I a
head's position-free and rotary query/key features, Y its value width; with a task head, O its
outputs (classes or regression targets). Logical axis names are what the sharding rules map to
mesh axes.

A matmul weight names the axes its matmul contracts (`contract`, its input features): those are
the axes an int8 copy shares its scales along (llama_jax/quant.py). `dtype` is the dtype the
tensor is stored in when it differs from the model's `param_dtype`: "int8" for a quantized
weight, which is then an `Int8` of int8 values and float32 scales of `scale_shape`.
"""

from __future__ import annotations

import dataclasses
import math

import jax

INITS = ("normal", "ones", "zeros")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One parameter tensor."""

    letters: str  # dimension letters, one per axis ("DNH")
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, one per axis
    init: str = "normal"  # normal: N(0, (init_std * scale)^2); ones; zeros
    scale: float = 1.0
    decay: bool = True  # AdamW weight decay applies (not to norm gains and biases)
    used: float = 1.0  # the fraction of it one token's forward pass uses (MoE experts: top_k/E)
    contract: str = ""  # a matmul weight: the letters its matmul contracts (else "")
    dtype: str | None = None  # stored dtype when not the model's param_dtype ("int8")

    def __post_init__(self):
        assert len(self.letters) == len(self.shape) == len(self.axes), self
        assert self.init in INITS, self.init
        assert set(self.contract) <= set(self.letters), self

    @property
    def contract_axes(self) -> tuple[int, ...]:
        return tuple(self.letters.index(c) for c in self.contract)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """The shape of an int8 copy's scales: one per output channel."""
        return tuple(1 if c in self.contract else n for c, n in zip(self.letters, self.shape))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def stacked(self, n_layers: int) -> "TensorSpec":
        """The same tensor for `n_layers` layers, stacked along a leading L axis."""
        return dataclasses.replace(self, letters="L" + self.letters, shape=(n_layers, *self.shape),
                                   axes=("layers", *self.axes))


def weight(dims: dict[str, int], letters: str, axes: tuple[str, ...], scale: float = 1.0,
           contract: str = "") -> TensorSpec:
    """A matrix (or table) initialised N(0, (init_std * scale)^2), decayed; a matmul weight
    names the letters its matmul contracts."""
    return TensorSpec(letters, tuple(dims[c] for c in letters), axes, "normal", scale,
                      contract=contract)


def gain(dims: dict[str, int], letters: str, axes: tuple[str, ...]) -> TensorSpec:
    """A multiplicative gain, initialised to one, not decayed."""
    return TensorSpec(letters, tuple(dims[c] for c in letters), axes, "ones", decay=False)


def bias(dims: dict[str, int], letters: str, axes: tuple[str, ...]) -> TensorSpec:
    """An additive bias, initialised to zero, not decayed."""
    return TensorSpec(letters, tuple(dims[c] for c in letters), axes, "zeros", decay=False)


def is_spec(x) -> bool:
    return isinstance(x, TensorSpec)


def spec_leaves(specs) -> list[TensorSpec]:
    return jax.tree.leaves(specs, is_leaf=is_spec)


def map_specs(fn, specs):
    """`jax.tree.map` over a tree of TensorSpecs (empty subtrees stay empty)."""
    return jax.tree.map(fn, specs, is_leaf=is_spec)


def count(specs) -> int:
    """Total number of parameters described by a tree of TensorSpecs."""
    return sum(s.size for s in spec_leaves(specs))
