"""Block pool: exact block ids, reference counts and LRU eviction order."""

from __future__ import annotations

import pytest

from specbatch.cache.block_pool import BlockPool


def test_allocates_in_order_and_frees_to_the_tail() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.release([1, 0])
    assert pool.num_free == 4
    # free list is now 2, 3, 1, 0
    assert pool.allocate(4) == [2, 3, 1, 0]
    pool.check_consistency()


def test_over_allocation_and_double_release_raise() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="asked for 3 blocks, 2 free"):
        pool.allocate(3)
    [block] = pool.allocate(1)
    pool.release([block])
    with pytest.raises(RuntimeError, match="released more often than taken"):
        pool.release([block])


def test_cached_block_survives_release_until_evicted() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    key = (0, (1, 2, 3, 4))
    pool.register(a, key)
    pool.release([b, a])  # free list: 2, b, a
    assert pool.lookup(key) == a
    pool.share(a)  # a prefix hit revives it
    assert pool.ref_counts[a] == 1
    assert pool.num_free == 2
    pool.release([a])
    assert pool.allocate(2) == [2, b]
    assert pool.lookup(key) == a  # still cached: not reached by eviction
    assert pool.allocate(1) == [a]
    assert pool.lookup(key) is None  # evicted when handed out again
    pool.check_consistency()


def test_shared_block_needs_every_release() -> None:
    pool = BlockPool(2)
    [a] = pool.allocate(1)
    pool.register(a, (0, (5,)))
    pool.share(a)
    pool.release([a])
    assert pool.num_free == 1
    pool.release([a])
    assert pool.num_free == 2
    pool.check_consistency()
