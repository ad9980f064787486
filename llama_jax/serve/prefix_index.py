"""Which prompt chunks a server's prefix cache holds, and in which pages of the KV cache's
pool (serve/pages.py): a chain of hashes over full chunks, as vLLM's automatic prefix
caching keys its blocks.

A prompt's chunk i (its tokens `i·C .. (i+1)·C - 1`) is keyed by the hash of chunk i - 1's key
and its own token ids; chunk 0's parent is a root naming the cache dtype and C. A key so names
the whole prefix up to its chunk's end, which is what that chunk's KV depends on: equal keys,
equal KV. A lookup walks a prompt's keys from chunk 0 and stops at the first the cache lacks.

The cache holds at most `blocks` chunks, each as the pages a prompt wrote it into: it is one
more holder of those pages (`PagePool.hold`), so they outlive the prompt's row, and a new
prompt that hits them lists them in its own table (no copy). Every chunk sits in one
least-recently-used order; a lookup's hits become the most recent, and adding a chunk to a
full cache lets go of the least recent (its pages are free once no row lists them); a pool
short of pages, of the least recent whose pages no row lists. Evicting one of a chain's
middle chunks leaves the chunks after it unreachable, and they age out in turn.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np

from llama_jax.serve.pages import PagePool


class PrefixIndex:
    """The keys of at most `blocks` chunks of `block_len` tokens and their pages in `pool`,
    for caches of `cache_dtype`."""

    def __init__(self, blocks: int, block_len: int, cache_dtype: str, pool: PagePool):
        self.blocks = blocks
        self.block_len = block_len
        self.pool = pool
        self._root = hashlib.blake2b(f"{cache_dtype}/{block_len}".encode(),
                                     digest_size=16).digest()
        self._lru: collections.OrderedDict[bytes, tuple[int, ...]] = collections.OrderedDict()

    def keys(self, prompt: Sequence[int]) -> list[bytes]:
        """The keys of the prompt's full chunks, in order."""
        C, keys, parent = self.block_len, [], self._root
        tokens = np.asarray(prompt, np.int32)
        for i in range(len(tokens) // C):
            parent = hashlib.blake2b(parent + tokens[i * C:(i + 1) * C].tobytes(),
                                     digest_size=16).digest()
            keys.append(parent)
        return keys

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of `keys` from the first that the cache holds (its
        chunks now the most recently used), in order."""
        pages: list[int] = []
        for key in keys:
            chunk = self._lru.get(key)
            if chunk is None:
                break
            self._lru.move_to_end(key)
            pages.extend(chunk)
        return pages

    def add(self, key: bytes, pages: Sequence[int]) -> None:
        """Keeps the chunk of `key` in `pages` (held by a row now), letting go of the least
        recently used chunk if the cache is full; a chunk held already is touched."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        if len(self._lru) >= self.blocks and not self.evict():
            return
        self.pool.hold(pages)
        self._lru[key] = tuple(pages)

    def evict(self) -> bool:
        """Lets go of the least recently used chunk's pages; False when none is held."""
        if not self._lru:
            return False
        self.pool.release(self._lru.popitem(last=False)[1])
        return True

    def free_some(self) -> bool:
        """Lets go of the least recently used chunk that holds a page no row lists (so the
        pool gains a page); False when every chunk's pages are rows' too, and letting go of
        them would free nothing."""
        for key, pages in self._lru.items():
            if any(self.pool.holders(page) == 1 for page in pages):
                del self._lru[key]
                self.pool.release(pages)
                return True
        return False

    def __len__(self) -> int:
        return len(self._lru)
