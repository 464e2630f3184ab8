"""BlockPool: reference counts, the LRU free queue, the hash map, eviction."""

from __future__ import annotations

import pytest

from jengine.cache import BlockPool


def _hash(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")


def test_allocate_takes_the_head_in_order_and_counts_usage() -> None:
    pool = BlockPool(4, enable_prefix_caching=True)
    assert pool.allocate(2) == [0, 1]
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    assert pool.num_free_blocks == 2
    assert pool.usage == 0.5
    pool.check_invariants()


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(2, enable_prefix_caching=True)
    pool.allocate(1)
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_touch_and_free_track_reference_counts() -> None:
    pool = BlockPool(3, enable_prefix_caching=True)
    blocks = pool.allocate(2)
    pool.touch(blocks)
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    pool.free(blocks)
    assert pool.num_free_blocks == 1
    pool.free(blocks)
    assert pool.num_free_blocks == 3
    pool.check_invariants()
    with pytest.raises(AssertionError, match="reference count 0"):
        pool.free([blocks[0]])


def test_cached_free_block_stays_findable_until_allocated() -> None:
    pool = BlockPool(2, enable_prefix_caching=True)
    [block] = pool.allocate(1)
    assert pool.cache_block(block, _hash("a"))
    pool.free([block])
    assert pool.num_free_blocks == 2  # cached yet free: evictable
    assert pool.lookup(_hash("a")) == block
    pool.touch([block])  # a prefix hit unlinks it from the middle of the free queue
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 1
    pool.free([block])
    assert pool.allocate(2) == [1, block]  # the uncached block first, then the cached one is evicted
    assert pool.lookup(_hash("a")) is None
    assert pool.block_hash(block) is None
    pool.check_invariants()


def test_free_releases_in_reverse_so_the_tail_is_evicted_first() -> None:
    pool = BlockPool(4, enable_prefix_caching=True)
    sequence = pool.allocate(3)
    for index, block in enumerate(sequence):
        pool.cache_block(block, _hash(f"h{index}"))
    pool.free(sequence)
    assert pool.allocate(4) == [3, sequence[2], sequence[1], sequence[0]]


def test_least_recently_freed_is_evicted_first() -> None:
    pool = BlockPool(4, enable_prefix_caching=True)
    first, second = pool.allocate(1), pool.allocate(1)
    pool.cache_block(first[0], _hash("first"))
    pool.cache_block(second[0], _hash("second"))
    pool.free(first)
    pool.free(second)
    assert pool.allocate(3) == [2, 3, first[0]]
    assert pool.lookup(_hash("first")) is None
    assert pool.lookup(_hash("second")) == second[0]
    pool.check_invariants()


def test_freed_uncached_blocks_are_reused_before_cached_ones_are_evicted() -> None:
    pool = BlockPool(3, enable_prefix_caching=True)
    cached, plain = pool.allocate(1), pool.allocate(1)
    pool.cache_block(cached[0], _hash("c"))
    pool.free(cached)
    pool.free(plain)
    assert pool.allocate(2) == [plain[0], 2]
    assert pool.lookup(_hash("c")) == cached[0]


def test_one_block_per_hash_first_copy_wins() -> None:
    pool = BlockPool(2, enable_prefix_caching=True)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, _hash("x"))
    assert not pool.cache_block(b, _hash("x"))
    assert pool.cache_block(a, _hash("x"))  # idempotent
    assert pool.lookup(_hash("x")) == a and pool.block_hash(b) is None
    pool.check_invariants()


def test_disabled_prefix_caching_caches_nothing() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    [block] = pool.allocate(1)
    assert not pool.cache_block(block, _hash("x"))
    assert pool.lookup(_hash("x")) is None


def test_reset_prefix_cache_is_refused_while_blocks_are_held() -> None:
    pool = BlockPool(2, enable_prefix_caching=True)
    [block] = pool.allocate(1)
    pool.cache_block(block, _hash("x"))
    assert not pool.reset_prefix_cache()
    pool.free([block])
    assert pool.reset_prefix_cache()
    assert pool.lookup(_hash("x")) is None and pool.num_cached_blocks == 0
    pool.check_invariants()


def test_check_invariants_catches_corruption() -> None:
    pool = BlockPool(2, enable_prefix_caching=True)
    pool.allocate(1)
    pool._ref_counts[0] = 0  # noqa: SLF001 - corrupting on purpose
    with pytest.raises(AssertionError, match="free queue"):
        pool.check_invariants()
