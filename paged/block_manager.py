"""Block bookkeeping of the paged backend: which blocks to take, share, copy and free (torch-free).

The nano-vllm split: this module deals in block ids and counts only; the cache turns the copy pairs
it returns into one tensor copy per step.  It keeps the host block-table rows
(:class:`~vmkv.paged.host_tables.HostBlockTables`) in step with every block table, and a running
count of the positions the used blocks cover (a shared block covers the same positions for every
sharer: prefix hits are full blocks, forks copy before either side grows), so ``usage()`` is O(1).
"""

from __future__ import annotations

from collections import Counter

from vmkv.kvcache.room import Room
from vmkv.kvcache.prefix import PrefixIndex
from vmkv.paged.block_pool import BlockPool
from vmkv.paged.host_tables import HostBlockTables

__all__ = ["BlockManager"]


class BlockManager:
    """Block tables over a :class:`BlockPool`, as hooks of the shared core.

    A sequence's ``units`` is its block table (a list of block ids), its ``row`` the host
    block-table row mirroring it.

    Args:
        num_blocks, block_size: the pool.
        max_num_seqs, max_blocks_per_seq: the host block-table array.
        prefix: the cache's prefix index (handles are block ids).
    """

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_blocks_per_seq: int,
                 prefix: PrefixIndex) -> None:
        self.block_size = block_size
        self.prefix = prefix
        self.pool = BlockPool(num_blocks, prefix)
        self.tables = HostBlockTables(max_num_seqs, max_blocks_per_seq)
        #: sum over used blocks of the positions they cover
        self.num_covered_tokens = 0

    def _covered(self, s, i: int) -> int:
        return min(self.block_size, s.seq_len - i * self.block_size)

    # ------------------------------------------------------------------ allocate
    def plan_allocate(self, num_tokens: int, hits: list[int]) -> Room:
        bs = self.block_size
        num_new = -(-num_tokens // bs) - len(hits)
        # reviving a cached free hit block takes it out of the evictable set
        available = self.pool.num_free_blocks - sum(self.pool.is_cached_free(b) for b in hits)
        return Room(num_new, available, num_tokens, (len(hits) + available) * bs,
                    f"needs {num_new} new blocks, {available} free", (num_tokens, hits, num_new))

    def allocate(self, room: Room) -> tuple[list[int], int]:
        num_tokens, hits, num_new = room.payload
        for b in hits:
            if self.pool.refcount(b) == 0:
                self.num_covered_tokens += self.block_size
            self.pool.incref(b)
        table = hits + [self.pool.allocate() for _ in range(num_new)]
        self.num_covered_tokens += num_tokens - len(hits) * self.block_size
        return table, self.tables.new_row(table)

    # ------------------------------------------------------------------ extend
    def plan_extend(self, s, new_len: int) -> Room:
        """Blocks for positions ``seq_len..new_len-1`` plus a copy of the shared block holding
        position ``seq_len`` (copy-on-write), against the free blocks."""
        bs, table, free = self.block_size, s.units, self.pool.num_free_blocks
        num_new = -(-new_len // bs) - len(table)
        i = s.seq_len // bs
        cow = [(s, i)] if i < len(table) and self.pool.refcount(table[i]) > 1 else []
        room_tokens = len(table) * bs - s.seq_len
        return Room(num_new + len(cow), free, new_len - s.seq_len + len(cow) * bs,
                    room_tokens + free * bs,
                    lambda: (f"sequence {s.seq_id!r} needs {num_new} new blocks + {len(cow)} "
                             f"copy-on-write, {free} free"), (new_len, num_new, cow))

    def extend(self, s, room: Room) -> list[tuple[int, int]]:
        new_len, num_new, cow = room.payload
        pairs = self._cow(cow)
        if num_new > 0:
            new = [self.pool.allocate() for _ in range(num_new)]
            self.tables.append(s.row, len(s.units), new)
            s.units.extend(new)
        self.num_covered_tokens += new_len - s.seq_len
        return pairs

    # ------------------------------------------------------------------ copy-on-write
    def plan_cow(self, targets) -> Room | None:
        """Which ``(state, block index)`` of ``targets`` (``(state, indices)`` pairs) need a copy
        before being written, simulating the refcount drop of each earlier copy (two sharers
        writing: only the first copies); ``None`` if none does."""
        rc: dict[int, int] = {}
        plan = []
        refcount = self.pool.refcount
        for s, indices in targets:
            table = s.units
            for i in indices:
                if i >= len(table):
                    continue
                b = table[i]
                count = rc.get(b) or refcount(b)
                if count > 1:
                    plan.append((s, i))
                    rc[b] = count - 1
        if not plan:
            return None
        free, bs = self.pool.num_free_blocks, self.block_size
        return Room(len(plan), free, len(plan) * bs, free * bs,
                    f"copy-on-write of {len(plan)} shared blocks, {free} free", plan)

    def apply_cow(self, room: Room) -> list[tuple[int, int]]:
        return self._cow(room.payload)

    def _cow(self, plan) -> list[tuple[int, int]]:
        """Give each ``(state, index)`` a fresh block; returns the ``(src, dst)`` copy pairs."""
        pairs = []
        for s, i in plan:
            old = s.units[i]
            new = self.pool.allocate()
            self.pool.decref(old)           # still used by another sharer (plan: refcount > 1)
            s.units[i] = new
            self.tables.set(s.row, i, new)
            self.num_covered_tokens += self._covered(s, i)
            pairs.append((old, new))
        return pairs

    # ------------------------------------------------------------------ fork, free
    def fork(self, parent) -> tuple[list[int], int]:
        for b in parent.units:
            self.pool.incref(b)
        return list(parent.units), self.tables.copy_row(parent.row)

    def free(self, s) -> None:
        """Each block loses a reference, tail first (so the tail of a cached prompt is evicted
        before its head)."""
        self.tables.release(s.row, len(s.units))
        for i in range(len(s.units) - 1, -1, -1):
            if self.pool.decref(s.units[i]) == 0:
                self.num_covered_tokens -= self._covered(s, i)

    def reset(self) -> None:
        self.prefix.clear()
        self.pool = BlockPool(self.pool.num_blocks, self.prefix)
        self.tables.reset()
        self.num_covered_tokens = 0

    # ------------------------------------------------------------------ checks
    def check_integrity(self, seqs) -> None:
        """Raise ``AssertionError`` naming the numbers if block tables, refcounts, the free list,
        the host rows, the coverage count or the hash map disagree."""
        refs: Counter = Counter()
        covered: dict[int, int] = {}
        for sid, s in seqs.items():
            want = -(-s.seq_len // self.block_size)
            if len(s.units) != want:
                raise AssertionError(f"sequence {sid}: {len(s.units)} blocks for seq_len "
                                     f"{s.seq_len}, expected {want}")
            refs.update(s.units)
            for i, b in enumerate(s.units):
                covered[b] = max(covered.get(b, 0), self._covered(s, i))
        bad = [b for b in refs if not 0 <= b < self.pool.num_blocks]
        if bad:
            raise AssertionError(f"block tables reference ids {bad} outside [0, {self.pool.num_blocks})")
        self.tables.check({sid: (s.row, s.units) for sid, s in seqs.items()})
        self.pool.check_integrity(dict(refs))
        if self.pool.num_used_blocks != len(refs):
            raise AssertionError(f"pool has {self.pool.num_used_blocks} used blocks, block tables "
                                 f"reference {len(refs)}")
        if sum(covered.values()) != self.num_covered_tokens:
            raise AssertionError(f"covered-tokens counter {self.num_covered_tokens} != "
                                 f"{sum(covered.values())} positions covered by used blocks")
