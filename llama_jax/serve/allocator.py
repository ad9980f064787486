"""The pages of a server's KV cache: the pool and each holder's table (serve/pages.py), the
prefix cache's chunks (serve/prefix_index.py), the pages a prompt takes when it is admitted
and a row as it grows, and the cached prefixes let go of when the pool runs short.

A holder is a prompt being prefilled or a request's row. Demands are `(holder, positions)`
pairs: each holder is to hold its first `positions` positions.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from llama_jax.model.kv_cache import pages_for
from llama_jax.serve.pages import PagePool, RowTable
from llama_jax.serve.prefix_index import PrefixIndex
from llama_jax.plan.serving import ServerShape

Demands = Sequence[tuple[Hashable, int]]


class Allocator:
    """The pages of a server of `shape`, its prefix cache keyed for caches of
    `cache_dtype`."""

    def __init__(self, shape: ServerShape, cache_dtype: str):
        self.shape = shape
        self.pool = PagePool(shape.n_pages)
        self.tables = RowTable(self.pool, shape.page_size)
        self.index = None if not shape.prefix_blocks else PrefixIndex(
            shape.prefix_blocks, shape.prefill_chunk, cache_dtype, self.pool)

    def last_page_copies(self, n: int, choices: int) -> int:
        """The pages the further choices of a prompt of n tokens copy its last page into:
        none when that page is full (each choice then writes from a page of its own)."""
        return choices - 1 if n % self.shape.page_size else 0

    def prompt_pages(self, n: int, choices: int) -> int:
        """The most pages `choices` choices of a prompt of n tokens take on admission."""
        return pages_for(n, self.shape.page_size) + self.last_page_copies(n, choices)

    def short(self, demands: Demands, extra: int = 0) -> int:
        """The pages the pool lacks for `extra` pages and the `demands`."""
        need = extra + sum(self.tables.missing(h, positions) for h, positions in demands)
        return need - self.pool.free

    def make_room(self, demands: Demands, extra: int = 0) -> bool:
        """Lets go of cached prefixes, least recently used first, until the pool holds
        `extra` pages and those the `demands` lack; whether it does."""
        while self.short(demands, extra) > 0:
            if self.index is None or not self.index.free_some():
                return False
        return True

    def grow(self, demands: Demands) -> None:
        """Gives each holder the pages it lacks (`make_room` made room for them)."""
        for holder, positions in demands:
            self.tables.grow(holder, positions)

    def reserve_prompt(self, holder: Hashable, prompt: Sequence[int], choices: int,
                       cached: bool, demands: Demands
                       ) -> tuple[list[bytes], int, list[int]] | None:
        """The pages of a prompt for its `choices` choices, beside the `demands`: with
        `cached`, the longest run of its full chunks the prefix cache holds (all but the one
        holding the last token, whose logits must be computed), then new ones for the rest,
        and one for each further choice to copy the last page into. Returns the keys of its
        full chunks (with `cached`), the positions restored and the spare pages; None,
        taking nothing, when the pool lacks them after letting go of cached prefixes."""
        n, keys, hit = len(prompt), [], []
        if self.index is not None and cached:
            keys = self.index.keys(prompt)
            hit = self.index.lookup(keys[:(n - 1) // self.shape.prefill_chunk])
            self.tables.share(holder, hit)  # before letting go of cached prefixes
        copies = self.last_page_copies(n, choices)
        if not self.make_room(demands, self.tables.missing(holder, n) + copies):
            self.tables.drop(holder)
            return None
        self.tables.grow(holder, n)
        return keys, len(hit) * self.shape.page_size, self.pool.take(copies)

    def keep_chunk(self, holder: Hashable, key: bytes, chunk: int) -> None:
        """The holder's full chunk number `chunk` into the prefix cache, under `key`."""
        per_chunk = self.shape.chunk_pages
        self.index.add(key, self.tables.pages(holder)[chunk * per_chunk:(chunk + 1) * per_chunk])

    def give_choice(self, prompt_holder: Hashable, holder: Hashable, n: int,
                    spare: int | None) -> tuple[int, int] | None:
        """The pages of a prompt of n tokens (held by `prompt_holder`) to a choice's holder:
        all of them (`spare` None), or its full pages and `spare` for a copy of its last
        one; returns that copy's `(from, to)` pages."""
        pages, full = self.tables.pages(prompt_holder), n // self.shape.page_size
        if spare is None or full == len(pages):
            self.tables.share(holder, pages)
            return None
        self.tables.share(holder, pages[:full])
        self.tables.give(holder, [spare])
        return pages[full], spare

    def release(self, holder: Hashable, spares: Sequence[int] = ()) -> None:
        """Lets go of the holder's pages, and of `spares` taken for it."""
        self.tables.drop(holder)
        self.pool.release(spares)

    @property
    def cached_blocks(self) -> int:
        return 0 if self.index is None else len(self.index)
