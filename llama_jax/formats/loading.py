"""How any format's tensors become our parameters: what a load is asked for (`Loading`: a
dtype, a quantization), where the leaves go (`Placement`: a sharding per leaf, or None), and
building the leaves — in a dtype or quantized as they are read, onto their shardings — so that
host memory holds one leaf at a time. Formats only say how their tensors are read: as pieces in
our layout (HF and Meta through torch_layout.py), or whole leaves (native orbax checkpoints).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable

import jax
import numpy as np

from llama_jax.config import ModelConfig
from llama_jax.errors import CheckpointError, ConfigError
from llama_jax.model.params import Params, abstract_params, flat_paths, param_specs
from llama_jax.quant import Int8, is_int8, to_int8
from llama_jax.spec import TensorSpec, is_spec

Placement = Callable[[ModelConfig], "Params | None"]  # config -> a sharding per leaf, or None
# A leaf's pieces — its slices along leading axes (layers, experts) in row-major order, or the
# whole leaf — each of the shape given, read when the iterator is advanced.
Pieces = tuple[tuple[int, ...], Iterable[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Loading:
    """What `load_checkpoint` is asked for: float parameters in `dtype` (None: as stored), and
    the weights `quantize` / `quantize_head` store as int8 (None: as stored)."""

    dtype: str | None = None
    quantize: str | None = None
    quantize_head: bool = False

    def in_dtype(self, config: ModelConfig, stored_dtype: str) -> ModelConfig:
        """`config` with its float parameters stored and computed in `dtype` (else
        `stored_dtype`), its quantization as it was."""
        dtype = self.dtype or stored_dtype
        return config.with_execution(param_dtype=dtype, compute_dtype=dtype)

    def config(self, config: ModelConfig, stored_dtype: str, where: object) -> ModelConfig:
        """The loaded model's config: float parameters stored and computed in `dtype` (else
        `stored_dtype`), quantized as asked. A quantized checkpoint loads as it was stored: a
        different quantization is refused (`where` names the checkpoint)."""
        config = self.in_dtype(config, stored_dtype)
        if self.quantize is None:
            return config
        stored = (config.quantize, config.quantize_head)
        if config.quantize is not None and stored != (self.quantize, self.quantize_head):
            raise CheckpointError(
                f"{where}: stored with quantize={config.quantize}, quantize_head="
                f"{config.quantize_head}; it cannot load with quantize={self.quantize}, "
                f"quantize_head={self.quantize_head} (leave them out to load it as stored)")
        try:
            return config.with_execution(quantize=self.quantize, quantize_head=self.quantize_head)
        except ConfigError as e:
            raise CheckpointError(f"{where}: {e}") from None


def placed_target(config: ModelConfig, placement: Placement | None) -> Params:
    """Abstract parameters for an orbax restore: on `placement`'s shardings, or on this
    process's first device (so a checkpoint saved on any mesh restores)."""
    shardings = placement(config) if placement else None
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract_params(config))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_params(config), shardings)


def assemble(config: ModelConfig, pieces: dict[str, Pieces], dtype: np.dtype,
             placement: Placement | None = None) -> Params:
    """Builds the parameter tree leaf by leaf from `pieces` (by path). Each leaf is filled
    piece by piece in `dtype` — or, a weight the config quantizes, as int8 values and scales,
    each piece quantized as it is read — and moved to the devices — straight into its target
    sharding when `placement` gives one, each device receiving only its shard — before the
    next is read, so host memory holds one leaf at a time. The largest leaves go first: while
    a leaf is read it exists two or three times over (file pages, the array read, the device
    copy), and that transient should not sit on top of everything else."""
    specs = flat_paths(param_specs(config))
    shardings = _leaf_shardings(config, placement)
    leaves = {}
    for path in sorted(specs, key=lambda path: -specs[path].size):
        piece_shape, read = pieces[path]
        leaves[path] = put(build_leaf(specs[path], piece_shape, read, dtype),
                           shardings.get(path))
    return unflatten(config, leaves)


def _leaf_shardings(config: ModelConfig, placement: Placement | None) -> dict:
    """`placement`'s sharding of each leaf by path — an `Int8` of two for a quantized weight —
    or none without one."""
    shardings = placement(config) if placement else None
    if shardings is None:
        return {}
    return dict(zip(flat_paths(param_specs(config)), jax.tree.leaves(shardings, is_leaf=is_int8)))


def build_leaf(spec: TensorSpec, piece_shape: tuple[int, ...], pieces: Iterable[np.ndarray],
               dtype: np.dtype) -> np.ndarray | Int8:
    """The leaf of `spec` on the host from its pieces (`Pieces`), in `dtype` or quantized."""
    if spec.dtype == "int8":
        return _quantized_leaf(spec, piece_shape, pieces, dtype)
    return _float_leaf(spec, piece_shape, pieces, dtype)


def put(leaf: np.ndarray | Int8, sharding) -> jax.Array | Int8:
    """`leaf` on the devices of `sharding` (None: the default device)."""
    # Wait for the copy: an asynchronous transfer would keep the host array alive while the
    # next leaves are read, and the peak would depend on timing.
    return jax.block_until_ready(jax.device_put(leaf, sharding))


def _float_leaf(spec: TensorSpec, piece_shape: tuple[int, ...], pieces: Iterable[np.ndarray],
                dtype: np.dtype) -> np.ndarray:
    out = np.empty((_n_pieces(spec, piece_shape), *piece_shape), dtype)
    for j, piece in enumerate(pieces):
        out[j] = piece
    return out.reshape(spec.shape)


def _quantized_leaf(spec: TensorSpec, piece_shape: tuple[int, ...],
                    pieces: Iterable[np.ndarray], dtype: np.dtype) -> Int8:
    """int8 values and scales, quantized piece by piece: a piece (a layer's, an expert's
    matrix) holds whole output channels, so each piece's scales are the leaf's. Pieces are
    rounded to `dtype` first, so the result equals quantizing the model loaded in `dtype`."""
    n, lead = _n_pieces(spec, piece_shape), len(spec.shape) - len(piece_shape)
    axes = tuple(a - lead for a in spec.contract_axes)
    values = np.empty((n, *piece_shape), np.int8)
    scale = np.empty((n, *spec.scale_shape[lead:]), np.float32)
    for j, piece in enumerate(pieces):
        quantize_into(piece.astype(dtype, copy=False), axes, values[j], scale[j])
    return Int8(values.reshape(spec.shape), scale.reshape(spec.scale_shape))


def _n_pieces(spec: TensorSpec, piece_shape: tuple[int, ...]) -> int:
    return math.prod(spec.shape[:len(spec.shape) - len(piece_shape)])


QUANTIZE_CHUNK_BYTES = 1 << 22


def quantize_into(w: np.ndarray, axes: tuple[int, ...], values: np.ndarray,
                  scale: np.ndarray) -> None:
    """Quantizes `w` into `values` and `scale` in slices of whole output channels of about
    QUANTIZE_CHUNK_BYTES: the quantizer's float temporaries stay small next to a large piece
    (an embedding table or LM head is one piece)."""
    split = next(a for a in range(w.ndim) if a not in axes)  # a weight has output channels
    step = max(1, QUANTIZE_CHUNK_BYTES * w.shape[split] // (4 * w.size))
    for start in range(0, w.shape[split], step):
        where = tuple(slice(start, start + step) if a == split else slice(None)
                      for a in range(w.ndim))
        q = to_int8(w[where], axes)
        values[where], scale[where] = q.values, q.scale


def unflatten(config: ModelConfig, leaves: dict[str, jax.Array]) -> Params:
    """The parameter tree of `config` from its leaves by path."""
    specs = param_specs(config)
    treedef = jax.tree.structure(specs, is_leaf=is_spec)
    return jax.tree.unflatten(treedef, [leaves[path] for path in flat_paths(specs)])
