"""Which prompt chunks a server's prefix cache holds, and in which block of the device pool
(`decode/prefix_pool.py`): a chain of hashes over full chunks, as vLLM's automatic prefix
caching keys its blocks.

A prompt's chunk i (its tokens `i·C .. (i+1)·C - 1`) is keyed by the hash of chunk i - 1's key
and its own token ids; chunk 0's parent is a root naming the cache dtype and C. A key so names
the whole prefix up to its chunk's end, which is what that block's KV depends on: equal keys,
equal KV. A lookup walks a prompt's keys from chunk 0 and stops at the first the pool lacks.

Every cached block sits in one least-recently-used order; a lookup's hits become the most
recent, and storing a new chunk takes a free block or evicts the least recent. A hit's blocks
are copied into the request's own cache when it is admitted (`prefix_pool.restore`), in the
same engine step, so a block is pinned only while that copy is queued on the device ahead of
any later store; evicting one of a chain's middle blocks leaves the blocks after it
unreachable, and they age out in turn.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np


class PrefixIndex:
    """The keys of the `blocks` blocks of `block_len` tokens a pool holds, for caches of
    `cache_dtype`."""

    def __init__(self, blocks: int, block_len: int, cache_dtype: str):
        self.block_len = block_len
        self._root = hashlib.blake2b(f"{cache_dtype}/{block_len}".encode(),
                                     digest_size=16).digest()
        self._free = list(range(blocks - 1, -1, -1))
        self._lru: collections.OrderedDict[bytes, int] = collections.OrderedDict()

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
        """The blocks of the longest run of `keys` from the first that the pool holds, now
        the most recently used."""
        blocks = []
        for key in keys:
            block = self._lru.get(key)
            if block is None:
                break
            self._lru.move_to_end(key)
            blocks.append(block)
        return blocks

    def allocate(self, key: bytes) -> int | None:
        """A block to store the chunk of `key` in (a free one, else the least recently used,
        forgotten), or None when the pool holds it already or has no blocks."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return None
        if self._free:
            block = self._free.pop()
        elif self._lru:
            block = self._lru.popitem(last=False)[1]
        else:
            return None
        self._lru[key] = block
        return block

    def __len__(self) -> int:
        return len(self._lru)
