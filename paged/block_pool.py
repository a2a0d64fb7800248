"""Physical block pool of the paged backend: free list, reference counts, prefix-cache eviction.

The pool deals only in block ids and counts, never in tensors (the nano-vllm block manager split).
A block is in exactly one of three states:

* **plain free**: ``refcount == 0`` and no prefix entry; kept in a FIFO free list.  Ids are handed out
  from its head and freed ids are appended to its tail, so the order is deterministic
  (initially ``0, 1, 2, ...``).
* **cached free** (evictable): ``refcount == 0`` but it still holds the K/V of a full block
  cached in the prefix index (:class:`~vmkv.kvcache.prefix.PrefixIndex`, keyed by a chained hash
  and verified against the block's token ids), so a later request with the same prefix can
  revive it.  Cached free blocks are kept in least-recently-freed order and evicted (entry
  dropped, with the entries of its descendants) only when no plain free block remains (vLLM
  automatic prefix caching; Kwon et al., "Efficient Memory Management for Large Language Model
  Serving with PagedAttention", SOSP'23, section 4.4).
* **used**: ``refcount >= 1``, referenced by that many block-table entries.

``num_free_blocks`` counts plain free + cached free blocks: both can be handed out.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

from vmkv.kvcache.errors import KVCacheError
from vmkv.kvcache.prefix import PrefixEntry, PrefixIndex, UnitKey

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
    """Fixed set of ``num_blocks`` block ids with reference counts and a prefix index.

    Args:
        num_blocks: blocks in the pool (> 0).
        prefix: the prefix index whose handles are block ids (a new one if ``None``).
    Raises:
        ValueError: ``num_blocks <= 0``.
    """

    def __init__(self, num_blocks: int, prefix: PrefixIndex | None = None) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # cached free blocks, least recently freed first: block_id -> None
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self.prefix = PrefixIndex() if prefix is None else prefix
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
        """Blocks (used or free) cached in the prefix index."""
        return len(self.prefix)

    def refcount(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._refcount[block_id]

    def is_cached_free(self, block_id: int) -> bool:
        return block_id in self._cached_free

    def free_block_ids(self) -> list[int]:
        """Plain free ids in hand-out order, then cached free ids in eviction order."""
        return list(self._free) + list(self._cached_free)

    def is_cached(self, block_id: int) -> bool:
        """Does the block (used or cached free) hold a unit of the prefix index?"""
        self._check_id(block_id)
        return self.prefix.is_cached(block_id)

    def block_hash(self, block_id: int) -> bytes | None:
        """Chained hash of the unit the block caches, or ``None``."""
        self._check_id(block_id)
        entry = self.prefix.entry_of(block_id)
        return None if entry is None else entry.key.hash

    # ------------------------------------------------------------------ mutation
    def allocate(self) -> int:
        """Take a block (refcount becomes 1).

        The head of the plain free list if any; otherwise the least recently freed cached block,
        whose prefix entry is dropped (eviction; cached free blocks of its descendants become
        plain free).

        Raises:
            NoFreeBlocksError: every block is used.
        """
        if self._free:
            block_id = self._free.popleft()
        elif self._cached_free:
            block_id, _ = self._cached_free.popitem(last=False)
            self.forget(block_id)
            self.num_evictions += 1
            logger.debug("evicted cached block %d", block_id)
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
            if self.prefix.is_cached(block_id):
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

    def register(self, block_id: int, key: UnitKey, parent: PrefixEntry | None = None) -> PrefixEntry | None:
        """Cache used block ``block_id`` as holding the unit ``key`` whose prefix is ``parent``
        (see :meth:`PrefixIndex.register`).

        Returns:
            The entry caching that content (this block's, or an existing block's with the same
            content: the first registration wins), or ``None`` (nothing cached).
        Raises:
            BlockRefCountError: the block is free.
        """
        self._check_id(block_id)
        if self._refcount[block_id] == 0:
            raise BlockRefCountError(f"register of free block {block_id}; only used blocks hold data")
        return self.prefix.register(key, parent, (block_id,))

    def forget(self, block_id: int) -> None:
        """Drop the prefix entry of ``block_id`` and its descendants (their content is not to be
        trusted or is evicted); their cached free blocks become plain free (tail of the free list)."""
        for b in self.prefix.drop(block_id):
            if b in self._cached_free:
                del self._cached_free[b]
                self._free.append(b)

    def reset_prefix_cache(self) -> int:
        """Drop every prefix entry; cached free blocks become plain free (in LRU order).  Returns
        how many entries were dropped."""
        self._free.extend(self._cached_free)
        self._cached_free.clear()
        return self.prefix.clear()

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
        self.prefix.check_integrity()
        hashed = self.prefix.handles()
        bad = [b for b in hashed if not (isinstance(b, int) and 0 <= b < self.num_blocks)]
        if bad:
            raise AssertionError(f"prefix entries name block ids {bad} outside [0, {self.num_blocks})")
        if cached - hashed:
            raise AssertionError(f"cached free blocks {sorted(cached - hashed)} have no prefix entry")
        if free & hashed:
            raise AssertionError(f"plain free blocks {sorted(free & hashed)} still have a prefix entry")
        if expected_refcounts is not None:
            for b in range(self.num_blocks):
                want = expected_refcounts.get(b, 0)
                if self._refcount[b] != want:
                    raise AssertionError(
                        f"block {b}: refcount {self._refcount[b]} but {want} block-table references")

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(f"block id {block_id} out of range [0, {self.num_blocks})")
