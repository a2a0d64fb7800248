"""The slot mapper: the operations that change what is mapped in a slot, namely occupy (allocate),
grow (extend), copy-on-write, share (fork), vacate (free), look-ahead and prefetch (torch-free;
vAttention, Prabhu et al., ASPLOS'25, sections 5-6; the terms: ``docs/kvcache.md``, "Concepts").

Every operation that needs pages comes with a ``plan_*`` method that counts the pages it will take and
the pages it may use, without changing anything, so the cache can refuse with ``KVCacheFullError`` and
leave all state unchanged.  Operations claim what they keep before they acquire fresh pages, so
reclamation (``reclaim.py``) never takes a page the operation is about to use.

Prefix-cached pages outlive their mappings: an unmapped cached page stays **cached free** in the pool
and a later hit maps it again.  A kept cached page that a new occupant (or growth) of its slot would
overwrite is moved out (unmapped, still cached) while plain pages can replace it
(:meth:`SlotMapper._move_out_cached`).  The first write into a page mapped in several slots copies it
(copy-on-write, :meth:`SlotMapper.make_writable`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

from vmkv.vmem.checks import check_mapper, mapper_stats
from vmkv.vmem.page_pool import creation_out_of_memory
from vmkv.vmem.protocol import VMMError
from vmkv.vmem.reclaim import Reclaimer
from vmkv.vmem.slots import Slot, SlotSpace

if TYPE_CHECKING:
    from vmkv.kvcache.prefix import PrefixIndex
    from vmkv.vmem.layout import VMemLayout
    from vmkv.vmem.page_pool import PagePool
    from vmkv.vmem.protocol import PageDriver

__all__ = ["SlotMapper", "Slot"]


class SlotMapper(SlotSpace):
    """The allocation operations over the slots of :class:`~vmkv.vmem.slots.SlotSpace` (its arguments);
    idle pages are taken and released by :attr:`reclaimer` (:class:`~vmkv.vmem.reclaim.Reclaimer`)."""

    def __init__(self, driver: PageDriver, layout: VMemLayout, pool: PagePool, prefix: PrefixIndex) -> None:
        super().__init__(driver, layout, pool, prefix)
        self.reclaimer = Reclaimer(self)

    def reclaim(self, num_pages: int, exclude: frozenset = frozenset(), wait: bool = True) -> int:
        """:meth:`Reclaimer.reclaim`: make ``num_pages`` more pool pages plain available."""
        return self.reclaimer.reclaim(num_pages, exclude, wait)

    def stats(self) -> dict:
        """:func:`~vmkv.vmem.checks.mapper_stats`."""
        return mapper_stats(self)

    def check_integrity(self) -> None:
        """:func:`~vmkv.vmem.checks.check_mapper`: raises AssertionError naming the numbers."""
        check_mapper(self)

    # ------------------------------------------------------------------ page questions
    def _needs_fresh(self, page: int | None) -> bool:
        return page is None or self.pool.refcount(page) > 1

    def _is_cached_kept(self, page: int | None) -> bool:
        """A page mapped only here that holds a prefix-cache unit (moved out before an overwrite)."""
        return page is not None and self.pool.refcount(page) == 1 and self.prefix.is_cached(page)

    def any_shared(self, slot: Slot, units: Iterable[int]) -> bool:
        """Does any mapped page of ``units`` of ``slot`` have a reference count above 1?  (O(1) when no
        page of the slot is mapped in another slot: every decode step asks it of every sequence.)"""
        if slot.index not in self.table.shared_positions:
            return False
        refcount = self.pool.refcount
        return any(p is not None and refcount(p) > 1 for u in units for p in slot.units.get(u, ()))

    def shared_pages(self, slot: Slot, units: Iterable[int], reservations: Iterable[int]) -> list[int]:
        """The pages among ``units`` x ``reservations`` of ``slot`` mapped in another slot too (those
        :meth:`make_writable` copies); O(1) for a slot that shares no page."""
        if slot.index not in self.table.shared_positions:
            return []
        reservations = tuple(reservations)
        return [p for u in units for r in reservations
                if (p := slot.page(u, r)) is not None and self.pool.refcount(p) > 1]

    def plan_writable(self, slot: Slot, units: Iterable[int], reservations: Iterable[int]) -> int:
        """Fresh pages :meth:`make_writable` needs: the shared pages among ``units`` x ``reservations``."""
        return len(self.shared_pages(slot, units, reservations))

    # ------------------------------------------------------------------ filling holes
    def _move_out_cached(self, slot: Slot, units: Sequence[int], exclude: frozenset = frozenset()) -> None:
        """Units ``units`` of ``slot`` are about to be claimed and overwritten (shared pages already
        unmapped).  Their kept pages that hold a prefix-cache unit move out: unmapped, they stay cached
        free in the pool and fresh pages take their place.  But when the pool would have to evict cached
        pages anyway, those of them that are least recently used are overwritten in place (evicted here:
        no unmap, no map).  ``exclude``: prefix-hit pages being mapped."""
        if not len(self.prefix):
            return                          # no page holds a prefix-cache unit
        get, entries, is_cached = slot.units.get, self.table.entries, self.prefix.is_cached
        cached = [(u, r, p) for u in units for r, p in enumerate(get(u, ()))
                  if p is not None and is_cached(p) and len(entries[p].slots) == 1]
        if not cached:
            return
        staying = {p for u in units for p in slot.units.get(u, ()) if p is not None}
        holes = sum(1 for u in units for r in range(self.num_res) if slot.page(u, r) is None)
        need = holes + len(cached)
        others = self.table.reclaimable - exclude - staying
        plain = (self.pool.num_plain_available + self.num_parked_pages
                 + sum(1 for p in others if not is_cached(p)))
        if need > plain:
            candidates = (others | self.pool.cached_pages() | {p for *_, p in cached}) - exclude
            order = self.reclaimer.eviction_order(p for p in candidates if is_cached(p))
            victims = set(order[:need - plain])
            for *_, p in cached:
                if p in victims and is_cached(p):
                    self.pool.forget(p)
                    self.num_prefix_evictions += 1
        for u, r, p in cached:
            if is_cached(p):
                self.wait_slot(slot)
                self.unmap(slot, u, r)

    def _fill_holes(self, slot: Slot, units: Iterable[int], given=None, reuse: bool = True,
                    protect: frozenset = frozenset()) -> int:
        """Map every hole of ``units`` of ``slot`` in one batch: ``given(unit, res)`` (a prefix-hit or
        parent page, mapped or cached free) where it returns a page, else a fresh page (reclaiming kept
        pages, never a given one or one in ``protect``, if the pool is short or, with ``reuse``, if page
        creation runs out of memory).  Returns the number of pages mapped."""
        get, res = slot.units.get, range(self.num_res)
        holes = [(u, r) for u in units if (pages := get(u)) is None or None in pages
                 for r in res if pages is None or pages[r] is None]
        if not holes:
            return 0
        if given is None:
            items: list = [(u, r, None) for u, r in holes]
            num_fresh, acquired, exclude = len(items), [], protect
        else:
            items = [(u, r, given(u, r)) for u, r in holes]
            num_fresh = sum(1 for *_, p in items if p is None)
            # cached free hits leave the pool first, so that reclaiming cannot evict them
            acquired = [p for *_, p in items if p is not None and self.pool.is_cached_free(p)]
            for p in acquired:
                self.pool.revive(p)
            exclude = frozenset(p for *_, p in items if p is not None) | protect
        try:
            if num_fresh:
                self.reclaimer.ensure_pool(num_fresh, exclude)
                fresh = iter(self._fresh_pages(num_fresh, exclude, reuse, acquired))
                items = [(u, r, next(fresh) if p is None else p) for u, r, p in items]
            self.map_batch(slot, items)
        except BaseException:
            self.pool.give_back_many(acquired)
            raise
        return len(items)

    def _fresh_pages(self, num: int, exclude: frozenset, reuse: bool, acquired: list) -> list[int]:
        """``num`` fresh pages (the pool holds that many plain available), appended to ``acquired``:
        plain free pages first, in one go, then created (or, with ``reuse``, idle pages on out of
        memory), in the order they are taken."""
        fresh = self.pool.take_free(num)
        acquired += fresh
        while len(fresh) < num:
            p = self.reclaimer.acquire(exclude, num - len(fresh)) if reuse else self.pool.acquire()
            fresh.append(p)
            acquired.append(p)
        return fresh

    # ------------------------------------------------------------------ occupy (allocate)
    def plan_occupy(self, slot: Slot, num_units: int, hits: Sequence[Sequence[int]]) -> tuple[int, int]:
        """``(fresh pages needed, pages available)`` for :meth:`occupy`."""
        if not hits and self.unshared(slot):    # every kept page below num_units is reused in place
            kept = self.mapped_below(slot, num_units)
            return num_units * self.num_res - kept, self.available_pages() - kept
        reclaimable, is_cached_free = self.table.reclaimable, self.pool.is_cached_free
        leaving = {hit for u in range(min(len(hits), num_units)) for hit in hits[u]
                   if hit in reclaimable or is_cached_free(hit)}       # become claimed
        fresh, kept = self._fresh_and_kept(slot, len(hits), num_units)
        return fresh, self.available_pages() - len(leaving) - kept

    def _fresh_and_kept(self, slot: Slot, start: int, end: int) -> tuple[int, int]:
        """Of units ``[start, end)`` of ``slot``: the positions that need a fresh page (a hole, or a kept
        page shared with another slot, replaced) and the kept pages mapped here only (reused in place)."""
        fresh = kept = 0
        get, entries = slot.units.get, self.table.entries
        for u in range(start, end):
            pages = get(u)
            if pages is None:
                fresh += self.num_res
                continue
            for p in pages:
                if p is None or len(entries[p].slots) > 1:
                    fresh += 1
                else:
                    kept += 1
        return fresh, kept

    def occupy(self, slot: Slot, seq_id: int, num_units: int, hits: Sequence[Sequence[int]]) -> None:
        """Give free ``slot`` to ``seq_id`` with units ``[0, num_units)`` claimed: units
        ``[0, len(hits))`` map the prefix-hit pages, the rest reuse the slot's kept unshared pages
        without a prefix entry or get fresh ones (kept cached pages move out).  On failure the slot
        stays free."""
        assert slot.is_free, f"slot {slot.index} is live"
        self.set_occupant(slot, seq_id)
        self.adopt(slot, num_units)         # a parked slot's claims become this sequence's
        # no hit, no page of the slot shared, none cached: every kept page stays, nothing moves out
        fast = not hits and self.unshared(slot)
        if not fast:
            get, entries = slot.units.get, self.table.entries
            for u in range(num_units):
                for r, cur in enumerate(get(u, ())):
                    if cur is None:
                        continue
                    keep = cur == hits[u][r] if u < len(hits) else len(entries[cur].slots) == 1
                    if not keep:
                        self.wait_slot(slot)
                        self.unmap(slot, u, r)
            self._move_out_cached(slot, range(len(hits), num_units),
                                  frozenset(p for pages in hits for p in pages))
        self.set_claimed(slot, num_units)
        if fast and self.mapped_below(slot, num_units) == num_units * self.num_res:
            return                          # a warm admission: the kept pages back it all
        try:
            # hit pages and fresh pages in one batch: adjacent units share one set_access
            self._fill_holes(slot, range(num_units), lambda u, r: hits[u][r] if u < len(hits) else None)
        except BaseException:
            self.set_claimed(slot, 0)       # the slot stays free; what got mapped is kept
            self.set_occupant(slot, None)
            raise

    # ------------------------------------------------------------------ grow (extend)
    def plan_grow(self, slot: Slot, num_units: int, cow_units: Iterable[int]) -> tuple[int, int]:
        """``(fresh pages needed, pages available)`` for :meth:`grow`."""
        cow_units = [u for u in cow_units if u < slot.claimed]
        cow = self.plan_writable(slot, cow_units, range(self.num_res)) if cow_units else 0
        fresh, kept = self._fresh_and_kept(slot, slot.claimed, num_units)
        return fresh + cow, self.available_pages() - kept

    def _claim_units(self, slot: Slot, old: int, end: int, reuse: bool = True) -> None:
        """Claim units ``[old, end)`` of ``slot``: kept pages shared with other slots are unmapped
        (after the slot's fence), kept cached pages move out, other kept pages are reused, holes get
        fresh pages in one batch; on failure the claim is undone."""
        get, entries = slot.units.get, self.table.entries
        for u in range(old, end):
            for r, cur in enumerate(get(u, ())):
                if cur is not None and len(entries[cur].slots) > 1:
                    self.wait_slot(slot)
                    self.unmap(slot, u, r)
        self._move_out_cached(slot, range(old, end))
        self.set_claimed(slot, end)
        try:
            self._fill_holes(slot, range(old, end), reuse=reuse)
        except BaseException:
            self.set_claimed(slot, old)
            raise

    def grow(self, slot: Slot, num_units: int, cow_units: Iterable[int], copy_below_bytes: int) -> list[tuple]:
        """Claim units up to ``num_units`` (reusing kept unshared pages), then copy-on-write the shared
        pages of ``cow_units`` (pages holding bytes below ``copy_below_bytes`` of the slot row are
        copied, others just replaced).  Returns the copies to make (:meth:`make_writable`)."""
        old = slot.claimed
        cow_units = [u for u in cow_units if u < old]
        fresh: list[int] = []
        if cow_units:       # the copies' pages first, all or none (a creation out of memory)
            kept = frozenset(p for u in range(old, num_units) for p in slot.units.get(u, ()) if p is not None)
            fresh = self.acquire_for_cow([(slot, cow_units)], range(self.num_res), kept)
        try:
            if num_units > old:
                self._claim_units(slot, old, num_units)
            page_bytes = self.layout.page_size_bytes
            pairs = []
            for u in cow_units:
                pairs += self.make_writable(slot, [u], range(self.num_res),
                                            copy=u * page_bytes < copy_below_bytes, fresh=fresh)
        finally:
            self.give_back_fresh(fresh)
        return pairs

    # ------------------------------------------------------------------ copy-on-write
    def make_writable(self, slot: Slot, units: Iterable[int], reservations: Iterable[int],
                      copy: bool = True, fresh: list[int] | None = None) -> list[tuple]:
        """Before writing into claimed ``units``: give every shared page a private copy (copy-on-write)
        and drop the prefix entry of unshared pages (their content changes).

        Returns:
            ``(src_va, dst_va, src_slot, unit)`` of each page whose bytes the caller must copy (in
            reverse order, after the whole batch: a later copy may remap an earlier source), then pass
            to :meth:`copied`.  Sources stay mapped until then (:attr:`pending`).  ``fresh``: pages of
            :meth:`acquire_for_cow` to take the copies' pages from (the caller gives back what is
            left); default: acquired here, all before any page is replaced.
        """
        reservations, units = tuple(reservations), tuple(units)
        own = fresh is None
        if own:
            fresh = self.acquire_for_cow([(slot, units)], reservations)
        pairs = []
        try:
            for u in units:
                for r in reservations:
                    page = slot.page(u, r)
                    if page is None:
                        continue
                    if self.pool.refcount(page) > 1:
                        pair = self._cow(slot, u, r, fresh.pop())
                        if copy:
                            pairs.append(pair)
                            self.pending.add(page)
                    else:
                        self.pool.forget(page)
        finally:
            if own:
                self.give_back_fresh(fresh)
        return pairs

    def acquire_for_cow(self, targets: Sequence[tuple], reservations: Iterable[int],
                        exclude: frozenset = frozenset()) -> list[int]:
        """The fresh pages :meth:`make_writable` of each ``(slot, units)`` of ``targets`` needs, all
        acquired before any page is replaced, so that a creation out of memory refuses with nothing
        changed (a page replaced and its copy never made would lose the sequence's K/V).  All or none.
        ``exclude``: pages the reclaiming must leave alone (besides the shared pages themselves)."""
        reservations = tuple(reservations)
        shared = [p for slot, units in targets for p in self.shared_pages(slot, units, reservations)]
        if not shared:
            return []
        exclude = frozenset(exclude | set(shared) | self.pending)
        pages: list[int] = []
        try:
            for _ in shared:
                self.reclaimer.ensure_pool(1, exclude)
                pages.append(self.reclaimer.acquire(exclude))
        except BaseException:
            self.give_back_fresh(pages)
            raise
        return pages

    def give_back_fresh(self, pages: list[int]) -> None:
        """Return the unused pages of :meth:`acquire_for_cow` to the pool (the list is emptied)."""
        while pages:
            self.pool.give_back(pages.pop())

    def copied(self, pairs: Sequence[tuple]) -> None:
        """The bytes of ``pairs`` (from :meth:`make_writable`) are copied: a source mapping that is not
        claimed may be reclaimed later, after a fence recorded now."""
        self.pending.clear()
        fence = None
        for *_, src, unit in pairs:
            if not self.is_claimed(src, unit):
                fence = self.driver.record_fence() if fence is None else fence
                src.fence = fence

    def _cow(self, slot: Slot, unit: int, res: int, new: int) -> tuple:
        """Replace the shared page at ``(unit, res)`` of ``slot`` with ``new`` (acquired, unmapped)."""
        old = slot.page(unit, res)
        src = self.slots[min(self.table.slots_of(old) - {slot.index})]
        if self.is_claimed(slot, unit):
            self.sync()         # kernels of earlier steps may still read this slot's page
        else:
            self.wait_slot(slot)
        self.unmap(slot, unit, res)
        try:
            self.map_batch(slot, [(unit, res, new)])
        except BaseException:
            self.pool.give_back(new)
            raise
        return self.va(res, src.index, unit), self.va(res, slot.index, unit), src, unit

    # ------------------------------------------------------------------ fork, free, look-ahead
    def share(self, child: Slot, parent: Slot, seq_id: int, num_units: int) -> None:
        """Give free ``child`` to ``seq_id``, mapping the parent's pages of units ``[0, num_units)``."""
        assert child.is_free, f"slot {child.index} is live"
        self.set_occupant(child, seq_id)
        self.adopt(child, num_units)
        for u in range(num_units):
            for r in range(self.num_res):
                cur = child.page(u, r)
                if cur is not None and cur != parent.page(u, r):
                    self.wait_slot(child)
                    self.unmap(child, u, r)
        self.set_claimed(child, num_units)
        try:
            self._fill_holes(child, range(num_units), parent.page)
        except BaseException:
            self.set_claimed(child, 0)
            self.set_occupant(child, None)
            raise

    def vacate(self, slot: Slot) -> None:
        """Free a live slot; its pages stay mapped (kept) behind a fence recorded now, and its claims
        are released now or, when nothing could tell the difference, lazily (parked: ``slots.py``)."""
        self.tick += 1
        if not self.park(slot):
            self.set_claimed(slot, 0)
        self.set_occupant(slot, None)
        slot.fence = self.driver.record_fence()
        slot.free_tick = self.tick

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
        try:
            self._claim_units(slot, old, end, reuse=False)     # no reuse on out of memory
        except VMMError as e:       # a creation out of memory ends it quietly (the claim is undone)
            if not creation_out_of_memory(self.driver, e):
                raise

    def prefetch(self, slot: Slot, num_units: int, hits: Sequence[Sequence[int]] = ()) -> int:
        """Best effort, off the critical path: map the holes of units ``[claimed, num_units)`` of
        ``slot`` (live, or free: an admission expected soon, from unit 0) from free pool pages, in one
        batch, **without claiming them**; on a free slot, ``hits`` (prefix-hit pages per unit, from
        unit 0) fill the holes of the first units instead.  The pages stay kept (reclaimable); the grow
        that later claims those units reuses them without a driver call.  Never reclaims, never waits
        for a fence; stops at the first unit holding a shared page or not fitting in the pool.

        Returns:
            The number of pages mapped.
        """
        mapped = 0
        if hits:                          # a free slot: its prefix-hit pages first, where it has holes
            assert slot.is_free, f"slot {slot.index} is live"
            mapped = self._fill_holes(slot, range(len(hits)), given=lambda u, r: hits[u][r], reuse=False)
        start = max(0 if slot.seq_id is None else slot.claimed, len(hits))     # a parked slot: from 0
        if num_units <= max(slot.mapped_to, start) and not mapped:
            return 0                      # mapped by an earlier prefetch (no unmap since)
        budget = self.pool.num_plain_available
        end = start
        for u in range(start, min(num_units, self.layout.pages_per_slot)):
            pages = slot.units.get(u, ())
            if any(p is not None and self.pool.refcount(p) > 1 for p in pages):
                break
            holes = self.num_res - sum(1 for p in pages if p is not None)
            if holes > budget:
                break
            budget -= holes
            end = u + 1
        mapped += self._fill_holes(slot, range(start, end), reuse=False)
        if all(u in slot.units and None not in slot.units[u] for u in range(len(hits))):
            slot.mapped_to = max(slot.mapped_to, end)
        self.num_prefetched_pages += mapped
        return mapped
