"""Physical block pool of the paged backend: free list, reference counts, prefix-cache hash map.

The pool deals only in block ids and counts, never in tensors (the nano-vllm block manager split).
A block is in exactly one of three states:

* **plain free**: ``refcount == 0`` and no hash; kept in a FIFO free list.  Ids are handed out
  from its head and freed ids are appended to its tail, so the order is deterministic
  (initially ``0, 1, 2, ...``).
* **cached free** (evictable): ``refcount == 0`` but it still holds the K/V of a registered
  full-block hash, so a later request with the same prefix can revive it.  Cached free blocks
  are kept in least-recently-freed order and evicted (hash dropped) only when no plain free
  block remains (vLLM automatic prefix caching; Kwon et al., "Efficient Memory Management for
  Large Language Model Serving with PagedAttention", SOSP'23, section 4.4).
* **used**: ``refcount >= 1``, referenced by that many block-table entries.

``num_free_blocks`` counts plain free + cached free blocks: both can be handed out.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

from vmkv.kvcache.base import KVCacheError

__all__ = ["BlockPool", "BlockPoolError", "NoFreeBlocksError", "InvalidBlockError",
           "BlockRefCountError"]

logger = logging.getLogger(__name__)


class BlockPoolError(KVCacheError):
    """Base class of block-pool errors."""


class NoFreeBlocksError(BlockPoolError):
    """``allocate`` found neither a plain free nor an evictable cached block."""


class InvalidBlockError(BlockPoolError, ValueError):
    """A block id outside ``[0, num_blocks)``."""


class BlockRefCountError(BlockPoolError):
    """A reference-count operation on a block in the wrong state (e.g. decref of a free block)."""


class BlockPool:
    """Fixed set of ``num_blocks`` block ids with reference counts and a hash -> block map.

    Args:
        num_blocks: blocks in the pool (> 0).
    Raises:
        ValueError: ``num_blocks <= 0``.
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # cached free blocks, least recently freed first: block_id -> None
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}
        self._block_to_hash: dict[int, int] = {}
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out: plain free + cached free (evictable)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_plain_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks still holding a registered prefix (evictable, revivable)."""
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks (used or free) registered in the hash map."""
        return len(self._block_to_hash)

    def refcount(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._refcount[block_id]

    def is_cached_free(self, block_id: int) -> bool:
        return block_id in self._cached_free

    def free_block_ids(self) -> list[int]:
        """Plain free ids in hand-out order, then cached free ids in eviction order."""
        return list(self._free) + list(self._cached_free)

    def lookup(self, block_hash: int) -> int | None:
        """Block holding the full block with ``block_hash`` (used or cached free), or ``None``."""
        return self._hash_to_block.get(block_hash)

    def block_hash(self, block_id: int) -> int | None:
        self._check_id(block_id)
        return self._block_to_hash.get(block_id)

    # ------------------------------------------------------------------ mutation
    def allocate(self) -> int:
        """Take a block (refcount becomes 1).

        The head of the plain free list if any; otherwise the least recently freed cached block,
        whose hash is dropped (eviction).

        Raises:
            NoFreeBlocksError: every block is used.
        """
        if self._free:
            block_id = self._free.popleft()
        elif self._cached_free:
            block_id, _ = self._cached_free.popitem(last=False)
            h = self._block_to_hash.pop(block_id)
            del self._hash_to_block[h]
            self.num_evictions += 1
            logger.debug("evicted cached block %d (hash %016x)", block_id, h)
        else:
            raise NoFreeBlocksError(
                f"no free block: all {self.num_blocks} blocks are in use; free a sequence or "
                f"build the cache with more memory_bytes")
        self._refcount[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        """Add a reference to a used block, or revive a cached free block (refcount 0 -> 1).

        Raises:
            InvalidBlockError: id out of range.
            BlockRefCountError: the block is plain free (use ``allocate``).
        """
        self._check_id(block_id)
        if self._refcount[block_id] == 0:
            if block_id not in self._cached_free:
                raise BlockRefCountError(
                    f"incref of plain free block {block_id} (refcount 0, no prefix hash); "
                    f"take blocks with allocate()")
            del self._cached_free[block_id]
        self._refcount[block_id] += 1

    def decref(self, block_id: int) -> int:
        """Drop one reference; at 0 the block becomes cached free (if it has a hash, at the
        most-recent end of the LRU) or plain free (tail of the free list).

        Returns:
            The new reference count.
        Raises:
            InvalidBlockError: id out of range.
            BlockRefCountError: the block is already free (refcount 0).
        """
        self._check_id(block_id)
        rc = self._refcount[block_id]
        if rc <= 0:
            raise BlockRefCountError(
                f"decref of free block {block_id} (refcount {rc}); each block-table entry "
                f"releases its reference once")
        rc -= 1
        self._refcount[block_id] = rc
        if rc == 0:
            if block_id in self._block_to_hash:
                self._cached_free[block_id] = None
            else:
                self._free.append(block_id)
        return rc

    def free(self, block_ids) -> None:
        """``decref`` each id in order (pass a sequence's blocks tail first so that its tail,
        the least shareable part, is evicted first, as vLLM v1's ``free_blocks`` does).

        Raises:
            BlockRefCountError / InvalidBlockError: on the first bad id; earlier ids stay freed.
        """
        for b in block_ids:
            self.decref(b)

    def register(self, block_id: int, block_hash: int) -> bool:
        """Record that used block ``block_id`` holds the full block ``block_hash``.

        Returns:
            ``True`` if registered; ``False`` if the hash is already held by another block or
            this block already has a hash (the first registration wins).
        Raises:
            BlockRefCountError: the block is free.
        """
        self._check_id(block_id)
        if self._refcount[block_id] == 0:
            raise BlockRefCountError(f"register of free block {block_id}; only used blocks hold data")
        if block_hash in self._hash_to_block or block_id in self._block_to_hash:
            return False
        self._hash_to_block[block_hash] = block_id
        self._block_to_hash[block_id] = block_hash
        return True

    def reset_prefix_cache(self) -> int:
        """Drop every hash; cached free blocks become plain free (in LRU order).  Returns how many
        hashes were dropped."""
        n = len(self._block_to_hash)
        self._free.extend(self._cached_free)
        self._cached_free.clear()
        self._hash_to_block.clear()
        self._block_to_hash.clear()
        return n

    # ------------------------------------------------------------------ checks
    def check_integrity(self, expected_refcounts: dict[int, int] | None = None) -> None:
        """Raise ``AssertionError`` naming the numbers if the pool's bookkeeping disagrees.

        Args:
            expected_refcounts: block_id -> references held by block tables; every other block
                must then have refcount 0.
        """
        free = set(self._free)
        cached = set(self._cached_free)
        if len(free) != len(self._free):
            raise AssertionError(
                f"free list holds duplicates: {len(self._free)} entries, {len(free)} distinct")
        if free & cached:
            raise AssertionError(f"blocks both plain free and cached free: {sorted(free & cached)}")
        used = {b for b in range(self.num_blocks) if self._refcount[b] > 0}
        if used & (free | cached):
            raise AssertionError(f"blocks both free and used: {sorted(used & (free | cached))}")
        if len(used) + len(free) + len(cached) != self.num_blocks:
            raise AssertionError(
                f"used {len(used)} + plain free {len(free)} + cached free {len(cached)} "
                f"!= num_blocks {self.num_blocks}")
        negative = [b for b in range(self.num_blocks) if self._refcount[b] < 0]
        if negative:
            raise AssertionError(f"negative refcounts on blocks {negative}")
        for h, b in self._hash_to_block.items():
            if self._block_to_hash.get(b) != h:
                raise AssertionError(
                    f"hash {h:016x} -> block {b}, but block {b} -> {self._block_to_hash.get(b)}")
        if len(self._hash_to_block) != len(self._block_to_hash):
            raise AssertionError(
                f"hash map sizes differ: {len(self._hash_to_block)} hashes, "
                f"{len(self._block_to_hash)} blocks")
        for b in cached:
            if b not in self._block_to_hash:
                raise AssertionError(f"cached free block {b} has no hash")
        for b in free:
            if b in self._block_to_hash:
                raise AssertionError(f"plain free block {b} still has hash {self._block_to_hash[b]:016x}")
        if expected_refcounts is not None:
            for b in range(self.num_blocks):
                want = expected_refcounts.get(b, 0)
                if self._refcount[b] != want:
                    raise AssertionError(
                        f"block {b}: refcount {self._refcount[b]} but {want} block-table references")

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(f"block id {block_id} out of range [0, {self.num_blocks})")
