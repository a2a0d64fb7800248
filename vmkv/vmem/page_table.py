"""The one page table of the vmem backend: per physical page in use, where it is mapped, how many of
those mappings are claimed, and when it was last used (torch-free, no driver calls).

Every reference count of the backend is read here: the page pool's (a page is in use while it has
an entry: acquired and not yet mapped, or mapped), the mapper's (a page's reference count is the
number of slots it is mapped in; it is reclaimable when none of those mappings is claimed) and the
usage counters (pages with a claimed mapping are allocated).  The drivers keep no reference counts.

A page sits at one ``(reservation, unit)`` in every slot it is mapped in (prefix hits are verified
down to their chain position, so a hit's unit is its depth), so an entry stores that position once
and the set of slots.
"""

from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["PageTable", "PageEntry"]


class PageEntry:
    """One page in use: its position ``(res, unit)`` while mapped (``None`` before its first mapping),
    the slots it is mapped in and how many of those mappings are claimed."""

    __slots__ = ("pos", "slots", "num_claimed")

    def __init__(self) -> None:
        self.pos: tuple[int, int] | None = None
        self.slots: set[int] = set()
        self.num_claimed = 0


class PageTable:
    """Pages in use, their mappings and claims, kept with O(1) counters.

    Attributes:
        entries: page -> :class:`PageEntry` for every page in use.
        last_use: page -> tick it was last unclaimed or mapped; kept after a page leaves use (cached
            free pages are evicted by it), at most one entry per created page.
        reclaimable: mapped pages none of whose mappings is claimed.
        num_claimed_pages: pages with at least one claimed mapping (allocated pages).
        num_mapped_pages: pages with at least one mapping.
        num_mappings: mappings in total (what the driver has mapped, guards aside).
        shared_positions: slot index -> how many of its mappings are of a page mapped in another
            slot too (absent: none), so an operation on one slot knows in O(1) whether any of its
            pages is shared.
    """

    def __init__(self) -> None:
        self.entries: dict[int, PageEntry] = {}
        self.last_use: dict[int, int] = {}
        self.reclaimable: set[int] = set()
        self.num_claimed_pages = 0
        self.num_mapped_pages = 0
        self.num_mappings = 0
        self.shared_positions: dict[int, int] = {}

    # ------------------------------------------------------------------ queries
    def __contains__(self, page: int) -> bool:
        return page in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def refcount(self, page: int) -> int:
        """Mappings of ``page`` (0 for a page acquired but not mapped, or not in use)."""
        entry = self.entries.get(page)
        return 0 if entry is None else len(entry.slots)

    def num_claimed(self, page: int) -> int:
        entry = self.entries.get(page)
        return 0 if entry is None else entry.num_claimed

    def position(self, page: int) -> tuple[int, int] | None:
        """``(reservation, unit)`` of a mapped page, else None."""
        entry = self.entries.get(page)
        return None if entry is None else entry.pos

    def slots_of(self, page: int) -> set[int]:
        return self.entries[page].slots

    def _shared_delta(self, slot: int, delta: int) -> None:
        n = self.shared_positions.get(slot, 0) + delta
        if n:
            self.shared_positions[slot] = n
        else:
            del self.shared_positions[slot]

    def _joined(self, e: PageEntry, slot: int) -> None:
        """``slot`` was just added to ``e.slots``: the shared-position counts follow."""
        k = len(e.slots)
        if k == 2:
            for s in e.slots:
                self._shared_delta(s, 1)
        elif k > 2:
            self._shared_delta(slot, 1)

    def _left(self, e: PageEntry, slot: int) -> None:
        """``slot`` was just removed from ``e.slots``."""
        k = len(e.slots)
        if k == 1:
            self._shared_delta(slot, -1)
            self._shared_delta(next(iter(e.slots)), -1)
        elif k > 1:
            self._shared_delta(slot, -1)

    # ------------------------------------------------------------------ pool side
    def add(self, page: int) -> None:
        """``page`` leaves the free tiers (acquired or revived): in use, not mapped yet."""
        assert page not in self.entries, f"page {page} is already in use"
        self.entries[page] = PageEntry()

    def add_many(self, pages: Iterable[int]) -> None:
        """:meth:`add` of each of ``pages``."""
        entries = self.entries
        pages = tuple(pages)
        assert entries.keys().isdisjoint(pages), \
            f"pages {[p for p in pages if p in entries]} are already in use"
        entries.update(zip(pages, [PageEntry() for _ in pages]))

    def remove(self, page: int) -> None:
        """``page`` goes back to a free tier: it must be mapped nowhere."""
        entry = self.entries.get(page)
        assert entry is not None and not entry.slots, f"page {page} is not an unmapped page in use"
        del self.entries[page]

    # ------------------------------------------------------------------ mapper side
    def add_mapping(self, page: int, res: int, unit: int, slot: int, claimed: bool, tick: int) -> None:
        entry = self.entries[page]
        assert entry.pos is None or entry.pos == (res, unit), \
            f"page {page} is at {entry.pos}, cannot map at {(res, unit)}"
        assert slot not in entry.slots, f"page {page} is already mapped in slot {slot}"
        if not entry.slots:
            self.num_mapped_pages += 1
        entry.pos = (res, unit)
        entry.slots.add(slot)
        if len(entry.slots) > 1:
            self._joined(entry, slot)
        self.num_mappings += 1
        self.last_use[page] = tick
        self._claim(page, entry, int(claimed))

    def add_mappings(self, items: Sequence[tuple[int, int, int]], slot: int, claimed_units: int,
                     tick: int) -> None:
        """:meth:`add_mapping` of each ``(unit, res, page)`` of ``items`` in ``slot`` in one loop; a
        mapping is claimed when its unit is below ``claimed_units``."""
        entries, reclaimable, last_use = self.entries, self.reclaimable, self.last_use
        num_mapped = num_claimed = 0
        for unit, res, page in items:
            e = entries[page]
            assert e.pos is None or e.pos == (res, unit), \
                f"page {page} is at {e.pos}, cannot map at {(res, unit)}"
            assert slot not in e.slots, f"page {page} is already mapped in slot {slot}"
            if not e.slots:
                num_mapped += 1
            e.pos = (res, unit)
            e.slots.add(slot)
            if len(e.slots) > 1:
                self._joined(e, slot)
            last_use[page] = tick
            if unit < claimed_units:
                num_claimed += not e.num_claimed
                e.num_claimed += 1
                reclaimable.discard(page)
            elif not e.num_claimed:
                reclaimable.add(page)
        self.num_mapped_pages += num_mapped
        self.num_mappings += len(items)
        self.num_claimed_pages += num_claimed

    def remove_mapping(self, page: int, slot: int, claimed: bool) -> int:
        """Drop the mapping of ``page`` in ``slot``; returns the mappings left (at 0 the entry stays
        until :meth:`remove`, the pool's call)."""
        entry = self.entries[page]
        entry.slots.remove(slot)
        if entry.slots:
            self._left(entry, slot)
        self.num_mappings -= 1
        self._claim(page, entry, -int(claimed))
        if not entry.slots:
            self.num_mapped_pages -= 1
            entry.pos = None
            self.reclaimable.discard(page)
        return len(entry.slots)

    def claim(self, page: int, step: int, tick: int) -> None:
        """One mapping of ``page`` becomes claimed (``step`` 1) or unclaimed (-1)."""
        if step < 0:
            self.last_use[page] = tick
        self._claim(page, self.entries[page], step)

    def claim_pages(self, pages: Sequence[int], step: int, tick: int) -> None:
        """:meth:`claim` of each of ``pages`` (distinct) in one loop (a range of units claimed or
        released)."""
        entries = self.entries
        delta = 0
        if step > 0:
            for page in pages:
                e = entries[page]
                before = e.num_claimed
                e.num_claimed = before + 1
                assert before < len(e.slots), f"page {page}: {before + 1} claimed of {len(e.slots)} mappings"
                if not before:
                    delta += 1
            self.reclaimable.difference_update(pages)      # every page has a claim now
        else:
            idle = []
            for page in pages:
                e = entries[page]
                after = e.num_claimed - 1
                assert after >= 0, f"page {page}: {after} claimed of {len(e.slots)} mappings"
                e.num_claimed = after
                if not after:
                    idle.append(page)
            delta = -len(idle)
            self.last_use.update(dict.fromkeys(pages, tick))
            self.reclaimable.update(idle)
        self.num_claimed_pages += delta

    def _claim(self, page: int, entry: PageEntry, step: int) -> None:
        before = entry.num_claimed
        entry.num_claimed = before + step
        assert 0 <= entry.num_claimed <= len(entry.slots), \
            f"page {page}: {entry.num_claimed} claimed of {len(entry.slots)} mappings"
        if before == 0 and entry.num_claimed:
            self.num_claimed_pages += 1
        elif before and entry.num_claimed == 0:
            self.num_claimed_pages -= 1
        if entry.slots and entry.num_claimed == 0:
            self.reclaimable.add(page)
        else:
            self.reclaimable.discard(page)

    # ------------------------------------------------------------------ checks
    def check_against(self, mappings: dict[int, tuple[tuple[int, int], set[int], int]]) -> None:
        """Compare with ``page -> ((res, unit), slots, claimed mappings)`` counted by a full walk of
        the slots; raise ``AssertionError`` naming the numbers on a difference."""
        mapped = {p for p, e in self.entries.items() if e.slots}
        if mapped != set(mappings):
            raise AssertionError(f"{len(mappings)} pages mapped, {len(mapped)} in the page table "
                                 f"(differ: {sorted(mapped ^ set(mappings))[:8]})")
        for p, (pos, slots, claimed) in mappings.items():
            e = self.entries[p]
            if (e.pos, e.slots, e.num_claimed) != (pos, slots, claimed):
                raise AssertionError(f"page {p}: table says {e.pos} in slots {sorted(e.slots)} "
                                     f"({e.num_claimed} claimed), the slots say {pos} in "
                                     f"{sorted(slots)} ({claimed} claimed)")
        shared: dict[int, int] = {}
        for _, slots, _ in mappings.values():
            if len(slots) > 1:
                for s in slots:
                    shared[s] = shared.get(s, 0) + 1
        if shared != self.shared_positions:
            raise AssertionError(f"shared positions per slot {self.shared_positions}, the slots say {shared}")
        expected = {p for p, (_, _, claimed) in mappings.items() if claimed == 0}
        if expected != self.reclaimable:
            raise AssertionError(f"reclaimable set has {len(self.reclaimable)} pages, "
                                 f"expected {len(expected)}")
        counts = (sum(1 for *_, c in mappings.values() if c), len(mappings),
                  sum(len(s) for _, s, _ in mappings.values()))
        if counts != (self.num_claimed_pages, self.num_mapped_pages, self.num_mappings):
            raise AssertionError(f"counters (claimed pages, mapped pages, mappings) "
                                 f"{(self.num_claimed_pages, self.num_mapped_pages, self.num_mappings)}"
                                 f" != walk {counts}")
