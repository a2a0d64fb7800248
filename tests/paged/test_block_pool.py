"""BlockPool: exact ids for allocation, reuse and LRU eviction; typed refcount errors."""

import pytest

from vmkv.kvcache.base import KVCacheError
from vmkv.kvcache.prefix import unit_keys
from vmkv.paged.block_pool import (
    BlockPool,
    BlockRefCountError,
    InvalidBlockError,
    NoFreeBlocksError,
)


def _key(token: int):
    """Key of a one-token first unit (unit size 1)."""
    return unit_keys([token], 1)[0]


def _cached(pool, token: int):
    """Block holding the verified first unit ``[token]``, or None."""
    hits = pool.prefix.match([_key(token)])
    return hits[0].handles[0] if hits else None


def test_initial_allocation_order_and_exhaustion():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 4
    with pytest.raises(NoFreeBlocksError, match="all 4 blocks"):
        pool.allocate()
    assert isinstance(NoFreeBlocksError("x"), KVCacheError)
    pool.check_integrity({0: 1, 1: 1, 2: 1, 3: 1})


def test_freed_blocks_reused_fifo_after_untouched_ones():
    pool = BlockPool(5)
    ids = [pool.allocate() for _ in range(3)]          # 0 1 2; free list: 3 4
    pool.decref(ids[1])                                # free list: 3 4 1
    pool.decref(ids[0])                                # free list: 3 4 1 0
    assert pool.free_block_ids() == [3, 4, 1, 0]
    assert [pool.allocate() for _ in range(4)] == [3, 4, 1, 0]
    pool.check_integrity({0: 1, 1: 1, 2: 1, 3: 1, 4: 1})


def test_free_releases_in_given_order():
    pool = BlockPool(3)
    ids = [pool.allocate() for _ in range(3)]
    pool.free(reversed(ids))
    assert pool.free_block_ids() == [2, 1, 0]
    assert pool.allocate() == 2


def test_refcounts_and_shared_free():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.incref(b)
    pool.incref(b)
    assert pool.refcount(b) == 3
    assert pool.decref(b) == 2 and pool.decref(b) == 1
    assert pool.num_free_blocks == 1
    assert pool.decref(b) == 0
    assert pool.num_free_blocks == 2
    pool.check_integrity({})


def test_refcount_errors_are_typed_and_change_nothing():
    pool = BlockPool(3)
    b = pool.allocate()
    pool.decref(b)
    with pytest.raises(BlockRefCountError, match="decref of free block 0"):
        pool.decref(b)
    with pytest.raises(BlockRefCountError, match="incref of plain free block 1"):
        pool.incref(1)
    with pytest.raises(InvalidBlockError, match=r"block id 3 out of range \[0, 3\)"):
        pool.decref(3)
    with pytest.raises(InvalidBlockError):
        pool.incref(-1)
    with pytest.raises(BlockRefCountError, match="register of free block"):
        pool.register(2, _key(1234))
    assert pool.free_block_ids() == [1, 2, 0]
    pool.check_integrity({})
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_cached_blocks_evicted_lru_only_after_plain_free():
    pool = BlockPool(5)
    ids = [pool.allocate() for _ in range(4)]          # 0 1 2 3 used; 4 plain free
    for b, h in zip(ids, (100, 101, 102, 103)):
        assert pool.register(b, _key(h)).handles == (b,)
    # free in the order 2, 0, 3 (least recently freed first: 2), and 1 stays used
    for b in (2, 0, 3):
        pool.decref(b)
    assert pool.num_free_blocks == 4
    assert pool.num_plain_free_blocks == 1 and pool.num_cached_free_blocks == 3
    assert _cached(pool, 102) == 2                      # cached free blocks stay findable
    # the plain free block goes first, then cached ones in LRU order, dropping their entries
    assert pool.allocate() == 4
    assert _cached(pool, 102) == 2
    assert pool.allocate() == 2
    assert _cached(pool, 102) is None and pool.block_hash(2) is None
    assert pool.allocate() == 0
    assert _cached(pool, 100) is None and _cached(pool, 103) == 3
    assert pool.num_evictions == 2
    pool.check_integrity({0: 1, 1: 1, 2: 1, 4: 1})


def test_revive_cached_block_removes_it_from_lru():
    pool = BlockPool(3)
    a, b, c = (pool.allocate() for _ in range(3))
    pool.register(a, _key(7))
    pool.register(b, _key(8))
    pool.decref(a)
    pool.decref(b)                                      # LRU: a, b
    pool.incref(_cached(pool, 7))                       # revive a (refcount 0 -> 1)
    assert pool.refcount(a) == 1 and pool.num_free_blocks == 1
    pool.decref(a)                                      # a is now the most recently freed
    assert pool.free_block_ids() == [b, a]
    assert pool.allocate() == b
    pool.check_integrity({b: 1, c: 1})


def test_register_first_wins():
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    first = pool.register(a, _key(5))
    assert first.handles == (a,)
    assert pool.register(b, _key(5)) is first           # same content already cached by a
    assert pool.register(a, _key(6)) is None            # a already caches other content
    assert _cached(pool, 5) == a and pool.block_hash(b) is None
    pool.decref(b)
    assert pool.num_plain_free_blocks == 1              # unregistered block is plain free
    pool.decref(a)
    assert pool.num_cached_free_blocks == 1
    assert pool.reset_prefix_cache() == 1
    assert pool.num_cached_free_blocks == 0 and pool.free_block_ids() == [b, a]
    pool.check_integrity({})


def test_integrity_detects_wrong_refcount():
    pool = BlockPool(2)
    pool.allocate()
    with pytest.raises(AssertionError, match="block 0: refcount 1 but 2"):
        pool.check_integrity({0: 2})
