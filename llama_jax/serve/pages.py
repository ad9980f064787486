"""The host's account of a paged KV cache's pool (model/kv_cache.py's `init_paged_cache`):
which pages are free, how many holders each page has, and each row's table.

A page is held by every row whose table lists it and by the prefix cache while it keeps it
(serve/prefix_index.py); it returns to the free list when its last holder lets go. Rows
share only pages they read and never write: a prompt's full pages, cached or shared by a
prompt's `n` choices (each choice writes its first tokens into a page of its own).

    pool = PagePool(total=1024)
    table = RowTable(pool, page_size=16)
    table.grow(request, positions=300)      # its pages to hold its first 300 positions
    pages_BN = table.array(owners, width=32)  # each row's owner's pages (None: none)
    table.drop(request)                     # its pages back (those no one else holds)
"""

from __future__ import annotations

import collections
from typing import Hashable, Iterable, Sequence

import numpy as np

from llama_jax.model.kv_cache import NO_PAGE, pages_for


class OutOfPages(Exception):
    """The pool has fewer free pages than were asked for (nothing was taken)."""


class PagePool:
    """`total` pages, each free or held (counted per holder)."""

    def __init__(self, total: int):
        if total < 1:
            raise ValueError(f"a pool of {total} pages holds nothing")
        self.total = total
        self._holders = np.zeros(total, np.int32)
        self._free: collections.deque[int] = collections.deque(range(total))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.total - len(self._free)

    def take(self, n: int) -> list[int]:
        """`n` free pages, now held once each; raises OutOfPages (taking none) if fewer are
        free."""
        if n > len(self._free):
            raise OutOfPages(f"{n} pages asked for, {len(self._free)} of {self.total} free")
        pages = [self._free.popleft() for _ in range(n)]
        self._holders[pages] = 1
        return pages

    def hold(self, pages: Iterable[int]) -> None:
        """One more holder for each of `pages` (held already)."""
        for page in pages:
            if self._holders[page] < 1:
                raise ValueError(f"page {page} is free: only a held page can be shared")
            self._holders[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """One holder fewer for each of `pages`; those left with none are free again."""
        for page in pages:
            if self._holders[page] < 1:
                raise ValueError(f"page {page} is released more often than it was held")
            self._holders[page] -= 1
            if self._holders[page] == 0:
                self._free.append(page)

    def holders(self, page: int) -> int:
        return int(self._holders[page])


class RowTable:
    """The pages of each holder (a request's row, a prompt being prefilled), in the order of
    its positions, taken from and given back to `pool`."""

    def __init__(self, pool: PagePool, page_size: int):
        self.pool = pool
        self.page_size = page_size
        self.held: dict[Hashable, list[int]] = {}

    def pages(self, holder: Hashable) -> list[int]:
        return self.held.get(holder, [])

    def share(self, holder: Hashable, pages: Sequence[int]) -> None:
        """`pages` (held already, by others too) added to the holder's."""
        self.pool.hold(pages)
        self.held.setdefault(holder, []).extend(pages)

    def give(self, holder: Hashable, pages: Sequence[int]) -> None:
        """`pages` taken for the holder (`PagePool.take`) added to its, held in its name."""
        self.held.setdefault(holder, []).extend(pages)

    def missing(self, holder: Hashable, positions: int) -> int:
        """The pages the holder lacks to hold its first `positions` positions."""
        return max(pages_for(positions, self.page_size) - len(self.pages(holder)), 0)

    def grow(self, holder: Hashable, positions: int) -> list[int]:
        """Takes the pages the holder lacks to hold its first `positions` positions and
        returns them; raises OutOfPages (taking none) if the pool is short."""
        new = self.pool.take(self.missing(holder, positions))
        self.held.setdefault(holder, []).extend(new)
        return new

    def drop(self, holder: Hashable) -> None:
        """The holder's pages let go of (those no one else holds are free again)."""
        self.pool.release(self.held.pop(holder, []))

    def array(self, holders: Sequence[Hashable | None], width: int) -> np.ndarray:
        """The tables of `holders` (None: a row of no pages) as `[len(holders), width]`
        int32, `NO_PAGE` past each one's pages (pages beyond `width` are left out)."""
        table = np.full((len(holders), width), NO_PAGE, np.int32)
        for b, holder in enumerate(holders):
            kept = self.pages(holder)[:width] if holder is not None else []
            table[b, :len(kept)] = kept
        return table
