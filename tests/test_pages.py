"""The host's page accounting: pages taken as rows grow and returned when they end, shared
pages freed with their last holder, exhaustion refused without taking anything, and a random
sequence of operations never loses or doubles a page."""

import numpy as np
import pytest

from llama_jax.serve.pages import NO_PAGE, OutOfPages, PagePool, RowTable, pages_for


def test_rows_take_pages_as_they_grow_and_return_them_when_they_end():
    pool = PagePool(10)
    table = RowTable(pool, page_size=4)
    assert table.grow(0, 5) == [0, 1]  # 5 positions: 2 pages
    assert table.grow(0, 8) == []  # still 2
    assert table.grow(1, 1) == [2]
    assert table.grow(0, 9) == [3]
    assert pool.used == 4 and pool.free == 6
    np.testing.assert_array_equal(table.array([0, 1, None], 4),
                                  [[0, 1, 3, NO_PAGE], [2] + [NO_PAGE] * 3, [NO_PAGE] * 4])
    np.testing.assert_array_equal(table.array([1, 0], 2), [[2, NO_PAGE], [0, 1]])
    table.drop(0)
    assert pool.used == 1 and table.pages(0) == []
    taken = table.grow(2, 16)
    assert len(set(taken)) == 4 and 2 not in taken and pool.used == 5


def test_exhaustion_is_refused_and_takes_nothing():
    pool = PagePool(3)
    table = RowTable(pool, page_size=2)
    table.grow(0, 4)
    with pytest.raises(OutOfPages, match="2 pages asked for, 1 of 3 free"):
        table.grow(1, 4)
    assert pool.free == 1 and table.pages(1) == []


def test_shared_pages_are_freed_with_their_last_holder():
    pool = PagePool(6)
    table = RowTable(pool, page_size=4)
    prefix = pool.take(2)  # the prefix cache's pages
    table.share(0, prefix)
    table.share(1, prefix)
    table.grow(0, 12)
    assert pool.holders(prefix[0]) == 3 and table.pages(0)[:2] == prefix
    table.drop(0)
    table.drop(1)
    assert pool.used == 2  # the prefix cache still holds them
    pool.release(prefix)
    assert pool.used == 0
    with pytest.raises(ValueError, match="released more often"):
        pool.release(prefix[:1])
    with pytest.raises(ValueError, match="is free"):
        table.share(2, prefix)
    given = pool.take(1)
    table.give(3, given)
    assert table.pages(3) == given and pool.holders(given[0]) == 1


def test_random_operations_never_lose_or_double_a_page():
    rng = np.random.default_rng(0)
    pool = PagePool(32)
    table = RowTable(pool, page_size=4)
    cached: list[list[int]] = []
    for _ in range(2000):
        b, op = int(rng.integers(8)), rng.integers(4)
        try:
            if op == 0:
                table.grow(b, int(rng.integers(1, 40)))
            elif op == 1:
                table.drop(b)
            elif op == 2 and table.pages(b):
                kept = table.pages(b)[:int(rng.integers(1, len(table.pages(b)) + 1))]
                pool.hold(kept)
                cached.append(kept)
            elif op == 3 and cached and not table.pages(b):
                table.share(b, cached.pop(int(rng.integers(len(cached)))))
                pool.release(table.pages(b))  # the cache hands its hold to the row
        except OutOfPages:
            pass
        holders = np.zeros(pool.total, int)
        for pages in [*table.held.values(), *cached]:
            np.add.at(holders, pages, 1)
        assert [pool.holders(p) for p in range(pool.total)] == holders.tolist()
        assert pool.free == int(np.sum(holders == 0))
    assert pages_for(0, 4) == 0 and pages_for(9, 4) == 3


def test_a_short_pool_lets_go_only_of_cached_chunks_that_free_pages():
    """Two chunks of 2 pages cached, the older one still listed by a row: a pool short of a
    page lets go of the newer (the older would free nothing), then has nothing to let go."""
    from llama_jax.plan.serving import ServerShape
    from llama_jax.serve.allocator import Allocator

    shape = ServerShape.of(64, page_bytes=100, max_batch=1, max_seq_len=32, prefill_chunk=16,
                           page_size=8, kv_cache_bytes=400, prefix_cache_bytes=400)
    allocator = Allocator(shape, "float32")
    assert shape.n_pages == 8 and shape.prefix_blocks == 2
    prompt = list(range(40))
    keys, cached, spares = allocator.reserve_prompt("row", prompt, 1, True, [])
    assert (len(keys), cached, spares) == (2, 0, []) and allocator.pool.used == 5
    allocator.keep_chunk("row", keys[0], 0)
    allocator.keep_chunk("row", keys[1], 1)
    allocator.release("row")
    allocator.tables.share("reader", allocator.index.lookup(keys[:1]))  # a row reads chunk 0
    assert allocator.pool.used == 4 and allocator.cached_blocks == 2
    assert allocator.make_room([("grower", 5 * 8)])  # 5 pages: the newer chunk goes
    assert allocator.cached_blocks == 1 and allocator.index.lookup(keys[:1])
    assert not allocator.make_room([("grower", 7 * 8)])  # chunk 0 would free nothing
    assert allocator.cached_blocks == 1 and allocator.pool.free == 6
