"""The host's account of a paged KV cache's pool (model/kv_cache.py's `init_paged_cache`):
which pages are free, how many holders each page has, and each row's table.

A page is held by every row whose table lists it and by the prefix cache while it keeps it
(serve/prefix_index.py); it returns to the free list when its last holder lets go. Rows
share only pages they read and never write: a prompt's full pages, cached or shared by a
prompt's `n` choices (each choice writes its first tokens into a page of its own).

    pool = PagePool(total=1024)
    table = RowTable(pool, page_size=16)
    table.grow(b, positions=300)     # row b's pages to hold its first 300 positions
    pages_BN = table.array(rows=8, width=32)
    table.drop(b)                    # its pages back (those no one else holds)
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

import numpy as np

NO_PAGE = -1  # a table entry that is no page: nothing is written there


class OutOfPages(Exception):
    """The pool has fewer free pages than were asked for (nothing was taken)."""


def pages_for(positions: int, page_size: int) -> int:
    """The pages that hold `positions` positions."""
    return -(-positions // page_size)


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
    """Each row's pages, in slot order, taken from and given back to `pool`."""

    def __init__(self, pool: PagePool, page_size: int):
        self.pool = pool
        self.page_size = page_size
        self.rows: dict[int, list[int]] = {}

    def pages(self, b: int) -> list[int]:
        return self.rows.get(b, [])

    def share(self, b: int, pages: Sequence[int]) -> None:
        """Row b's table starts with `pages`, held by others too (a cached prefix)."""
        if self.pages(b):
            raise ValueError(f"row {b} has pages already: shared pages come first")
        self.pool.hold(pages)
        self.rows[b] = list(pages)

    def missing(self, b: int, positions: int) -> int:
        """The pages row b lacks to hold its first `positions` positions."""
        return max(pages_for(positions, self.page_size) - len(self.pages(b)), 0)

    def grow(self, b: int, positions: int) -> list[int]:
        """Takes the pages row b lacks to hold its first `positions` positions and returns
        them; raises OutOfPages (taking none) if the pool is short."""
        new = self.pool.take(self.missing(b, positions))
        self.rows.setdefault(b, []).extend(new)
        return new

    def drop(self, b: int) -> None:
        """Row b's pages let go of (those no one else holds are free again)."""
        self.pool.release(self.rows.pop(b, []))

    def array(self, rows: int, width: int) -> np.ndarray:
        """The tables of rows 0 .. rows - 1 as `[rows, width]` int32, `NO_PAGE` past each
        row's pages (a row's pages beyond `width` are left out)."""
        table = np.full((rows, width), NO_PAGE, np.int32)
        for b, pages in self.rows.items():
            kept = pages[:width]
            table[b, :len(kept)] = kept
        return table
