"""How attention caches store their values, for every mixer's cache (gqa.py, mla.py): in a
float dtype, or in int8 with one float32 scale per cached vector (`cache_dtype: int8`).

A cache is an array whose last axis holds one cached vector (a key or value of one token and
head, an MLA latent of one token), or a `quant.Int8` of such values and scales
`[..., 1]`, quantized as each token is written (`quant.to_int8_vectors`). Attention reads the
int8 values as they are and applies the scales to its scores (keys) and probabilities (values)
(`ops.einsum_f32`), so a decode step reads one byte per cached value plus 4 per vector.

Per-layer caches (the unrolled decoder's) compiled for a CPU keep 16-bit floats as their uint16
bits (`bits=True`): XLA:CPU upcasts a bf16 `dynamic_update_slice` to fp32 (rewriting the whole
cache at every write), and even a bitcast view of a bf16 buffer made it copy the cache before
each in-place update. Elsewhere they hold the floats: read as bits, an accelerator's step
widened a copy of each layer's whole cache (one more kernel and twice the cache's bytes).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from llama_jax.parallel import target
from llama_jax.parallel.sharding import constrain
from llama_jax.quant import SCALE_BYTES, Int8, is_int8, to_int8_vectors

INT8 = "int8"


def zeros(shape: Sequence[int], dtype: str, bits: bool = False) -> jax.Array | Int8:
    """An empty cache of `shape` (last axis: the cached vectors) holding `dtype` values (as
    their uint16 bits for `bits` in a program compiled for a CPU)."""
    if dtype == INT8:
        return Int8(jnp.zeros(shape, jnp.int8), jnp.zeros((*shape[:-1], 1), jnp.float32))
    as_bits = bits and target.platform() == "cpu" and jnp.dtype(dtype).itemsize == 2
    stored = jnp.uint16 if as_bits else dtype
    return jnp.zeros(shape, stored)


def write(cache: jax.Array | Int8, x: jax.Array, start: Sequence, dtype: str,
          row_axis: int = 0, pages_BN: jax.Array | None = None) -> jax.Array | Int8:
    """`cache` with the vectors `x` (of the cache's rank) written at `start`, stored as the
    cache stores `dtype`. An entry of `start` may be a `[B]` array, one position per row
    (rows at lengths of their own): then each row, along `row_axis` of both, is written from
    its own position, and `start` holds 0 at `row_axis`. With `pages_BN` the cache is a pool
    of pages (pages along `row_axis`, a page's positions along the axis of the `[B]` start)
    and row b's position p lives at offset p % page of page `pages_BN[b, p // page]`; without,
    each row is one page of the whole cache."""
    if all(jnp.ndim(s) == 0 for s in start):
        return _write(cache, x, start, dtype)
    seq_axis = next(axis for axis, s in enumerate(start) if jnp.ndim(s) == 1)
    shape = stored_shape(cache)
    if pages_BN is None:
        pages_BN = jnp.arange(x.shape[row_axis])[:, None]
    pages_BT, positions_BT = page_index(start[seq_axis], x.shape[seq_axis], pages_BN,
                                        shape[seq_axis], shape[row_axis])
    return write_rows(cache, x, pages_BT, positions_BT, start, dtype, row_axis, seq_axis)


def stored_shape(cache: jax.Array | Int8) -> tuple[int, ...]:
    """The shape of a cache's values (an int8 cache's, not its scales')."""
    return (cache.values if is_int8(cache) else cache).shape


def page_index(end_B: jax.Array, T: int, pages_BN: jax.Array, page: int, n_pages: int
               ) -> tuple[jax.Array, jax.Array]:
    """Where row b's positions `end_B[b] + t` (t < T) live in a pool of `n_pages` pages of
    `page` positions: the page `[B, T]` and the offset in it `[B, T]`. A position past the
    row's table, or on an entry that is not a page (< 0), gets a page past the pool, a
    different one for each (b, t): the write is dropped and the indices stay unique."""
    B, N = pages_BN.shape
    positions_BT = end_B[:, None] + jnp.arange(T)
    entry_BT = positions_BT // page
    pages_BT = jnp.take_along_axis(pages_BN, jnp.minimum(entry_BT, N - 1), axis=1)
    dropped_BT = n_pages + jnp.arange(B)[:, None] * T + jnp.arange(T)
    pages_BT = jnp.where((entry_BT < N) & (pages_BT >= 0), pages_BT, dropped_BT)
    return pages_BT.astype(jnp.int32), (positions_BT % page).astype(jnp.int32)


def write_rows(cache: jax.Array | Int8, x: jax.Array, rows_BT: jax.Array,
               positions_BT: jax.Array, start: Sequence, dtype: str, row_axis: int,
               seq_axis: int) -> jax.Array | Int8:
    """`cache` with row b's T vectors of `x` (rows along `row_axis`, the T along `seq_axis`)
    written at `rows_BT[b]` of the cache's `row_axis` and `positions_BT[b]` of its
    `seq_axis`, in one scatter; an axis `x` holds one of sits at its `start`, the others
    are whole. Rows past the cache are dropped (`page_index` sends there what a row may not
    write). The indices are unique, which lets XLA:TPU update the cache in place: a vmapped
    `dynamic_update_slice` became a select over the whole cache per row."""
    if is_int8(cache):
        x = to_int8_vectors(x)
        return Int8(_scatter(cache.values, x.values, rows_BT, positions_BT, start, row_axis,
                             seq_axis),
                    _scatter(cache.scale, x.scale, rows_BT, positions_BT, start, row_axis,
                             seq_axis))
    return _scatter(cache, _stored(cache, x, dtype), rows_BT, positions_BT, start, row_axis,
                    seq_axis)


def _scatter(cache, x, rows_BT, positions_BT, start, row_axis: int, seq_axis: int
             ) -> jax.Array:
    # One index per vector written (every axis but the last indexed): XLA:TPU prices the
    # stacked cache's scatter so at the layer scan's cost of a dynamic_update_slice; with
    # the heads' axis a window of it, its step copied the layer's cache.
    grid = jnp.meshgrid(*(jnp.arange(n) for n in x.shape[:-1]), indexing="ij")
    per_vector = {row_axis: rows_BT, seq_axis: positions_BT}
    index = [per_vector[axis][grid[row_axis], grid[seq_axis]] if axis in per_vector
             else grid[axis] + start[axis] for axis in range(x.ndim - 1)]
    points = tuple(range(x.ndim - 1))
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(x.ndim - 1,), inserted_window_dims=points,
        scatter_dims_to_operand_dims=points)
    return jax.lax.scatter(cache, jnp.stack(index, axis=-1).astype(jnp.int32), x, numbers,
                           unique_indices=True, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def gather_pages(cache: jax.Array | Int8, pages_BN: jax.Array, row_axis: int, seq_axis: int
                 ) -> jax.Array | Int8:
    """The rows' caches read from a pool of pages (pages along `row_axis`, a page's
    positions along `seq_axis`, after it): `[.., B, .., N·page, ..]`, row b's position p from
    offset p % page of page `pages_BN[b, p // page]`. An entry that is not a page (< 0)
    reads page 0: its positions lie past the row's end, where attention does not look (the
    pool holds finite values, so the masked products are exact zeros)."""
    def gather(x):
        taken = jnp.take(x, jnp.maximum(pages_BN, 0), axis=row_axis)  # [.., B, N, .., page, ..]
        taken = jnp.moveaxis(taken, row_axis + 1, seq_axis)  # N just before the page's axis
        shape = taken.shape
        return taken.reshape(*shape[:seq_axis], shape[seq_axis] * shape[seq_axis + 1],
                             *shape[seq_axis + 2:])
    return map_stored(cache, gather)


def _stored(cache: jax.Array, x: jax.Array, dtype: str) -> jax.Array:
    """`x` as a float cache stores it: in `dtype`, or its bits (a uint16 cache)."""
    x = x.astype(dtype)
    if cache.dtype == jnp.uint16:
        x = jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def _write(cache: jax.Array | Int8, x: jax.Array, start: Sequence, dtype: str
           ) -> jax.Array | Int8:
    if is_int8(cache):
        x = to_int8_vectors(x)
        return Int8(jax.lax.dynamic_update_slice(cache.values, x.values, start),
                    jax.lax.dynamic_update_slice(cache.scale, x.scale, start))
    return jax.lax.dynamic_update_slice(cache, _stored(cache, x, dtype), start)


def read(cache: jax.Array | Int8, dtype: str, compute_dtype) -> jax.Array | Int8:
    """A cache's values for attention: float ones in `compute_dtype`; int8 ones as they are
    (attention applies their scales). bf16 bits widen to fp32 exactly by a shift."""
    if is_int8(cache):
        return cache
    if cache.dtype != jnp.uint16:
        return cache.astype(compute_dtype)
    if dtype == "bfloat16":
        widened = jax.lax.bitcast_convert_type(cache.astype(jnp.uint32) << 16, jnp.float32)
        return widened.astype(compute_dtype)
    return jax.lax.bitcast_convert_type(cache, dtype).astype(compute_dtype)


def map_stored(cache: jax.Array | Int8, fn: Callable[[jax.Array], jax.Array]
               ) -> jax.Array | Int8:
    """`fn` applied to what a cache stores: its array, or an int8 cache's values and scales
    (laid out alike, so an `fn` that moves or resizes slots keeps them paired)."""
    if is_int8(cache):
        return Int8(fn(cache.values), fn(cache.scale))
    return fn(cache)


def constrained(cache: jax.Array | Int8, axes: Sequence[str | None]) -> jax.Array | Int8:
    """`sharding.constrain` under the cache rules; an int8 cache's scales are laid out like its
    values, with their size-1 last axis whole."""
    if is_int8(cache):
        return Int8(constrained(cache.values, axes), constrained(cache.scale, (*axes[:-1], None)))
    return constrain(cache, axes, "cache_rules")


def bytes_per_vector(width: int, dtype: str) -> int:
    """What a cache stores per vector of `width` values: an int8 cache adds the scale."""
    if dtype == INT8:
        return width + SCALE_BYTES
    return width * jnp.dtype(dtype).itemsize
