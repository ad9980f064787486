"""The device side of a server's prefix cache: a pool of blocks of prompt KV, each one
prefill chunk of C slots, and the programs that copy chunks between it and a request's
one-row prefill cache (`slots.prefill_chunk`'s). The host side, which prompt chunk lives in
which block, is `serve/prefix_index.py`.

The pool is itself a one-row KV cache of `blocks · C` slots (model/kv_cache.py): block j is
its slots `j·C .. (j+1)·C - 1`, so every cache kind (GQA float or int8, MLA latents, stacked
or per-layer) is pooled by the same slot copies. A copy moves the stored bits unchanged: a
prompt restored from the pool continues from exactly the cache its first chunks computed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from llama_jax.config import MeshConfig, ModelConfig
from llama_jax.decode.decoder import cache_bytes_per_device
from llama_jax.parallel.sharding import placed
from llama_jax.model.kv_cache import KVCache, init_cache, slots_of, with_slots
from llama_jax.model.params import Params


def prefix_block_bytes(config: ModelConfig, params: Params, block_len: int, cache_dtype: str,
                       mesh_config: MeshConfig | None = None) -> int:
    """The bytes one device holds of one block (`params` tell the placement)."""
    return cache_bytes_per_device(config, params, 1, block_len, cache_dtype, mesh_config)


@functools.partial(jax.jit, static_argnames=("config", "blocks", "block_len", "cache_dtype",
                                             "layout", "placement"))
def empty_pool(*, config: ModelConfig, blocks: int, block_len: int, cache_dtype: str,
               layout: str, placement: tuple | None) -> KVCache:
    """A pool of `blocks` empty blocks of `block_len` slots."""
    with placed(placement):
        return init_cache(config, 1, blocks * block_len, cache_dtype, layout=layout)


@functools.partial(jax.jit, static_argnames=("block_len", "max_len"))
def restore(pool: KVCache, blocks_N: jax.Array, k: jax.Array, *, block_len: int,
            max_len: int) -> KVCache:
    """The one-row prefill cache of a prompt whose first k chunks are the pool's blocks
    `blocks_N[:k]`, in `max_len` slots (as `slots.prefill_chunk` leaves it after chunk k - 1),
    ending after them. k is an input: a program per `max_len`."""
    C = block_len
    one = pool.map_seq(lambda x, axis: jnp.zeros(
        (*x.shape[:axis], max_len, *x.shape[axis + 1:]), x.dtype), max_len)

    def copy(i, one):
        return with_slots(one, i * C, slots_of(pool, blocks_N[i] * C, C))
    one = jax.lax.fori_loop(0, k, copy, one)
    return one.replace(start=jnp.zeros((1,), jnp.int32), end=k * C)


@functools.partial(jax.jit, static_argnames=("block_len",), donate_argnames=("pool",))
def store(pool: KVCache, one: KVCache, chunk: jax.Array, block: jax.Array, *,
          block_len: int) -> KVCache:
    """The pool with block `block` holding chunk `chunk` of the prefill cache `one`."""
    C = block_len
    return with_slots(pool, block * C, slots_of(one, chunk * C, C))
