"""The KV cache of a decoding batch: each layer group's attention cache, and the slots in use.

Each mixer owns its cache layouts (nn/attention/mixers.py): its `StackedCache` for a scanned
group, or a tuple of per-layer `LayerCache`s for the unrolled decoder (for GQA keys and values,
for MLA latents); this container holds one entry per layer group and the bookkeeping every
layer shares.

Every decoder's rows (decode/rows.py) hold their sequences from slot 0 and end where each
has got to: `end` is per row (`[B]`, `with_row_ends`), each row writes at its own slot and
advances by the tokens it kept. Slots a row wrote past its end (a prompt's padding, rejected
guesses) are unseen: a query sees only slots up to its own. A cache whose rows share one end
(`end` a scalar: a prompt's own cache as it is prefilled, a scoring pass) is written at that
slot for all. Slots before `start[b]` are masked out of attention (they form segment 0) and
positions are `slot - start[b]`, so a left-padded row computes what it would alone; the
decoders start every row at 0.

A paged cache (`init_paged_cache`) holds every layer's slots in a pool of pages (each mixer's
cache made for P rows of `page_size` slots: the rows' axis holds pages) and a table per row,
`pages [B, N]`: row b's slot s is slot s % page_size of page `pages[b, s // page_size]`. The
rows see S = N·page_size slots; a step writes through the tables and attends over each row's
pages gathered (`kv_storage.gather_pages`), so it computes what the dense cache of S slots
computes, bit for bit. Rows may share pages they only read (a prompt's prefix).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from llama_jax.config import ModelConfig, cache_dtype_name
from llama_jax.nn.attention.dot_product import Mask
from llama_jax.nn.attention.mixers import mixer_of
from llama_jax.model.params import layer_groups

LAYOUTS = ("stacked", "per_layer")
NO_PAGE = -1  # a table entry that is no page: nothing is written there, and it is unseen


@struct.dataclass
class KVCache:
    groups: tuple  # per layer group: a stacked cache, or a tuple of per-layer ones
    start: jax.Array  # [B] int32: first slot of each row (left padding before it)
    end: jax.Array  # [] int32: the next slot to write, shared by all rows; or [B], per row
    max_len: int = struct.field(pytree_node=False)  # S
    # A paged cache (`init_paged_cache`): each row's pages `[B, N]` in the layers' pools of
    # `page_size` slots, its S = N·page_size slots read through them
    pages: jax.Array | None = None
    page_size: int = struct.field(pytree_node=False, default=0)

    def positions_and_mask(self, T: int) -> tuple[jax.Array, Mask]:
        """Positions `[B, T]` of the next T tokens and the slots they may see."""
        B, S = self.start.shape[0], self.max_len
        q_index_BT = jnp.broadcast_to(
            self.end[..., None] + jnp.arange(T, dtype=jnp.int32), (B, T))
        kv_index_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        positions_BT = jnp.maximum(q_index_BT - self.start[:, None], 0)  # padding: unused
        mask = Mask(q_index_BT, kv_index_BS, jnp.ones((B, T), jnp.int32),
                    (kv_index_BS >= self.start[:, None]).astype(jnp.int32))
        return positions_BT, mask

    def advance(self, groups: tuple, T: int) -> "KVCache":
        """The cache after T tokens were written into `groups`."""
        return self.replace(groups=groups, end=self.end + T)

    def with_row_ends(self) -> "KVCache":
        """The cache with `end` per row (`[B]`), each row then advanced on its own."""
        return self.replace(end=jnp.broadcast_to(self.end, self.start.shape))


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None,
               start_B: jax.Array | None = None, layout: str = "stacked") -> KVCache:
    """A zeroed cache for `batch` rows of `max_len` slots in `dtype` (default: the model's
    compute dtype; "int8": int8 values with a scale per cached vector): stacked per layer
    group, or (`layout="per_layer"`, for unstacked weights) one array per layer."""
    start = jnp.zeros((batch,), jnp.int32) if start_B is None else start_B.astype(jnp.int32)
    return KVCache(groups=_zeros(config, batch, max_len, dtype, layout), start=start,
                   end=jnp.zeros((), jnp.int32), max_len=max_len)


def init_paged_cache(config: ModelConfig, n_pages: int, page_size: int, pages_BN: jax.Array,
                     dtype=None, layout: str = "stacked") -> KVCache:
    """A zeroed pool of `n_pages` pages of `page_size` slots per layer, read and written by
    the rows whose pages `pages_BN` lists (`[B, N]`; an entry < 0 is no page: nothing is
    written there), each from slot 0 with an end of its own (at 0)."""
    B, N = pages_BN.shape
    return KVCache(groups=_zeros(config, n_pages, page_size, dtype, layout),
                   start=jnp.zeros((B,), jnp.int32), end=jnp.zeros((B,), jnp.int32),
                   max_len=N * page_size, pages=pages_BN.astype(jnp.int32),
                   page_size=page_size)


def pages_for(slots: int, page_size: int) -> int:
    """The pages that hold `slots` slots."""
    return -(-slots // page_size)


def with_pages(cache: KVCache, pages_BN: jax.Array) -> KVCache:
    """A paged cache read and written through the tables `pages_BN` instead (as many rows;
    N·page_size slots)."""
    return cache.replace(pages=pages_BN.astype(jnp.int32),
                         max_len=pages_BN.shape[1] * cache.page_size)


def paged_rows(cache: KVCache, pages_BN: jax.Array, end_B: jax.Array) -> KVCache:
    """Other rows of a paged cache's pool: those of the tables `pages_BN`, ending at
    `end_B` (a prompt's, as it is prefilled)."""
    return with_pages(cache, pages_BN).replace(start=jnp.zeros_like(end_B), end=end_B)


def copied_pages(cache: KVCache, from_N: jax.Array, to_N: jax.Array) -> KVCache:
    """A paged cache with pages `to_N` of every layer's pool holding what pages `from_N`
    hold. Every mixer's pool has its pages first: after the layers of a stacked group."""
    def copy(group):
        axis = 0 if isinstance(group, tuple) else 1  # per-layer pools, or a stacked group's
        def put(x):
            index = (slice(None),) * axis + (to_N,)
            return x.at[index].set(jnp.take(x, from_N, axis=axis), unique_indices=True)
        return jax.tree.map(put, group)
    return cache.replace(groups=tuple(copy(g) for g in cache.groups))


def _zeros(config: ModelConfig, batch: int, max_len: int, dtype, layout: str) -> tuple:
    """Every layer group's zeroed cache (see `init_cache`)."""
    dtype = cache_dtype_name(dtype, config.compute_dtype)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    mixer = mixer_of(config)
    return tuple(
        mixer.stacked_cache(config, group.n_layers, batch, max_len, dtype) if layout == "stacked"
        else tuple(mixer.layer_cache(config, batch, max_len, dtype)
                   for _ in range(group.n_layers))
        for group in layer_groups(config))
