"""int8 storage: `Int8`, a tensor kept as int8 values and float32 scales, and the two
quantizers — per output channel for matmul weights, per vector for KV-cache entries.

Symmetric and absmax: over the axes a scale is shared by, scale = max|w| / 127 and
values = round(w / scale), in [-127, 127] (so -w quantizes to -values); w ≈ values · scale,
off by at most scale / 2 per element.

- A matmul weight has one scale per output channel: shared by the axes the matmul contracts
  (its input features, `TensorSpec.contract`), so the scale is constant along the sum and
  x·w ≈ (x·values)·scale. The int8 values feed the matmul and the scale multiplies its output
  (nn/ops.py): no dequantized copy of the weight is ever made.
- A KV-cache entry (a key or value vector of one token and head, an MLA latent of one token)
  has one scale per vector, written with it (`to_int8_vectors`).

The same code quantizes numpy arrays (checkpoints, on the host) and jax arrays (in jit).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

QUANTIZATIONS = ("int8",)  # what a model's weights may be stored as (`quantize:`)
INT8_MAX = 127
SCALE_BYTES = 4  # each scale is a float32
# The smallest scale: an all-zero channel gets values 0 (and not 0/0).
MIN_SCALE = float(np.finfo(np.float32).tiny)


@struct.dataclass
class Int8:
    """A tensor stored as int8 `values` (its shape) times float32 `scale` (broadcastable to it:
    size 1 along the axes a scale is shared by)."""

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.values.astype(jnp.float32) * self.scale).astype(dtype)

    def __getitem__(self, index) -> "Int8":
        """The same index into values and scales: whole axes, single entries, new axes, and
        slices along the axes the scale varies along — or slices starting at 0 along those it
        is shared by (its size 1 stays 1)."""
        return Int8(self.values[index], self.scale[index])


def scale_shape(shape: Sequence[int], shared_axes: Sequence[int]) -> tuple[int, ...]:
    """The shape of the scales of a tensor of `shape` whose scale is shared by `shared_axes`."""
    return tuple(1 if axis in shared_axes else n for axis, n in enumerate(shape))


def to_int8(w, shared_axes: Sequence[int]) -> Int8:
    """`w` (numpy or jax, any float dtype) as int8 values with one scale per slice along
    `shared_axes` (a matmul weight: the axes it contracts)."""
    w32 = w.astype(np.float32)
    amax = abs(w32).max(axis=tuple(shared_axes), keepdims=True)
    # Times reciprocals, never divided: XLA rewrites a division by a constant or a broadcast
    # into that, and the host (numpy) and jit must agree to the bit.
    scale = (amax * np.float32(1 / INT8_MAX)).clip(MIN_SCALE, None)
    values = (w32 * (1 / scale)).round().clip(-INT8_MAX, INT8_MAX).astype(np.int8)
    return Int8(values=values, scale=scale.astype(np.float32))


def to_int8_vectors(x: jax.Array) -> Int8:
    """`x` `[..., W]` as int8 values with one float32 scale `[..., 1]` per vector along its last
    axis: KV-cache entries."""
    return to_int8(x, (x.ndim - 1,))


def is_int8(x) -> bool:
    return isinstance(x, Int8)


def as_float(x: jax.Array | Int8, dtype) -> jax.Array:
    """An int8 tensor dequantized to `dtype`; a float one as it is."""
    return x.dequantize(dtype) if is_int8(x) else x
