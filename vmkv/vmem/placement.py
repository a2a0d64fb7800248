"""Where a vmem sequence goes: the host page size and the choice of a free slot (torch-free
arithmetic over the mapper's slots; DESIGN.md "vmem backend / Pool and reclamation")."""

from __future__ import annotations

import math
import mmap
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from vmkv.vmem.mapper import SlotMapper
    from vmkv.vmem.slots import Slot

__all__ = ["default_host_page_size", "pick_slot", "pick_fork_slot", "HOST_TARGET_PAGE_BYTES"]

#: the host driver's default page is the smallest multiple of lcm(OS page, token bytes) >= this ...
HOST_TARGET_PAGE_BYTES = 64 * 1024
#: ... unless that lcm exceeds this (then pages hold fractional tokens and prefix caching is off)
_HOST_MAX_PAGE_BYTES = 2 * 1024 * 1024


def default_host_page_size(token_bytes: int, max_model_len: int) -> int:
    """Host page size: whole tokens per page (so prefix caching works) and about 64 KiB.

    The smallest multiple of ``lcm(OS page size, token_bytes)`` (bytes of one token in a slot row)
    that is at least 64 KiB, but no larger than one slot row needs; 64 KiB (fractional tokens per
    page) when that lcm exceeds 2 MiB.
    """
    base = math.lcm(mmap.PAGESIZE, token_bytes)
    if base > _HOST_MAX_PAGE_BYTES:
        return HOST_TARGET_PAGE_BYTES
    row_bytes = max_model_len * token_bytes
    return base * max(1, min(-(-HOST_TARGET_PAGE_BYTES // base), -(-row_bytes // base)))


def pick_slot(mapper: SlotMapper, num_units: int, hits: Sequence[Sequence[int]],
              exclude: frozenset = frozenset()) -> Slot | None:
    """Best fit among free slots: fewest driver calls to occupy it (a prefix-hit page already in
    place costs none, a hole one map, a page to replace or a cached prefix page to move out an
    unmap and a map); then the kept mapping closest to ``num_units`` from above (else the largest
    below); then the lowest index."""
    entries, num_res, num_hits = mapper.table.entries, mapper.num_res, len(hits)
    if not num_hits and not len(mapper.prefix):
        # the common warm admission: the free slot keeping the fewest units >= num_units has the
        # least lower bound of all (below); when its kept pages back units [0, num_units) without a
        # call (all mapped there only, no page cached), its key is that bound, so no slot can beat it
        first = mapper.free_slots.first_keeping(num_units)
        if first is not None and first not in exclude:
            s = mapper.slots[first]
            if mapper.unshared(s) and mapper.mapped_below(s, num_units) == num_units * num_res:
                return s
    # no prefix entry at all (prefix caching off, or nothing cached yet): no page is cached
    is_cached = mapper.prefix.is_cached if len(mapper.prefix) else frozenset().__contains__
    # no hit, and no page of the slot shared, none cached: each kept page below num_units saves its map
    unshared = mapper.unshared if not num_hits else lambda s: False

    def calls(s: Slot) -> int:
        if unshared(s):
            return num_units * num_res - mapper.mapped_below(s, num_units)
        n = num_units * num_res         # a map per position, corrected for what is in place
        for u, pages in s.units.items():
            if u >= num_units:
                continue
            if u < num_hits:
                unit_hits = hits[u]
                for r, p in enumerate(pages):
                    if p is not None:
                        n += -1 if p == unit_hits[r] else 1
                continue
            for p in pages:
                if p is not None:
                    n += 1 if len(entries[p].slots) > 1 or is_cached(p) else -1
        return n

    def lower_key(s: Slot):
        # calls(s) >= every position minus one per kept page below num_units (at most num_res in
        # each of at most min(kept units, num_units) units), so this key bounds key(s) from below
        kept = len(s.units)
        fit = (0, kept - num_units) if kept >= num_units else (1, num_units - kept)
        return (num_units * num_res - num_res * min(kept, num_units), fit, s.index)

    # exact best key with the fewest page walks: free slots in the order of their lower bound (kept by
    # the mapper, slots.py); once a bound exceeds the best key found, no later slot can beat it (a
    # slot whose kept pages all fit ends the search at once, the common warm admission; of the slots
    # that keep nothing, only the lowest-index one is scored)
    slots = mapper.slots
    best, best_key = None, None
    for index in mapper.free_slots.in_bound_order(num_units):
        if index in exclude:
            continue
        s = slots[index]
        low = lower_key(s)
        if best_key is not None and low > best_key:
            break
        k = (calls(s), low[1], low[2])
        if best_key is None or k < best_key:
            best, best_key = s, k
    return best


def pick_fork_slot(mapper: SlotMapper, parent: Slot, num_units: int) -> Slot:
    """The free slot whose kept pages differ least from ``parent``'s first ``num_units`` units (a page
    kept at a position where the parent maps another one must be unmapped before the fork maps the
    parent's), then the lowest index.

    Free slots are scored in index order, each walk stopping once it cannot beat the best so far; a
    slot that keeps no pages differs nowhere, so the lowest-index such slot ends the search (found in
    O(1) from :attr:`SlotMapper.free_slots`) and only free slots below it are scored.

    Raises:
        ValueError: no slot is free (the cache checks the slot count first).
    """
    parent_units = parent.units
    empty = mapper.free_slots.lowest_empty()
    end = len(mapper.slots) if empty is None else empty

    def mismatches(s: Slot, bound: int) -> int:
        n = 0
        for u, pages in s.units.items():
            if u >= num_units:
                continue
            theirs = parent_units.get(u)
            for r, p in enumerate(pages):
                if p is not None and (theirs is None or theirs[r] != p):
                    n += 1
            if n >= bound:
                break
        return n

    best, best_n = None, None
    for s in mapper.slots[:end]:
        if s.seq_id is not None:
            continue
        n = mismatches(s, best_n if best_n is not None else 1 << 62)
        if best_n is None or n < best_n:
            best, best_n = s, n
            if n == 0:
                return s
    if empty is not None:
        return mapper.slots[empty]
    if best is None:
        raise ValueError("no free slot to fork into")
    return best
