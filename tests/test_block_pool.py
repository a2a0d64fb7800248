"""BlockPool: exact ids for allocation, reuse and LRU eviction; typed refcount errors."""

import pytest

from vmkv.kvcache.base import KVCacheError
from vmkv.paged.block_pool import (
    BlockPool,
    BlockRefCountError,
    InvalidBlockError,
    NoFreeBlocksError,
)


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
        pool.register(2, 1234)
    assert pool.free_block_ids() == [1, 2, 0]
    pool.check_integrity({})
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_cached_blocks_evicted_lru_only_after_plain_free():
    pool = BlockPool(5)
    ids = [pool.allocate() for _ in range(4)]          # 0 1 2 3 used; 4 plain free
    for b, h in zip(ids, (100, 101, 102, 103)):
        assert pool.register(b, h)
    # free in the order 2, 0, 3 (least recently freed first: 2), and 1 stays used
    for b in (2, 0, 3):
        pool.decref(b)
    assert pool.num_free_blocks == 4
    assert pool.num_plain_free_blocks == 1 and pool.num_cached_free_blocks == 3
    assert pool.lookup(102) == 2                        # cached free blocks stay findable
    # the plain free block goes first, then cached ones in LRU order, dropping their hashes
    assert pool.allocate() == 4
    assert pool.lookup(102) == 2
    assert pool.allocate() == 2
    assert pool.lookup(102) is None and pool.block_hash(2) is None
    assert pool.allocate() == 0
    assert pool.lookup(100) is None and pool.lookup(103) == 3
    assert pool.num_evictions == 2
    pool.check_integrity({0: 1, 1: 1, 2: 1, 4: 1})


def test_revive_cached_block_removes_it_from_lru():
    pool = BlockPool(3)
    a, b, c = (pool.allocate() for _ in range(3))
    pool.register(a, 7)
    pool.register(b, 8)
    pool.decref(a)
    pool.decref(b)                                      # LRU: a, b
    pool.incref(pool.lookup(7))                         # revive a (refcount 0 -> 1)
    assert pool.refcount(a) == 1 and pool.num_free_blocks == 1
    pool.decref(a)                                      # a is now the most recently freed
    assert pool.free_block_ids() == [b, a]
    assert pool.allocate() == b
    pool.check_integrity({b: 1, c: 1})


def test_register_first_wins():
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, 5)
    assert not pool.register(b, 5)                      # hash already held by a
    assert not pool.register(a, 6)                      # a already has a hash
    assert pool.lookup(5) == a and pool.block_hash(b) is None
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
