"""Slots and their mappings: which physical page is mapped at each (slot, unit, reservation), the map and
unmap primitives, claims, fences and parked slots (torch-free; vAttention, Prabhu et al., ASPLOS'25,
sections 5-6; the terms, slot, unit, claimed, kept, fence, parked, are defined in ``docs/kvcache.md``,
"Concepts").

A live slot claims its units ``[0, claimed)``; every other mapped page is kept, and a page is
**reclaimable** when none of its mappings is claimed.  Unmapping a kept page waits for the fence its
slot recorded when it was freed (unmapping memory a kernel still reads is a sticky illegal-address
error on CUDA).

**Parked slots.**  Freeing a slot releases the claims on its units page by page and the next admission
claims them again, while the memory does not change (vAttention, section 5.3, hands a freed slot's pages
to the next request with no per-page work).  So a freed slot is **parked** when nothing can observe the
difference (:meth:`SlotSpace.unshared`): it keeps ``claimed`` and every reader of the claim state sees
its pages as released (:attr:`SlotSpace.num_parked_pages`).  The release is made real
(:meth:`SlotSpace.unpark_all`) before anything looks at pages one by one; an admission or fork into a
parked slot adopts its claims (:meth:`SlotSpace.adopt`).

Pages are mapped in **batches** (:meth:`SlotSpace.map_batch`): every page without access, then one
``set_access`` per maximal run of adjacent pages (on CUDA that saves the per-call overhead only).
"""

from __future__ import annotations

import collections
import logging
import time
from bisect import bisect_left, insort
from itertools import chain, repeat
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    from vmkv.kvcache.prefix import PrefixIndex
    from vmkv.vmem.layout import VMemLayout
    from vmkv.vmem.page_pool import PagePool
    from vmkv.vmem.protocol import PageDriver

__all__ = ["Slot", "FreeSlotIndex", "SlotSpace"]

logger = logging.getLogger(__name__)

_MAX_SAMPLES = 100_000


class Slot:
    """One row of the reservations.

    Attributes:
        index: the row (``0 <= index < max_num_seqs``).
        units: ``units[u][r]``: page mapped at unit ``u`` of reservation ``r`` (``None``: a hole);
            a unit with no page at all has no key.
        seq_id: the live sequence, ``None`` when free.
        claimed: units ``[0, claimed)`` are claimed (fully mapped).
        fence: recorded when the slot was freed; kept pages are unmapped only after it completed.
        free_tick: the space's tick at the slot's last vacate (eviction order).
        mapped_to: units ``[0, mapped_to)`` are known fully mapped (raised by prefetch, lowered by
            every unmap), so a prefetch that asks for no more returns at once.
        num_mapped: pages mapped in the slot; ``units_end``: one past its highest unit (0 when
            empty), so an operation whose range covers every unit counts instead of walking.
    """

    __slots__ = ("index", "units", "seq_id", "claimed", "fence", "free_tick", "mapped_to", "num_mapped",
                 "units_end")

    def __init__(self, index: int) -> None:
        self.index, self.seq_id, self.fence = index, None, None
        self.units: dict[int, list[int | None]] = {}
        self.claimed = self.free_tick = self.mapped_to = self.num_mapped = self.units_end = 0

    @property
    def is_free(self) -> bool:
        return self.seq_id is None

    def page(self, unit: int, res: int) -> int | None:
        pages = self.units.get(unit)
        return None if pages is None else pages[res]


class FreeSlotIndex:
    """``(kept units, slot index)`` of every free slot, sorted, so that choosing a slot for an admission
    (:func:`~vmkv.vmem.placement.pick_slot`) visits them best bound first; kept units is
    ``len(slot.units)``.  The space keeps it current (O(log n) per change plus a memmove)."""

    def __init__(self, num_slots: int) -> None:
        self._order: list[tuple[int, int]] = [(0, i) for i in range(num_slots)]
        self._kept: dict[int, int] = dict.fromkeys(range(num_slots), 0)

    def __len__(self) -> int:
        return len(self._order)

    def add(self, index: int, kept: int) -> None:
        """Slot ``index`` became free keeping ``kept`` units (it must not be free already)."""
        assert index not in self._kept, f"slot {index} is already free"
        self._kept[index] = kept
        insort(self._order, (kept, index))

    def remove(self, index: int) -> None:
        """Slot ``index`` is no longer free.  Raises KeyError when it was not free."""
        kept = self._kept.pop(index)
        i = bisect_left(self._order, (kept, index))
        assert self._order[i] == (kept, index), f"slot {index} missing from the free order"
        del self._order[i]

    def move(self, index: int, kept: int) -> None:
        """Free slot ``index`` now keeps ``kept`` units (no-op when it is not free or unchanged)."""
        old = self._kept.get(index)
        if old is None or old == kept:
            return
        self.remove(index)
        self.add(index, kept)

    def lowest_empty(self) -> int | None:
        """The lowest index of a free slot that keeps no pages, or ``None``."""
        order = self._order
        return order[0][1] if order and order[0][0] == 0 else None

    def first_keeping(self, num_units: int) -> int | None:
        """The free slot keeping the fewest units among those keeping ``>= num_units`` (lowest index
        among equals), or ``None``."""
        order = self._order
        i = bisect_left(order, (num_units, -1))
        return order[i][1] if i < len(order) else None

    def in_bound_order(self, num_units: int) -> Iterator[int]:
        """Free slot indices by ascending lower bound of :func:`~vmkv.vmem.placement.pick_slot` for
        ``num_units``: those keeping ``>= num_units`` units by ascending kept count, then the others by
        descending kept count, each count's slots by index.  Lazy (the list must not change meanwhile)."""
        order = self._order
        i = bisect_left(order, (num_units, -1))
        for j in range(i, len(order)):
            yield order[j][1]
        j = i - 1
        while j >= 0:
            start = bisect_left(order, (order[j][0], -1))
            for t in range(start, j + 1):
                yield order[t][1]
            j = start - 1

    def check(self, expected: dict[int, int]) -> None:
        """Compare with ``slot index -> kept units`` of the free slots, counted by a walk."""
        if self._kept != expected:
            diff = sorted(set(self._kept.items()) ^ set(expected.items()))[:8]
            raise AssertionError(f"free-slot order differs from the slots: {diff}")
        if self._order != sorted((k, i) for i, k in expected.items()):
            raise AssertionError("free-slot order is not sorted or has stray entries")


class SlotSpace:
    """The reservations, the slots and every map/unmap of the vmem backend (module docstring).

    Torch-free: it deals in addresses and page handles; the cache makes the tensors over :attr:`bases`.

    Args:
        driver: the VMM driver (only its :class:`~vmkv.vmem.protocol.PageDriver` calls).
        layout: reservation and unit arithmetic.
        pool: physical pages; its page table is :attr:`table` and its prefix index ``prefix``.
        prefix: prefix-cache entries whose handles are pages.
    Raises:
        VMMError: a reservation failed (those made are freed first).
    """

    def __init__(self, driver: PageDriver, layout: VMemLayout, pool: PagePool, prefix: PrefixIndex) -> None:
        self.driver, self.layout, self.pool, self.prefix = driver, layout, pool, prefix
        assert pool.prefix is prefix, "the page pool and the slots must share one prefix index"
        self.num_res = layout.num_reservations
        self.bases: list[int] = []
        try:
            for _ in range(self.num_res):
                self.bases.append(driver.reserve(layout.reservation_bytes))
        except Exception:
            for va in self.bases:
                driver.free_reservation(va, layout.reservation_bytes)
            raise
        self.slots = [Slot(i) for i in range(layout.max_num_seqs)]
        self.free_slots = FreeSlotIndex(len(self.slots))
        self.table = pool.table
        self.pending: set[int] = set()       # sources of copies planned but not yet made
        self.tick = 0
        self._parked: set[int] = set()
        self.num_parked_pages = 0            # pages whose only claim is a parked slot's
        # per page: batch wall time / pages in the batch; per batch: wall time and page count
        self.map_us: collections.deque = collections.deque(maxlen=_MAX_SAMPLES)
        self.map_batch_us: collections.deque = collections.deque(maxlen=_MAX_SAMPLES)
        self.pages_per_batch: collections.deque = collections.deque(maxlen=_MAX_SAMPLES)
        self.unmap_us: collections.deque = collections.deque(maxlen=_MAX_SAMPLES)
        self.num_maps = self.num_unmaps = self.num_fence_waits = 0
        self.num_map_batches = self.num_set_access_calls = 0
        self.num_parks = self.num_adoptions = 0
        # reclamation (reclaim.py): kept pages unmapped to make room, prefix units dropped, pages
        # released to the driver, creations out of memory answered by idle pages
        self.num_reclaimed_pages = self.num_prefix_evictions = 0
        self.num_released_pages = self.num_reused_on_oom = 0
        self.num_prefetched_pages = 0        # mapped unclaimed ahead of need (mapper.py, prefetch)

    # ------------------------------------------------------------------ queries
    def va(self, res: int, slot: int, unit: int) -> int:
        return self.bases[res] + self.layout.unit_offset(slot, unit)

    @staticmethod
    def is_claimed(slot: Slot, unit: int) -> bool:
        return slot.seq_id is not None and unit < slot.claimed

    def unshared(self, slot: Slot) -> bool:
        """O(1): is every page mapped in ``slot`` mapped there only, and does no page of the pool hold
        a prefix-cache unit?  Then every kept page of the slot is reused in place by a new occupant,
        and the walks over it reduce to counting (:meth:`mapped_below`)."""
        return slot.index not in self.table.shared_positions and not len(self.prefix)

    def mapped_below(self, slot: Slot, num_units: int) -> int:
        """Pages mapped in units ``[0, num_units)`` of ``slot`` (O(1) when no unit lies above)."""
        if slot.units_end <= num_units:
            return slot.num_mapped
        num_res = self.num_res
        return sum(num_res - pages.count(None) for u, pages in slot.units.items() if u < num_units)

    @staticmethod
    def pages_of(slot: Slot, start: int, end: int) -> list[int]:
        """The pages mapped in units ``[start, end)`` of ``slot``."""
        get = slot.units.get
        if end - start == 1:            # a decode step's page boundary
            return [p for p in get(start, ()) if p is not None]
        return [p for p in chain.from_iterable(map(get, range(start, end), repeat(()))) if p is not None]

    def num_allocated_pages(self) -> int:
        """Pages a live sequence claims."""
        return self.table.num_claimed_pages - self.num_parked_pages

    def num_idle_pages(self) -> int:
        """Created pages no live sequence claims (free, cached free, kept)."""
        return self.pool.num_created - self.num_allocated_pages()

    def num_mapped_pages(self) -> int:
        return self.table.num_mapped_pages

    def num_reclaimable_pages(self) -> int:
        """Mapped pages no live sequence claims (kept pages, parked slots' included)."""
        return len(self.table.reclaimable) + self.num_parked_pages

    def refcount(self, page: int) -> int:
        return self.pool.refcount(page)

    def available_pages(self) -> int:
        """Pages an operation could obtain: pool pages + reclaimable kept pages (parked slots' too)."""
        return self.pool.num_available + len(self.table.reclaimable) + self.num_parked_pages

    # ------------------------------------------------------------------ occupancy and claims
    def set_occupant(self, slot: Slot, seq_id: int | None) -> None:
        """Give ``slot`` to ``seq_id``, or free it (``None``), keeping :attr:`free_slots` current."""
        if seq_id is None:
            slot.seq_id = None
            self.free_slots.add(slot.index, len(slot.units))
        else:
            slot.seq_id = seq_id
            self.free_slots.remove(slot.index)

    def set_claimed(self, slot: Slot, claimed: int) -> None:
        """Move ``slot.claimed``, updating the claim counts of the pages entering or leaving."""
        old = slot.claimed
        if claimed == old:
            return
        step, (start, end) = (1, (old, claimed)) if claimed > old else (-1, (claimed, old))
        self.table.claim_pages(self.pages_of(slot, start, end), step, self.tick)
        slot.claimed = claimed

    def park(self, slot: Slot) -> bool:
        """Park live ``slot`` as it is freed when nothing can tell (module docstring); returns
        whether it did (else the caller releases the claims now)."""
        if not slot.claimed or not self.unshared(slot):
            return False
        self._parked.add(slot.index)
        self.num_parked_pages += slot.claimed * self.num_res     # claimed units are fully mapped
        self.num_parks += 1
        return True

    def is_parked(self, slot: Slot) -> bool:
        return slot.index in self._parked

    num_parked_slots = property(lambda self: len(self._parked))

    def adopt(self, slot: Slot, num_units: int) -> None:
        """Free ``slot`` goes to a sequence claiming ``num_units``: a parked slot's claims below
        ``num_units`` become the occupant's, those above are released with the slot's vacate tick."""
        if slot.index not in self._parked:
            return
        self._parked.remove(slot.index)
        self.num_parked_pages -= slot.claimed * self.num_res
        self.num_adoptions += 1
        if slot.claimed > num_units:
            self.table.claim_pages(self.pages_of(slot, num_units, slot.claimed), -1, slot.free_tick)
            slot.claimed = num_units

    def unpark_all(self) -> None:
        """Make every parked slot's release real, as vacate would have made it (before a walk over
        reclaimable pages)."""
        for index in sorted(self._parked):
            slot = self.slots[index]
            self._parked.remove(index)
            self.num_parked_pages -= slot.claimed * self.num_res
            self.table.claim_pages(self.pages_of(slot, 0, slot.claimed), -1, slot.free_tick)
            slot.claimed = 0

    # ------------------------------------------------------------------ fences
    def wait_slot(self, slot: Slot) -> None:
        """Wait for the fence of ``slot`` (recorded at free time) before unmapping its kept pages."""
        if slot.fence is not None:
            if not self.driver.fence_done(slot.fence):
                self.num_fence_waits += 1
                self.driver.wait_fence(slot.fence)
            slot.fence = None

    def sync(self) -> None:
        """Wait for all queued work (before unmapping a claimed page kernels may read)."""
        fence = self.driver.record_fence()
        if fence is not None:
            self.num_fence_waits += 1
            self.driver.wait_fence(fence)

    def fence_pending(self, page: int) -> bool:
        """Is the fence of a slot ``page`` is mapped in still pending (checked without waiting)?"""
        for s in self.table.slots_of(page):
            fence = self.slots[s].fence
            if fence is not None and not self.driver.fence_done(fence):
                return True
        return False

    # ------------------------------------------------------------------ map and unmap
    def _access_runs(self, targets: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """``(va, nbytes)`` of the maximal runs of adjacent pages among ``targets`` (``(res, va)``)."""
        page_bytes = self.layout.page_size_bytes
        if len(targets) == 1:
            return [(targets[0][1], page_bytes)]
        runs: list[list[int]] = []      # [va, nbytes]
        last_res = end = None
        for res, va in sorted(targets):
            if res == last_res and va == end:
                runs[-1][1] += page_bytes
            else:
                runs.append([va, page_bytes])
                last_res = res
            end = va + page_bytes
        return [(va, nbytes) for va, nbytes in runs]

    def map_batch(self, slot: Slot, items: Sequence[tuple[int, int, int]]) -> None:
        """Map ``(unit, res, page)`` items into ``slot``: every page without access, then one
        ``set_access`` per run of adjacent pages.  If a driver call fails, the pages mapped by this
        batch are unmapped again and the error propagates (the caller still owns the pages)."""
        if not items:
            return
        entries, units, bases = self.table.entries, slot.units, self.bases
        num_kept = len(units)
        row, page_bytes = self.layout.unit_offset(slot.index, 0), self.layout.page_size_bytes
        targets = []                    # (res, va) per item
        none = (None,) * self.num_res
        for unit, res, page in items:
            # a shared page sits at one (reservation, unit) in every slot (prefix hits are verified
            # down to their chain position, so a hit's unit is its depth)
            e = entries.get(page)
            assert e is None or e.pos is None or e.pos == (res, unit), \
                f"page {page} is at {e.pos}, cannot map at {(res, unit)}"
            assert units.get(unit, none)[res] is None, f"slot {slot.index} unit {unit} res {res} is mapped"
            targets.append((res, bases[res] + row + unit * page_bytes))
        drv = self.driver
        done: list[int] = []
        t0 = time.perf_counter_ns()
        try:
            for (_, va), (_, _, page) in zip(targets, items):
                drv.map(va, page, set_access=False)
                done.append(va)
            for va, nbytes in self._access_runs(targets):
                self.num_set_access_calls += 1
                drv.set_access(va, nbytes)
        except BaseException:
            for va in reversed(done):
                try:
                    drv.unmap(va)
                except Exception:  # noqa: BLE001 - keep the original error; the driver state is logged
                    logger.exception("unmapping %#x after a failed map batch failed", va)
            raise
        batch_us = (time.perf_counter_ns() - t0) / 1e3
        n = len(items)
        self.map_batch_us.append(batch_us)
        self.pages_per_batch.append(n)
        self.map_us.extend([batch_us / n] * n)
        self.num_maps += n
        self.num_map_batches += 1
        slot.num_mapped += n
        end = slot.units_end
        for unit, res, page in items:
            pages = units.get(unit)
            if pages is None:
                pages = units[unit] = [None] * self.num_res
                if unit >= end:
                    end = unit + 1
            pages[res] = page
        slot.units_end = end
        if len(units) != num_kept:
            self.free_slots.move(slot.index, len(units))     # a no-op unless the slot is free
        self.table.add_mappings(items, slot.index, 0 if slot.seq_id is None else slot.claimed, self.tick)

    def unmap(self, slot: Slot, unit: int, res: int) -> int:
        """Unmap the page at ``(unit, res)`` of ``slot`` (the caller waited for the fence); the page goes
        back to the pool when it is mapped nowhere else.  Returns the page."""
        pages = slot.units[unit]
        page = pages[res]
        assert page is not None, f"slot {slot.index} unit {unit} res {res} is not mapped"
        t0 = time.perf_counter_ns()
        self.driver.unmap(self.va(res, slot.index, unit))
        self.unmap_us.append((time.perf_counter_ns() - t0) / 1e3)
        self.num_unmaps += 1
        pages[res] = None
        slot.num_mapped -= 1
        slot.mapped_to = min(slot.mapped_to, unit)
        if all(p is None for p in pages):
            units = slot.units
            del units[unit]
            if unit + 1 == slot.units_end:      # the top unit went: down to the next kept one
                end = unit
                while end and end - 1 not in units:
                    end -= 1
                slot.units_end = end
            self.free_slots.move(slot.index, len(units))
        if self.table.remove_mapping(page, slot.index, self.is_claimed(slot, unit)) == 0:
            self.pool.unmapped(page)          # back to the pool: cached free if it has an entry
        return page

    def unmap_everywhere(self, page: int) -> None:
        """Unmap reclaimable ``page`` from every slot it is mapped in (after each slot's fence)."""
        res, unit = self.table.position(page)
        for s in sorted(self.table.slots_of(page)):
            slot = self.slots[s]
            self.wait_slot(slot)
            self.unmap(slot, unit, res)

    def close(self) -> None:
        """Unmap everything (after all queued work), release the pages and the reservations."""
        self.sync()
        self.unpark_all()
        self.prefix.clear()
        for slot in self.slots:
            self.set_claimed(slot, 0)
            slot.seq_id = None
            for u in sorted(slot.units):
                for r in range(self.num_res):
                    if slot.page(u, r) is not None:
                        self.unmap(slot, u, r)
        self.free_slots = FreeSlotIndex(len(self.slots))
        self.pool.close()
        for va in self.bases:
            self.driver.free_reservation(va, self.layout.reservation_bytes)
        self.bases = []
