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
The same order applies when creating a page fails for want of memory (another process holds it):
idle pages are reused instead (:meth:`SlotMapper._acquire`), those whose fence is pending excepted,
before the operation gives up with a transient full cache.  Idle pages are released back to the
driver only by the elastic shrink (``elastic.py``), which also creates pages up to the reserve ahead
of need.

Pages are mapped in **batches**: every operation that maps several pages of a slot at once (occupy,
grow, share, look-ahead, prefetch) maps them without access and then grants access with one
``set_access`` per maximal run of adjacent pages (same reservation, consecutive units).  On CUDA that
saves the per-call overhead only: cuMemSetAccess costs about the same for every allocation it covers
(26 us per 2 MiB page on the H200, ``driver.py``), so a mapped page costs what it costs, batched or not.

Every public operation that needs pages comes with a ``plan_*`` method that counts the pages it will
take and the pages it may use, without changing anything, so the cache can refuse with
``KVCacheFullError`` and leave all state unchanged.  Operations claim what they keep before they
acquire fresh pages, so reclamation never takes a page the operation is about to use.
"""

from __future__ import annotations

import collections
import logging
import time
from itertools import chain, repeat
from typing import TYPE_CHECKING, Iterable, Sequence

from vmkv.kvcache.prefix import PrefixIndex
from vmkv.vmem.free_slots import FreeSlotIndex
from vmkv.vmem.elastic import ElasticMixin
from vmkv.vmem.mapper_check import MapperCheckMixin
from vmkv.vmem.page_pool import PagePool, PagePoolExhaustedError, creation_out_of_memory
from vmkv.vmem.parking import ParkingMixin
from vmkv.vmem.protocol import VMMError
from vmkv.vmem.slot_ops import SlotOpsMixin

if TYPE_CHECKING:
    from vmkv.vmem.layout import VMemLayout
    from vmkv.vmem.protocol import PageDriver

__all__ = ["SlotMapper", "Slot"]

logger = logging.getLogger(__name__)

_MAX_SAMPLES = 100_000


class Slot:
    """One row of the reservations.  ``units[u][r]``: page mapped at unit ``u`` of reservation ``r``;
    ``mapped_to``: units ``[0, mapped_to)`` are known fully mapped (set by prefetch, lowered by every
    unmap), so a prefetch that asks for no more returns at once; ``num_mapped``: pages mapped in the
    slot (positions, kept by every map and unmap), and ``units_end``: one past the highest unit in
    ``units`` (0 when empty, kept by every map and unmap), so an operation over a slot whose units all
    lie below its range knows the holes without walking them (:meth:`SlotMapper.mapped_below`)."""

    __slots__ = ("index", "units", "seq_id", "claimed", "fence", "free_tick", "mapped_to", "num_mapped",
                 "units_end")

    def __init__(self, index: int) -> None:
        self.index = index
        self.units: dict[int, list[int | None]] = {}
        self.seq_id: int | None = None
        self.claimed = 0
        self.fence: object = None
        self.free_tick = 0
        self.mapped_to = 0
        self.num_mapped = 0
        self.units_end = 0

    @property
    def is_free(self) -> bool:
        return self.seq_id is None

    def page(self, unit: int, res: int) -> int | None:
        pages = self.units.get(unit)
        return None if pages is None else pages[res]


class SlotMapper(SlotOpsMixin, ElasticMixin, ParkingMixin, MapperCheckMixin):
    """Owns the reservations, the slots and every map/unmap of the vmem backend: the primitives and
    reclamation here, the operations in :class:`~vmkv.vmem.slot_ops.SlotOpsMixin`, the release of
    idle pages in :class:`~vmkv.vmem.elastic.ElasticMixin`, freed slots' claims released lazily in
    :class:`~vmkv.vmem.parking.ParkingMixin`, statistics and checks in
    :class:`~vmkv.vmem.mapper_check.MapperCheckMixin`.

    Torch-free: it deals in addresses and page handles; the cache makes the tensors over
    :attr:`bases`.

    Args:
        driver: the VMM driver (only its :class:`~vmkv.vmem.protocol.PageDriver` calls).
        layout: reservation and unit arithmetic.
        pool: physical pages (reference count = number of mappings); its prefix index is ``prefix``.
        prefix: prefix-cache entries, handles are pages (dropped when a page is evicted or
            overwritten).
    """

    def __init__(self, driver: PageDriver, layout: VMemLayout, pool: PagePool, prefix: PrefixIndex) -> None:
        self.driver, self.layout, self.pool, self.prefix = driver, layout, pool, prefix
        assert pool.prefix is prefix, "the page pool and the mapper must share one prefix index"
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
        self.free_slots = FreeSlotIndex(len(self.slots))    # free slots by kept units (free_slots.py)
        self.table = pool.table          # the one page table (page_table.py)
        self._pending: set[int] = set()      # sources of copies planned but not yet made
        self._tick = 0
        self._init_parking()
        # per page: batch wall time / pages in the batch; per batch: wall time and page count
        self.map_us: collections.deque = collections.deque(maxlen=_MAX_SAMPLES)
        self.map_batch_us: collections.deque = collections.deque(maxlen=_MAX_SAMPLES)
        self.pages_per_batch: collections.deque = collections.deque(maxlen=_MAX_SAMPLES)
        self.unmap_us: collections.deque = collections.deque(maxlen=_MAX_SAMPLES)
        self.num_maps = self.num_unmaps = self.num_reclaimed_pages = 0
        self.num_fence_waits = self.num_map_batches = self.num_set_access_calls = 0
        self.num_prefetched_pages = 0
        self.num_prefix_evictions = 0
        self.num_released_pages = 0
        self.num_topped_up_pages = 0     # pages created ahead of need (elastic.py, top_up_idle)
        self.num_reused_on_oom = 0       # page creations out of memory answered by idle pages
        #: spans (page_pool.py): fresh runs of up to this many pages of one slot are created as one
        #: allocation (1: every page its own; the cache sets it from ``max_span_bytes``)
        self.max_span_pages = 1
        self._checked = callable(getattr(driver, "check_mappings", None))
        self.num_span_copies = 0         # pages copied because a span's page cannot be shared
        self.num_released_span_pages = 0

    # ------------------------------------------------------------------ primitives
    def va(self, res: int, slot: int, unit: int) -> int:
        return self.bases[res] + self.layout.unit_offset(slot, unit)

    @staticmethod
    def _is_claimed(slot: Slot, unit: int) -> bool:
        return slot.seq_id is not None and unit < slot.claimed

    def unshared(self, slot: Slot) -> bool:
        """O(1): is every page mapped in ``slot`` mapped there only (no fork or prefix hit shares one
        with another slot), and does no page of the pool hold a prefix-cache unit?  Then every kept
        page of the slot is reused in place by a new occupant, and the walks of :meth:`plan_occupy`,
        :meth:`occupy` and :func:`~vmkv.vmem.placement.pick_slot` over it reduce to counting
        (:meth:`mapped_below`)."""
        return slot.index not in self.table.shared_positions and not len(self.prefix)

    def mapped_below(self, slot: Slot, num_units: int) -> int:
        """Pages mapped in units ``[0, num_units)`` of ``slot``: a counter when none of its units lies
        at or above ``num_units`` (the common warm admission; O(1) from ``slot.units_end``), else a
        walk of its units."""
        if slot.units_end <= num_units:
            return slot.num_mapped
        num_res = self.num_res
        return sum(num_res - pages.count(None) for u, pages in slot.units.items() if u < num_units)

    def _set_occupant(self, slot: Slot, seq_id: int | None) -> None:
        """Give ``slot`` to ``seq_id``, or free it (``None``), keeping :attr:`free_slots` current."""
        if seq_id is None:
            slot.seq_id = None
            self.free_slots.add(slot.index, len(slot.units))
        else:
            slot.seq_id = seq_id
            self.free_slots.remove(slot.index)

    def _access_runs(self, targets: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """``(va, nbytes)`` of the maximal runs of adjacent pages among ``targets`` (``(res, va)`` of
        one page each): same reservation, consecutive addresses."""
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

    def _map_batch(self, slot: Slot, items: Sequence[tuple[int, int, int]]) -> None:
        """Map ``(unit, res, page)`` items into ``slot``: every page without access, then one
        ``set_access`` per run of adjacent pages.  If a driver call fails, the pages mapped by this
        batch are unmapped again and the error propagates (bookkeeping untouched: the caller still
        owns the pages)."""
        if not items:
            return
        entries, units, bases = self.table.entries, slot.units, self.bases
        num_kept = len(units)
        # unit_offset is the slot row's offset plus unit * page_size_bytes (layout.py)
        row, page_bytes = self.layout.unit_offset(slot.index, 0), self.layout.page_size_bytes
        targets = []                    # (res, va) per item
        none = (None,) * self.num_res
        for unit, res, page in items:
            # internal invariant: a shared page sits at one (reservation, unit) in every slot (prefix
            # hits are verified down to their chain position, so a hit's unit is its depth)
            e = entries.get(page)
            assert e is None or e.pos is None or e.pos == (res, unit), \
                f"page {page} is at {e.pos}, cannot map at {(res, unit)}"
            assert units.get(unit, none)[res] is None, f"slot {slot.index} unit {unit} res {res} is mapped"
            targets.append((res, bases[res] + row + unit * page_bytes))
        drv = self.driver
        span_of = self.pool.span_of
        if span_of and self._checked:       # tests (CheckedDriver): the spans' layout is verified
            self._check_spans_whole(items)
        done: list[tuple[int, int]] = []      # (va, pages) mapped by this batch
        t0 = time.perf_counter_ns()
        try:
            for (_, va), (_, _, page) in zip(targets, items):
                span = span_of.get(page) if span_of else None
                if span is None:
                    drv.map(va, page, set_access=False)
                    done.append((va, 1))
                elif page == span.pages[0]:     # a span is mapped whole from its first page
                    drv.map(va, span.handle, set_access=False, num_pages=len(span))
                    done.append((va, len(span)))
            for va, nbytes in self._access_runs(targets):
                self.num_set_access_calls += 1
                drv.set_access(va, nbytes)
        except BaseException:
            for va, n in reversed(done):
                try:
                    drv.unmap(va) if n == 1 else drv.unmap(va, num_pages=n)
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
        self.table.add_mappings(items, slot.index, 0 if slot.seq_id is None else slot.claimed, self._tick)

    def _check_spans_whole(self, items: Sequence[tuple[int, int, int]]) -> None:
        """Internal invariant: every span among ``items`` is there whole, its pages at consecutive
        units of one reservation in span order, and mapped nowhere yet (a span is mapped once)."""
        span_of, seen = self.pool.span_of, {}
        for unit, res, page in items:
            span = span_of.get(page)
            if span is not None:
                seen.setdefault(id(span), (span, []))[1].append((unit, res, page))
        for span, got in seen.values():
            u0, r0, _ = min(got)
            want = [(u0 + i, r0, p) for i, p in enumerate(span.pages)]
            assert sorted(got) == want, f"span {span.pages} mapped as {sorted(got)}, not whole in order"
            assert not self.table.refcount(span.pages[0]), f"span {span.pages} is mapped already"

    def _unmap(self, slot: Slot, unit: int, res: int) -> int:
        """Unmap the page at ``(unit, res)`` of ``slot`` (a span's page: the whole span, see
        :meth:`_unmap_span`); returns the page."""
        pages = slot.units[unit]
        page = pages[res]
        assert page is not None, f"slot {slot.index} unit {unit} res {res} is not mapped"
        span_of = self.pool.span_of
        if span_of and page in span_of:
            self._unmap_span(slot, span_of[page])
            return page
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
            if unit + 1 == slot.units_end:      # the top unit went: down to the next kept one (each
                end = unit                      # unit is passed once between two maps above it)
                while end and end - 1 not in units:
                    end -= 1
                slot.units_end = end
            self.free_slots.move(slot.index, len(units))
        if self.table.remove_mapping(page, slot.index, self._is_claimed(slot, unit)) == 0:
            self.pool.unmapped(page)          # back to the pool: cached free if it has an entry
        return page

    def _unmap_span(self, slot: Slot, span) -> None:
        """Unmap every page of ``span`` (mapped in ``slot`` only, at consecutive units) in one call and
        release it to the driver (a span lives as long as its mapping: ``page_pool.py``).  The
        caller made sure no kernel still reads it (fence) and that it may go (its claims are
        given up with it)."""
        res, u0 = self.table.position(span.pages[0])
        n = len(span)
        t0 = time.perf_counter_ns()
        self.driver.unmap(self.va(res, slot.index, u0), num_pages=n)
        self.unmap_us.extend([(time.perf_counter_ns() - t0) / 1e3 / n] * n)
        self.num_unmaps += n
        units = slot.units
        for i, page in enumerate(span.pages):
            u = u0 + i
            pages = units[u]
            assert pages[res] == page, f"span page {page} is not at unit {u} of slot {slot.index}"
            pages[res] = None
            if all(p is None for p in pages):
                del units[u]
            self.table.remove_mapping(page, slot.index, self._is_claimed(slot, u))
        slot.num_mapped -= n
        slot.mapped_to = min(slot.mapped_to, u0)
        end = slot.units_end
        while end and end - 1 not in units:
            end -= 1
        slot.units_end = end
        self.free_slots.move(slot.index, len(units))
        self.pool.release_span(span)
        self.num_released_span_pages += n

    def _claim_plan(self, slot: Slot, end: int, hits: Sequence[Sequence[int]] = (),
                    grow: bool = False, extra: int = 0) -> tuple[int, frozenset]:
        """Where a claim of units ``[.., end)`` of ``slot`` really ends, and which of the slot's kept
        spans it unmaps, so that a span is always claimed whole or not at all (it is unmapped only
        whole: ``page_pool.py``, "Spans").  A kept span that units ``[0, end)`` reach into is claimed
        on to its end when that adds at most an eighth of ``end`` and the pool has that many plain
        available pages to spare (its pages are held anyway, and the sequence grows into them);
        otherwise, and when a prefix hit replaces one of its pages (``hits``: an occupant's hit
        pages per unit), it is unmapped and released, and its units below ``end`` get fresh pages.
        Without spans: ``(end, frozenset())``.

        ``grow`` (a live sequence's growth that needs fresh pages, megacache): a sequence that
        claims at least ``PagePool.ready_span_pages`` (G) units claims the next G units at once,
        while the pool has the room and they are unmapped, so its growth takes one ready span
        (one map and one access call, no creation: ``PagePool.top_up_spans``) per G units instead
        of one page per unit; the units claimed ahead (fewer than G per sequence, as vAttention maps
        a whole page of every layer ahead) count as allocated, waste until written.  Only when the
        whole grow (its own fresh pages, ``extra`` more for its copies-on-write, and the units ahead)
        fits in the plain available pages and ready spans: claiming ahead never makes a grow that
        fits without it reclaim, or refuse it.

        Returns:
            ``(end, pages of the spans to unmap)``.
        """
        span_of = self.pool.span_of
        if not span_of or end <= 0 or (not hits and not grow and slot.units_end <= end):
            return end, frozenset()     # (nothing kept at or past end: no span reaches past it)
        doomed = self._replaced_spans(slot, hits) if hits else set()
        get, position, entries = slot.units.get, self.table.position, self.table.entries
        num_res = self.num_res
        room: list = []         # plain available pages less the claim's own fresh pages (when asked)

        def spare() -> int:
            # the claim's own fresh pages, counted once (holes, shared pages to replace, replaced
            # spans' pages) from where it starts (a live slot's claim, or past an occupant's hits),
            # and ``extra`` more (the grow's copies-on-write): what a span's tail or the units ahead
            # take must come on top of them, or the claim would be refused where it fits without
            if not room:
                need = extra
                for u in range(max(len(hits), slot.claimed if slot.seq_id is not None else 0), end):
                    pages = get(u)
                    need += num_res if pages is None else sum(
                        1 for p in pages if p is None or len(entries[p].slots) > 1 or p in doomed)
                room.append(self.pool.num_plain_available - need)
            return room[0]

        while True:
            new = end
            for p in get(end - 1, ()):
                span = span_of.get(p) if p is not None else None
                if span is None or p in doomed:
                    continue
                res, u0 = position(span.pages[0])
                tail = u0 + len(span) - end
                if tail <= 0 or self._is_claimed(slot, u0):     # a live claim holds it whole already
                    continue
                # per_layer: the units it adds may hold holes in the other reservations, which the
                # claim fills with fresh pages too
                cost = tail if num_res == 1 else tail + sum(
                    q is None for u in range(end, end + tail) for q in get(u, ()))
                if 8 * tail <= end and cost <= spare():
                    room[0] -= cost
                    new = max(new, end + tail)
                else:
                    doomed.update(span.pages)
            if new == end:
                break
            end = new
        chunk = self.pool.ready_span_pages
        if grow and chunk > 1 and slot.seq_id is not None and slot.claimed >= chunk:
            target = min(slot.claimed + chunk, self.layout.pages_per_slot)
            ahead = target - end
            if (ahead > 0 and end - 1 not in slot.units
                    and not any(u in slot.units for u in range(end, target))
                    and ahead * num_res <= spare() + self.pool.num_ready_span_pages):
                end = target
        return end, frozenset(doomed)

    def _replaced_spans(self, slot: Slot, hits: Sequence[Sequence[int]]) -> set[int]:
        """The pages of ``slot``'s kept spans of which a prefix hit of a new occupant replaces a page
        (the whole span is unmapped, so its units past the hits become holes)."""
        span_of = self.pool.span_of
        doomed: set[int] = set()
        get = slot.units.get
        for u, want in enumerate(hits):
            for r, cur in enumerate(get(u, ())):
                if cur is not None and cur not in doomed and cur in span_of and cur != want[r]:
                    doomed.update(span_of[cur].pages)
        return doomed

    def usable_hits(self, slot: Slot, num_units: int, hits: Sequence[Sequence[int]]) -> int:
        """How many leading prefix hits an admission of ``num_units`` into ``slot`` can use: all,
        unless a kept span of the slot holds some hits in place but goes (a later hit replaces
        another of its pages, or it reaches too far past ``num_units``: :meth:`_claim_plan`); a
        span goes only whole, so the hits then stop at its first unit, and the sequence computes
        the rest."""
        span_of, n = self.pool.span_of, len(hits)
        if not span_of or not n:
            return n
        position = self.table.position
        while True:
            cut = n
            for p in self._claim_plan(slot, num_units, hits[:n])[1]:
                res, u = position(p)
                if u < n and hits[u][res] == p:         # a hit in place in a span that goes
                    cut = min(cut, position(span_of[p].pages[0])[1])
            if cut == n:
                return n
            n = cut

    def _unmap_spans(self, slot: Slot, pages: Iterable[int]) -> None:
        """Unmap (after the slot's fence) and release the spans of ``pages`` still mapped in ``slot``."""
        span_of = self.pool.span_of
        for p in sorted(pages):
            span = span_of.get(p)
            if span is not None and p == span.pages[0] and slot.index in self.table.slots_of(p):
                self._wait_slot(slot)
                self._unmap_span(slot, span)

    def _set_claimed(self, slot: Slot, claimed: int) -> None:
        """Move ``slot.claimed``, updating the live counts of the pages entering or leaving."""
        old = slot.claimed
        if claimed == old:
            return                      # e.g. a parked slot adopted at its own length
        step, (start, end) = (1, (old, claimed)) if claimed > old else (-1, (claimed, old))
        self.table.claim_pages(self._pages_of(slot, start, end), step, self._tick)
        slot.claimed = claimed

    @staticmethod
    def _pages_of(slot: Slot, start: int, end: int) -> list[int]:
        """The pages mapped in units ``[start, end)`` of ``slot``."""
        get = slot.units.get
        if end - start == 1:            # a decode step's page boundary
            return [p for p in get(start, ()) if p is not None]
        return [p for p in chain.from_iterable(map(get, range(start, end), repeat(()))) if p is not None]

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
    def num_allocated_pages(self) -> int:
        """Pages a live sequence claims (the page table's count, less parked slots' pages)."""
        return self.table.num_claimed_pages - self.num_parked_pages

    def num_reclaimable_pages(self) -> int:
        """Mapped pages no live sequence claims (kept pages, parked slots' included)."""
        return len(self.table.reclaimable) + self.num_parked_pages

    def available_pages(self) -> int:
        """Pages an operation could obtain: pool pages + reclaimable kept pages (parked slots' too)."""
        return self.pool.num_available + len(self.table.reclaimable) + self.num_parked_pages

    def _eviction_order(self, candidates: Iterable[int]) -> list[int]:
        """Pages without a prefix entry first, then least recently used; among pages used at the
        same tick, the deepest prefix unit first (a chain is evicted from its tail, as the paged
        backend frees a sequence's blocks tail first), and of pages without an entry the highest
        unit first (a freed slot keeps its first units longest: they are what a later admission
        into it adopts without a map call)."""
        entries = self.table.entries

        def key(p: int):
            entry = self.prefix.entry_of(p)
            if entry is not None:
                return (True, self.table.last_use[p], -entry.depth, p)
            mapped = entries.get(p)
            return (False, self.table.last_use[p], -mapped.pos[1] if mapped is not None else 0, p)
        span_of = self.pool.span_of
        if not span_of:
            return sorted(candidates, key=key)
        # a span goes whole: it takes the place of its last page to go (a cached unit in it is
        # evicted no sooner than it would be alone)
        span_key: dict[int, tuple] = {}

        def whole(p: int):
            span = span_of.get(p)
            if span is None:
                return key(p)
            k = span_key.get(id(span))
            if k is None:
                k = span_key[id(span)] = max(key(q) for q in span.pages)
            return k
        return sorted(candidates, key=whole)

    def reclaim(self, num_pages: int, exclude: frozenset = frozenset(), wait: bool = True) -> int:
        """Make ``num_pages`` more pool pages plain available: unmap reclaimable kept pages without
        a prefix entry, then evict the least recently used cached pages (cached free pool pages,
        or reclaimable kept ones, unmapped); never a page in ``exclude``.  ``wait=False``: skip a
        kept page whose fence is pending instead of waiting for it.  Returns the number of pages
        made available."""
        if self._parked:
            self.unpark_all()             # their pages become reclaimable, as at their vacate
        start = self.pool.num_plain_available
        target = start + num_pages
        reclaimed = evicted = 0
        for page in self._eviction_order((self.table.reclaimable | self.pool.cached_pages()) - exclude):
            if self.pool.num_plain_available >= target:
                break
            if self.pool.is_cached_free(page):
                self.pool.evict(page)
                evicted += 1
            elif page in self.table.reclaimable:
                if not wait and self._fence_pending(page):
                    continue
                span = self.pool.span_of.get(page)
                if span is not None and not self._span_idle(span, exclude):
                    continue
                if self.prefix.is_cached(page):
                    self._forget(page)
                    evicted += 1
                res, unit = self.table.position(page)
                for s in sorted(self.table.slots_of(page)):
                    slot = self.slots[s]
                    self._wait_slot(slot)
                    self._unmap(slot, unit, res)
                reclaimed += 1 if span is None else len(span)
            # else: an eviction above dropped its entry and made it plain free already
        self.num_reclaimed_pages += reclaimed
        self.num_prefix_evictions += evicted
        if reclaimed or evicted:
            logger.debug("reclaimed %d kept pages, evicted %d cached prefix units", reclaimed, evicted)
        return self.pool.num_plain_available - start

    def _span_idle(self, span, exclude: frozenset = frozenset()) -> bool:
        """May ``span`` be unmapped and released now: none of its pages claimed, excluded or the
        source of a pending copy?  (Claims cover a span whole, :meth:`_claim_plan`; this is the
        check that keeps it so.)"""
        reclaimable = self.table.reclaimable
        return all(p in reclaimable and p not in exclude and p not in self._pending for p in span.pages)

    def _ensure_pool(self, num_pages: int, exclude: frozenset = frozenset()) -> None:
        self.pool.make_room(num_pages)       # ready spans first: mapped nowhere, nothing cached
        short = num_pages - self.pool.num_plain_available
        if short > 0:
            self.reclaim(short, exclude)
        if self.pool.num_plain_available < num_pages:
            raise PagePoolExhaustedError(
                f"needed {num_pages} pages, {self.pool.num_plain_available} available after "
                f"reclaiming (plan/execute mismatch)")

    def _acquire(self, exclude: frozenset = frozenset(), want: int = 1) -> int:
        """A fresh pool page (:meth:`PagePool.acquire`: plain free first, else a new one).  When the
        driver cannot create one for want of memory (held by another process), idle pages are
        reused instead: up to ``want`` made plain free in reclamation order (:meth:`reclaim`),
        never a page in ``exclude`` or a pending copy source, never one whose fence is pending.
        Raises the driver's out-of-memory error when none is left (the cache turns it into a
        transient ``KVCacheFullError``)."""
        try:
            return self.pool.acquire()
        except VMMError as e:
            if not creation_out_of_memory(self.driver, e):
                raise
            if not self.reclaim(max(1, want), exclude | self._pending, wait=False):
                raise
            self.num_reused_on_oom += 1
            logger.debug("page creation out of memory (%s): reusing idle pages", e.code)
        return self.pool.acquire()
