"""Slot mapper: which physical page is mapped at each (slot, unit, reservation), and the policies
that change it (vAttention, Prabhu et al., ASPLOS'25, sections 5-6; DESIGN.md "vmem backend").

Vocabulary: a **unit** is the group of pages at one page index of a slot row, one per reservation.
A live slot **claims** its units ``[0, claimed)``: they back the sequence (and any look-ahead), are
fully mapped and are never reclaimed.  Everything else that is mapped is **kept**: the pages of
freed slots (deferred reclamation: a new request that takes the slot reuses them without any map
call) and the units of a live slot beyond ``claimed``.  A page is **reclaimable** when none of its
mappings is claimed; reclaiming unmaps all its mappings (after the fence each slot recorded at
free time has completed: unmapping memory a kernel still reads is fatal on CUDA) and returns it to
the pool.

Prefix-cached pages (a unit registered in the verified prefix index) outlive their mappings: an
unmapped cached page stays **cached free** in the pool, and a later hit maps it again.  A kept
cached page that a new occupant (or growth) of its slot would overwrite is moved out (unmapped,
still cached) while plain pages can replace it.  When the pool runs short, pages are taken in this
order (as the paged block pool does): plain pool pages, kept pages without a prefix entry, then
the least recently used cached pages (kept or cached free), whose entries are dropped (eviction).

Pages are mapped in **batches**: every operation that maps several pages of a slot at once (occupy,
grow, share, look-ahead, prefetch) maps them without access and then grants access with one
``set_access`` per maximal run of adjacent pages (same reservation, consecutive units), because on
CUDA one cuMemSetAccess over a run costs about what one over a single page costs.

Every public operation that needs pages comes with a ``plan_*`` method that counts the pages it will
take and the pages it may use, without changing anything, so the cache can refuse with
``KVCacheFullError`` and leave all state unchanged.  Operations claim what they keep before they
acquire fresh pages, so reclamation never takes a page the operation is about to use.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Iterable, Sequence

from vmkv.kvcache.prefix import PrefixIndex
from vmkv.vmem.driver import VMMDriver
from vmkv.vmem.layout import VMemLayout
from vmkv.vmem.page_pool import PagePool, PagePoolExhaustedError

__all__ = ["SlotMapper", "Slot"]

logger = logging.getLogger(__name__)

_MAX_SAMPLES = 100_000


class Slot:
    """One row of the reservations.  ``units[u][r]``: page mapped at unit ``u`` of reservation ``r``."""

    __slots__ = ("index", "units", "seq_id", "claimed", "fence", "free_tick")

    def __init__(self, index: int) -> None:
        self.index = index
        self.units: dict[int, list[int | None]] = {}
        self.seq_id: int | None = None
        self.claimed = 0
        self.fence: object = None
        self.free_tick = 0

    @property
    def is_free(self) -> bool:
        return self.seq_id is None

    def page(self, unit: int, res: int) -> int | None:
        pages = self.units.get(unit)
        return None if pages is None else pages[res]


def _percentile(samples: Iterable[float], q: float) -> float:
    data = sorted(samples)
    if not data:
        return 0.0
    return data[min(len(data) - 1, int(q / 100.0 * len(data)))]


class SlotMapper:
    """Owns the reservations, the slots and every map/unmap of the vmem backend.

    Args:
        driver: the VMM driver.
        layout: reservation and unit arithmetic.
        pool: physical pages (reference count = number of mappings); its prefix index is ``prefix``.
        prefix: prefix-cache entries, handles are pages (dropped when a page is evicted or
            overwritten).
    """

    def __init__(self, driver: VMMDriver, layout: VMemLayout, pool: PagePool, prefix: PrefixIndex) -> None:
        self.driver, self.layout, self.pool, self.prefix = driver, layout, pool, prefix
        assert pool.prefix is prefix, "the page pool and the mapper must share one prefix index"
        self.num_res = layout.num_reservations
        self.bases: list[int] = []
        try:
            for _ in range(self.num_res):
                self.bases.append(driver.reserve(layout.reservation_bytes))
            self.base_tensors = [driver.as_tensor(b, layout.reservation_bytes) for b in self.bases]
        except Exception:
            for va in self.bases:
                driver.free_reservation(va, layout.reservation_bytes)
            raise
        self.slots = [Slot(i) for i in range(layout.max_num_seqs)]
        self._pos: dict[int, tuple[int, int]] = {}   # page -> (reservation, unit): fixed while mapped
        self._where: dict[int, set[int]] = {}        # page -> slots it is mapped in
        self._live: dict[int, int] = {}              # page -> claimed mappings
        # page -> tick it was last unclaimed or mapped (kept for unmapped pages too: cached free
        # pages are evicted by it; at most one entry per created page)
        self._last_use: dict[int, int] = {}
        self._reclaimable: set[int] = set()
        self._pending: set[int] = set()      # sources of copies planned but not yet made
        self._tick = 0
        # per page: batch wall time / pages in the batch; per batch: wall time and page count
        self.map_us: collections.deque = collections.deque(maxlen=_MAX_SAMPLES)
        self.map_batch_us: collections.deque = collections.deque(maxlen=_MAX_SAMPLES)
        self.pages_per_batch: collections.deque = collections.deque(maxlen=_MAX_SAMPLES)
        self.unmap_us: collections.deque = collections.deque(maxlen=_MAX_SAMPLES)
        self.num_maps = self.num_unmaps = self.num_reclaimed_pages = 0
        self.num_fence_waits = self.num_map_batches = self.num_set_access_calls = 0
        self.num_prefetched_pages = 0
        self.num_prefix_evictions = 0

    # ------------------------------------------------------------------ primitives
    def va(self, res: int, slot: int, unit: int) -> int:
        return self.bases[res] + self.layout.unit_offset(slot, unit)

    @staticmethod
    def _is_claimed(slot: Slot, unit: int) -> bool:
        return slot.seq_id is not None and unit < slot.claimed

    def _update(self, page: int) -> None:
        if self._live[page] == 0:
            self._reclaimable.add(page)
        else:
            self._reclaimable.discard(page)

    def _access_runs(self, slot: Slot, items: Sequence[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """``(va, nbytes)`` of the maximal runs of adjacent pages among ``items`` (``(unit, res,
        page)`` of ``slot``): same reservation, consecutive units."""
        page_bytes = self.layout.page_size_bytes
        runs: list[list[int]] = []      # [res, va, nbytes]
        for res, va in sorted((r, self.va(r, slot.index, u)) for u, r, _ in items):
            last = runs[-1] if runs else None
            if last is not None and last[0] == res and last[1] + last[2] == va:
                last[2] += page_bytes
            else:
                runs.append([res, va, page_bytes])
        return [(va, nbytes) for _, va, nbytes in runs]

    def _map_batch(self, slot: Slot, items: Sequence[tuple[int, int, int]]) -> None:
        """Map ``(unit, res, page)`` items into ``slot``: every page without access, then one
        ``set_access`` per run of adjacent pages.  If a driver call fails, the pages mapped by this
        batch are unmapped again and the error propagates (bookkeeping untouched: the caller still
        owns the pages)."""
        if not items:
            return
        for unit, res, page in items:
            # internal invariant: a shared page sits at one (reservation, unit) in every slot (prefix
            # hits are verified down to their chain position, so a hit's unit is its depth)
            pos = self._pos.get(page)
            assert pos is None or pos == (res, unit), f"page {page} is at {pos}, cannot map at {(res, unit)}"
            assert slot.page(unit, res) is None, f"slot {slot.index} unit {unit} res {res} is mapped"
        drv = self.driver
        done: list[int] = []
        t0 = time.perf_counter_ns()
        try:
            for unit, res, page in items:
                va = self.va(res, slot.index, unit)
                drv.map(va, page, set_access=False)
                done.append(va)
            for va, nbytes in self._access_runs(slot, items):
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
        for unit, res, page in items:
            self.pool.incref(page)
            pages = slot.units.get(unit)
            if pages is None:
                pages = slot.units[unit] = [None] * self.num_res
            pages[res] = page
            self._pos[page] = (res, unit)
            self._where.setdefault(page, set()).add(slot.index)
            self._live[page] = self._live.get(page, 0) + self._is_claimed(slot, unit)
            self._last_use[page] = self._tick
            self._update(page)

    def _unmap(self, slot: Slot, unit: int, res: int) -> int:
        pages = slot.units[unit]
        page = pages[res]
        assert page is not None, f"slot {slot.index} unit {unit} res {res} is not mapped"
        t0 = time.perf_counter_ns()
        self.driver.unmap(self.va(res, slot.index, unit))
        self.unmap_us.append((time.perf_counter_ns() - t0) / 1e3)
        self.num_unmaps += 1
        pages[res] = None
        if all(p is None for p in pages):
            del slot.units[unit]
        self._where[page].discard(slot.index)
        self._live[page] -= self._is_claimed(slot, unit)
        if self.pool.decref(page) == 0:       # back to the pool: cached free if it has an entry
            for table in (self._pos, self._where, self._live):
                del table[page]
            self._reclaimable.discard(page)
        else:
            self._update(page)
        return page

    def _set_claimed(self, slot: Slot, claimed: int) -> None:
        """Move ``slot.claimed``, updating the live counts of the pages entering or leaving."""
        old = slot.claimed
        step, units = (1, range(old, claimed)) if claimed > old else (-1, range(claimed, old))
        for u in units:
            for p in slot.units.get(u, ()):
                if p is not None:
                    self._live[p] += step
                    if step < 0:
                        self._last_use[p] = self._tick
                    self._update(p)
        slot.claimed = claimed

    def _wait_slot(self, slot: Slot) -> None:
        """Wait for the fence of ``slot`` (recorded at free time) before unmapping its kept pages."""
        if slot.fence is not None:
            if not self.driver.fence_done(slot.fence):
                self.num_fence_waits += 1
                self.driver.wait_fence(slot.fence)
            slot.fence = None

    def _sync(self) -> None:
        """Wait for all queued work (before unmapping a claimed page kernels may read)."""
        fence = self.driver.record_fence()
        if fence is not None:
            self.num_fence_waits += 1
            self.driver.wait_fence(fence)

    def _needs_fresh(self, page: int | None) -> bool:
        return page is None or self.pool.refcount(page) > 1

    def _is_cached_kept(self, page: int | None) -> bool:
        """A page mapped only here that holds a prefix-cache unit (moved out before an overwrite)."""
        return page is not None and self.pool.refcount(page) == 1 and self.prefix.is_cached(page)

    def _forget(self, page: int) -> None:
        """Drop the prefix entry of ``page`` (and of its descendants): its content is about to
        change or it is evicted."""
        self.pool.forget(page)

    # ------------------------------------------------------------------ capacity
    def available_pages(self) -> int:
        """Pages an operation could obtain: pool pages + reclaimable kept pages."""
        return self.pool.num_available + len(self._reclaimable)

    def _eviction_order(self, candidates: Iterable[int]) -> list[int]:
        """Pages without a prefix entry first, then least recently used; among pages used at the
        same tick, the deepest prefix unit first (a chain is evicted from its tail, as the paged
        backend frees a sequence's blocks tail first)."""
        def key(p: int):
            entry = self.prefix.entry_of(p)
            return (entry is not None, self._last_use[p], -entry.depth if entry else 0, p)
        return sorted(candidates, key=key)

    def reclaim(self, num_pages: int, exclude: frozenset = frozenset()) -> int:
        """Make ``num_pages`` more pool pages plain available: unmap reclaimable kept pages without
        a prefix entry, then evict the least recently used cached pages (cached free pool pages,
        or reclaimable kept ones, unmapped); never a page in ``exclude``.  Returns the number of
        pages made available."""
        start = self.pool.num_plain_available
        target = start + num_pages
        reclaimed = evicted = 0
        for page in self._eviction_order((self._reclaimable | self.pool.cached_pages()) - exclude):
            if self.pool.num_plain_available >= target:
                break
            if self.pool.is_cached_free(page):
                self.pool.evict(page)
                evicted += 1
            elif page in self._reclaimable:
                if self.prefix.is_cached(page):
                    self._forget(page)
                    evicted += 1
                res, unit = self._pos[page]
                for s in sorted(self._where[page]):
                    slot = self.slots[s]
                    self._wait_slot(slot)
                    self._unmap(slot, unit, res)
                reclaimed += 1
            # else: an eviction above dropped its entry and made it plain free already
        self.num_reclaimed_pages += reclaimed
        self.num_prefix_evictions += evicted
        if reclaimed or evicted:
            logger.debug("reclaimed %d kept pages, evicted %d cached prefix units", reclaimed, evicted)
        return self.pool.num_plain_available - start

    def _ensure_pool(self, num_pages: int, exclude: frozenset = frozenset()) -> None:
        short = num_pages - self.pool.num_plain_available
        if short > 0:
            self.reclaim(short, exclude)
        if self.pool.num_plain_available < num_pages:
            raise PagePoolExhaustedError(
                f"needed {num_pages} pages, {self.pool.num_plain_available} available after "
                f"reclaiming (plan/execute mismatch)")

    def _move_out_cached(self, slot: Slot, units: Sequence[int], exclude: frozenset = frozenset()) -> None:
        """Units ``units`` of ``slot`` are about to be claimed and overwritten (shared pages already
        unmapped).  Their kept pages that hold a prefix-cache unit move out: unmapped, they stay
        cached free in the pool and fresh pages take their place.  But when the pool would have to
        evict cached pages anyway, those of them that are least recently used are overwritten in
        place (evicted here: no unmap, no map).  ``exclude``: prefix-hit pages being mapped."""
        cached = [(u, r, p) for u in units for r, p in enumerate(slot.units.get(u, ()))
                  if self._is_cached_kept(p)]
        if not cached:
            return
        staying = {p for u in units for p in slot.units.get(u, ()) if p is not None}
        holes = sum(1 for u in units for r in range(self.num_res) if slot.page(u, r) is None)
        need = holes + len(cached)
        others = self._reclaimable - exclude - staying
        plain = self.pool.num_plain_available + sum(1 for p in others if not self.prefix.is_cached(p))
        if need > plain:
            candidates = (others | self.pool.cached_pages() | {p for *_, p in cached}) - exclude
            order = self._eviction_order(p for p in candidates if self.prefix.is_cached(p))
            victims = set(order[:need - plain])
            for *_, p in cached:
                if p in victims and self.prefix.is_cached(p):
                    self._forget(p)
                    self.num_prefix_evictions += 1
        for u, r, p in cached:
            if self.prefix.is_cached(p):
                self._wait_slot(slot)
                self._unmap(slot, u, r)

    def _fill_holes(self, slot: Slot, units: Iterable[int], given=None) -> int:
        """Map every hole of ``units`` of ``slot`` in one batch: ``given(unit, res)`` (a prefix-hit or
        parent page, mapped or cached free) where it returns a page, else a fresh pool page
        (reclaiming kept pages, never a given one, if the pool is short).  Returns the number of
        pages mapped."""
        items: list[tuple[int, int, int | None]] = []
        for u in units:
            for r in range(self.num_res):
                if slot.page(u, r) is None:
                    items.append((u, r, None if given is None else given(u, r)))
        if not items:
            return 0
        num_fresh = sum(1 for *_, p in items if p is None)
        # cached free hits leave the pool first, so that reclaiming cannot evict them
        acquired = [p for *_, p in items if p is not None and self.pool.is_cached_free(p)]
        for p in acquired:
            self.pool.revive(p)
        try:
            if num_fresh:
                self._ensure_pool(num_fresh, frozenset(p for *_, p in items if p is not None))
            for i, (u, r, p) in enumerate(items):
                if p is None:
                    p = self.pool.acquire()
                    acquired.append(p)
                    items[i] = (u, r, p)
            self._map_batch(slot, items)
        except BaseException:
            for p in acquired:
                self.pool.give_back(p)
            raise
        return len(items)

    # ------------------------------------------------------------------ occupy (allocate)
    def plan_occupy(self, slot: Slot, num_units: int, hits: Sequence[Sequence[int]]) -> tuple[int, int]:
        """``(fresh pages needed, pages available)`` for :meth:`occupy`."""
        fresh, leaving = 0, set()
        for u in range(num_units):
            for r in range(self.num_res):
                cur = slot.page(u, r)
                if u < len(hits):
                    hit = hits[u][r]
                    if hit in self._reclaimable or self.pool.is_cached_free(hit):
                        leaving.add(hit)            # becomes claimed
                elif self._needs_fresh(cur):
                    fresh += 1                      # a hole, or a shared kept page to replace
                else:
                    leaving.add(cur)                # kept page reused in place
        return fresh, self.available_pages() - len(leaving)

    def occupy(self, slot: Slot, seq_id: int, num_units: int, hits: Sequence[Sequence[int]]) -> None:
        """Give free ``slot`` to ``seq_id`` with units ``[0, num_units)`` claimed: units
        ``[0, len(hits))`` map the prefix-hit pages, the rest reuse the slot's kept unshared pages
        without a prefix entry or get fresh ones (kept cached pages move out, see
        :meth:`_move_out_cached`)."""
        assert slot.is_free, f"slot {slot.index} is live"
        slot.seq_id = seq_id
        for u in range(num_units):
            for r in range(self.num_res):
                cur = slot.page(u, r)
                if cur is None:
                    continue
                keep = cur == hits[u][r] if u < len(hits) else self.pool.refcount(cur) == 1
                if not keep:
                    self._wait_slot(slot)
                    self._unmap(slot, u, r)
        self._move_out_cached(slot, range(len(hits), num_units),
                              frozenset(p for pages in hits for p in pages))
        self._set_claimed(slot, num_units)
        try:
            # hit pages and fresh pages in one batch: adjacent units share one set_access
            self._fill_holes(slot, range(num_units), lambda u, r: hits[u][r] if u < len(hits) else None)
        except BaseException:
            self._set_claimed(slot, 0)      # the slot stays free; what got mapped is kept
            slot.seq_id = None
            raise

    # ------------------------------------------------------------------ grow (extend)
    def plan_grow(self, slot: Slot, num_units: int, cow_units: Iterable[int]) -> tuple[int, int]:
        """``(fresh pages needed, pages available)`` for :meth:`grow`."""
        fresh = leaving = 0
        for u in range(slot.claimed, num_units):
            for r in range(self.num_res):
                if self._needs_fresh(slot.page(u, r)):
                    fresh += 1
                else:
                    leaving += 1
        cow_units = [u for u in cow_units if u < slot.claimed]
        fresh += self.plan_writable(slot, cow_units, range(self.num_res))
        return fresh, self.available_pages() - leaving

    def _claim_units(self, slot: Slot, old: int, end: int) -> None:
        """Claim units ``[old, end)`` of ``slot``: kept pages shared with other slots are unmapped
        (after the slot's fence), kept cached pages move out (:meth:`_move_out_cached`), other kept
        pages are reused, holes get fresh pages in one batch; on failure the claim is undone."""
        for u in range(old, end):
            for r in range(self.num_res):
                cur = slot.page(u, r)
                if cur is not None and self.pool.refcount(cur) > 1:
                    self._wait_slot(slot)
                    self._unmap(slot, u, r)
        self._move_out_cached(slot, range(old, end))
        self._set_claimed(slot, end)
        try:
            self._fill_holes(slot, range(old, end))
        except BaseException:
            self._set_claimed(slot, old)
            raise

    def grow(self, slot: Slot, num_units: int, cow_units: Iterable[int],
             copy_below_bytes: int) -> list[tuple]:
        """Claim units up to ``num_units`` (reusing kept unshared pages), then copy-on-write the
        shared pages of ``cow_units`` (pages holding bytes below ``copy_below_bytes`` of the slot
        row are copied, others just replaced).  Returns the copies to make (:meth:`make_writable`)."""
        old = slot.claimed
        cow_units = [u for u in cow_units if u < old]
        if num_units > old:
            self._claim_units(slot, old, num_units)
        page_bytes = self.layout.page_size_bytes
        pairs = []
        for u in cow_units:
            pairs += self.make_writable(slot, [u], range(self.num_res), copy=u * page_bytes < copy_below_bytes)
        return pairs

    # ------------------------------------------------------------------ copy-on-write
    def any_shared(self, slot: Slot, units: Iterable[int]) -> bool:
        """Does any mapped page of ``units`` of ``slot`` have a reference count above 1?"""
        refcount = self.pool.refcount
        for u in units:
            for p in slot.units.get(u, ()):
                if p is not None and refcount(p) > 1:
                    return True
        return False

    def plan_writable(self, slot: Slot, units: Iterable[int], reservations: Iterable[int]) -> int:
        """Fresh pages :meth:`make_writable` needs: the shared pages among ``units`` x ``reservations``."""
        reservations = tuple(reservations)
        return sum(1 for u in units for r in reservations
                   if (p := slot.page(u, r)) is not None and self.pool.refcount(p) > 1)

    def make_writable(self, slot: Slot, units: Iterable[int], reservations: Iterable[int],
                      copy: bool = True) -> list[tuple]:
        """Before writing into claimed ``units``: give every shared page a private copy
        (copy-on-write) and drop the prefix entry of unshared pages (their content changes).

        Returns:
            ``(src_va, dst_va, src_slot, unit)`` of each page whose bytes the caller must copy (in
            reverse order, after the whole batch: a later copy may remap an earlier source), then
            pass to :meth:`copied`.  Sources stay mapped until then (:attr:`_pending`).
        """
        reservations = tuple(reservations)
        pairs = []
        for u in units:
            for r in reservations:
                page = slot.page(u, r)
                if page is None:
                    continue
                if self.pool.refcount(page) > 1:
                    pair = self._cow(slot, u, r)
                    if copy:
                        pairs.append(pair)
                        self._pending.add(page)
                else:
                    self._forget(page)
        return pairs

    def copied(self, pairs: Sequence[tuple]) -> None:
        """The bytes of ``pairs`` (from :meth:`make_writable`) are copied: a source mapping that is
        not claimed may be reclaimed later, after a fence recorded now."""
        self._pending.clear()
        fence = None
        for *_, src, unit in pairs:
            if not self._is_claimed(src, unit):
                fence = self.driver.record_fence() if fence is None else fence
                src.fence = fence

    def _cow(self, slot: Slot, unit: int, res: int) -> tuple:
        old = slot.page(unit, res)
        src = self.slots[min(self._where[old] - {slot.index})]
        self._ensure_pool(1, frozenset(self._pending | {old}))
        new = self.pool.acquire()
        if self._is_claimed(slot, unit):
            self._sync()        # kernels of earlier steps may still read this slot's page
        else:
            self._wait_slot(slot)
        self._unmap(slot, unit, res)
        try:
            self._map_batch(slot, [(unit, res, new)])
        except BaseException:
            self.pool.give_back(new)
            raise
        return self.va(res, src.index, unit), self.va(res, slot.index, unit), src, unit

    # ------------------------------------------------------------------ fork, free, look-ahead
    def share(self, child: Slot, parent: Slot, seq_id: int, num_units: int) -> None:
        """Give free ``child`` to ``seq_id``, mapping the parent's pages of units ``[0, num_units)``."""
        assert child.is_free, f"slot {child.index} is live"
        child.seq_id = seq_id
        for u in range(num_units):
            for r in range(self.num_res):
                cur = child.page(u, r)
                if cur is not None and cur != parent.page(u, r):
                    self._wait_slot(child)
                    self._unmap(child, u, r)
        self._set_claimed(child, num_units)
        try:
            self._fill_holes(child, range(num_units), parent.page)
        except BaseException:
            self._set_claimed(child, 0)
            child.seq_id = None
            raise

    def vacate(self, slot: Slot) -> None:
        """Free a live slot; its pages stay mapped (kept) behind a fence recorded now."""
        self._tick += 1
        self._set_claimed(slot, 0)
        slot.seq_id = None
        slot.fence = self.driver.record_fence()
        slot.free_tick = self._tick

    def map_ahead(self, slot: Slot, num_units: int) -> None:
        """Best effort: claim units up to ``num_units`` from kept pages or plain pool pages (no
        reclaiming, no eviction); the holes of all those units are mapped in one batch."""
        old = slot.claimed
        budget = self.pool.num_plain_available
        end = old
        for u in range(old, min(num_units, self.layout.pages_per_slot)):
            need = sum(1 for r in range(self.num_res)
                       if self._needs_fresh(p := slot.page(u, r)) or self._is_cached_kept(p))
            if need > budget:
                break
            budget -= need
            end = u + 1
        if end == old:
            return
        self._claim_units(slot, old, end)

    def prefetch(self, slot: Slot, num_units: int) -> int:
        """Best effort, off the critical path: map the holes of units ``[claimed, num_units)`` of live
        ``slot`` from free pool pages, in one batch, **without claiming them**.

        The pages stay kept (reclaimable, so they count as available for admission); the grow that
        later claims those units reuses them without a driver call.  Never reclaims, never waits
        for a fence; stops at the first unit holding a shared page or not fitting in the pool.

        Returns:
            The number of pages mapped.
        """
        assert not slot.is_free, f"slot {slot.index} is free"
        budget = self.pool.num_plain_available
        end = slot.claimed
        for u in range(slot.claimed, min(num_units, self.layout.pages_per_slot)):
            pages = slot.units.get(u, ())
            if any(p is not None and self.pool.refcount(p) > 1 for p in pages):
                break
            holes = self.num_res - sum(1 for p in pages if p is not None)
            if holes > budget:
                break
            budget -= holes
            end = u + 1
        mapped = self._fill_holes(slot, range(slot.claimed, end))
        self.num_prefetched_pages += mapped
        return mapped

    # ------------------------------------------------------------------ introspection
    def refcount(self, page: int) -> int:
        return self.pool.refcount(page)

    def num_mapped_pages(self) -> int:
        return len(self._pos)

    def stats(self) -> dict:
        return {
            "num_maps": self.num_maps,
            "num_unmaps": self.num_unmaps,
            "map_us_p50": _percentile(self.map_us, 50),
            "map_us_p99": _percentile(self.map_us, 99),
            "num_map_batches": self.num_map_batches,
            "num_set_access_calls": self.num_set_access_calls,
            "map_batch_us_p50": _percentile(self.map_batch_us, 50),
            "map_batch_us_p99": _percentile(self.map_batch_us, 99),
            "pages_per_batch_mean": (sum(self.pages_per_batch) / len(self.pages_per_batch)
                                     if self.pages_per_batch else 0.0),
            "pages_per_batch_max": max(self.pages_per_batch, default=0),
            "num_prefetched_pages": self.num_prefetched_pages,
            "unmap_us_p50": _percentile(self.unmap_us, 50),
            "unmap_us_p99": _percentile(self.unmap_us, 99),
            "num_reclaimed_pages": self.num_reclaimed_pages,
            "num_prefix_evictions": self.num_prefix_evictions,
            "num_cached_free_pages": len(self.pool.cached_pages()),
            "num_fence_waits": self.num_fence_waits,
            "num_pages_created": self.pool.num_created,
        }

    def check_integrity(self) -> None:
        refs: dict[int, int] = collections.Counter()
        live: dict[int, int] = collections.Counter()
        where: dict[int, set] = collections.defaultdict(set)
        for slot in self.slots:
            if slot.is_free and slot.claimed:
                raise AssertionError(f"free slot {slot.index} claims {slot.claimed} units")
            for u in range(slot.claimed):
                if any(p is None for p in slot.units.get(u, [None])):
                    raise AssertionError(f"slot {slot.index} claims unit {u} but it is not fully mapped")
            for u, pages in slot.units.items():
                if all(p is None for p in pages):
                    raise AssertionError(f"slot {slot.index} keeps an empty unit {u}")
                for r, p in enumerate(pages):
                    if p is None:
                        continue
                    if self._pos.get(p) != (r, u):
                        raise AssertionError(f"page {p} at slot {slot.index} ({r}, {u}) recorded at "
                                             f"{self._pos.get(p)}")
                    refs[p] += 1
                    live[p] += self._is_claimed(slot, u)
                    where[p].add(slot.index)
                    if self.driver.mapped_handle(self.va(r, slot.index, u)) != p:
                        raise AssertionError(f"driver maps {self.driver.mapped_handle(self.va(r, slot.index, u))}"
                                             f" at slot {slot.index} ({r}, {u}), expected {p}")
        if set(refs) != set(self._pos):
            raise AssertionError(f"{len(refs)} pages mapped, {len(self._pos)} recorded")
        for p, n in refs.items():
            if self.pool.refcount(p) != n or self._live[p] != live[p] or self._where[p] != where[p]:
                raise AssertionError(f"page {p}: refcount {self.pool.refcount(p)} vs {n} mappings, "
                                     f"live {self._live[p]} vs {live[p]}")
        expected = {p for p in refs if live[p] == 0}
        if expected != self._reclaimable:
            raise AssertionError(f"reclaimable set has {len(self._reclaimable)} pages, expected "
                                 f"{len(expected)}")
        if self.driver.num_pending_access:
            raise AssertionError(f"{self.driver.num_pending_access} mapped pages have no access set")
        if sum(refs.values()) != self.driver.num_mappings:
            raise AssertionError(f"{sum(refs.values())} mappings recorded, driver has "
                                 f"{self.driver.num_mappings}")
        if self.pool.num_in_use != len(refs):
            raise AssertionError(f"pool has {self.pool.num_in_use} pages in use, {len(refs)} mapped")
        stray = self.prefix.handles() - set(refs) - self.pool.cached_pages()
        if stray:
            raise AssertionError(f"prefix entries name {len(stray)} pages neither mapped nor cached free")
        for p in refs:
            entry = self.prefix.entry_of(p)
            if entry is not None and (entry.depth, entry.handles.index(p)) != self._pos[p][::-1]:
                raise AssertionError(f"page {p} mapped at (reservation, unit) {self._pos[p]} caches "
                                     f"unit {entry.depth}, reservation {entry.handles.index(p)}")
        missing = (self.pool.cached_pages() | set(refs)) - self._last_use.keys()
        if missing:
            raise AssertionError(f"pages {sorted(missing)} have no last-use tick")
        self.pool.check_integrity()
        self.prefix.check_integrity()

    def close(self) -> None:
        """Unmap everything (after all queued work), release the pages and the reservations."""
        self._sync()
        self.prefix.clear()
        for slot in self.slots:
            slot.claimed = 0
            slot.seq_id = None
            for u in sorted(slot.units):
                for r in range(self.num_res):
                    if slot.page(u, r) is not None:
                        self._unmap(slot, u, r)
        self.base_tensors = []
        self.pool.close()
        for va in self.bases:
            self.driver.free_reservation(va, self.layout.reservation_bytes)
        self.bases = []
