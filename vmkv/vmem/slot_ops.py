"""The slot mapper's operations: occupy (allocate), grow (extend), copy-on-write, share (fork),
vacate (free), look-ahead and prefetch, and the batched filling of holes they share (a mixin of
:class:`~vmkv.vmem.mapper.SlotMapper`; see its module docstring for the vocabulary)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

from vmkv.vmem.page_pool import creation_out_of_memory
from vmkv.vmem.protocol import VMMError

if TYPE_CHECKING:
    from vmkv.vmem.mapper import Slot

__all__ = ["SlotOpsMixin"]


def _runs(holes: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """``holes`` (``(unit, res)``) split into maximal runs of consecutive units of one reservation,
    each in unit order (the runs a span can back)."""
    runs: list[list[tuple[int, int]]] = []
    if all(r == 0 for _, r in holes):     # one reservation (megacache): holes come in unit order
        for h in holes:
            if runs and runs[-1][-1][0] + 1 == h[0]:
                runs[-1].append(h)
            else:
                runs.append([h])
        return runs
    last: dict[int, list] = {}
    for u, r in sorted(holes, key=lambda h: (h[1], h[0])):
        run = last.get(r)
        if run is not None and run[-1][0] + 1 == u:
            run.append((u, r))
        else:
            run = last[r] = [(u, r)]
            runs.append(run)
    return runs


class SlotOpsMixin:
    """Needs the primitives of :class:`~vmkv.vmem.mapper.SlotMapper`."""

    def _move_out_cached(self, slot: Slot, units: Sequence[int], exclude: frozenset = frozenset()) -> None:
        """Units ``units`` of ``slot`` are about to be claimed and overwritten (shared pages already
        unmapped).  Their kept pages that hold a prefix-cache unit move out: unmapped, they stay
        cached free in the pool and fresh pages take their place.  But when the pool would have to
        evict cached pages anyway, those of them that are least recently used are overwritten in
        place (evicted here: no unmap, no map).  ``exclude``: prefix-hit pages being mapped."""
        if not len(self.prefix):
            return                          # no page holds a prefix-cache unit
        get, entries, is_cached = slot.units.get, self.table.entries, self.prefix.is_cached
        cached = [(u, r, p) for u in units for r, p in enumerate(get(u, ()))
                  if p is not None and is_cached(p) and len(entries[p].slots) == 1]
        if self.pool.span_of and cached:    # a span's page cannot leave alone: overwritten in place
            for *_, p in cached:
                if p in self.pool.span_of and is_cached(p):
                    self._forget(p)
                    self.num_prefix_evictions += 1
            cached = [c for c in cached if c[2] not in self.pool.span_of]
        if not cached:
            return
        staying = {p for u in units for p in slot.units.get(u, ()) if p is not None}
        holes = sum(1 for u in units for r in range(self.num_res) if slot.page(u, r) is None)
        need = holes + len(cached)
        others = self.table.reclaimable - exclude - staying
        plain = (self.pool.num_plain_available + self.num_parked_pages
                 + sum(1 for p in others if not self.prefix.is_cached(p)))
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

    def _fill_holes(self, slot: Slot, units: Iterable[int], given=None, reuse: bool = True,
                    protect: frozenset = frozenset(), spans: bool = True) -> int:
        """Map every hole of ``units`` of ``slot`` in one batch: ``given(unit, res)`` (a prefix-hit or
        parent page, mapped or cached free) where it returns a page, else a fresh page (reclaiming
        kept pages, never a given one or one in ``protect``, if the pool is short or, with
        ``reuse``, if page creation runs out of memory).  Fresh pages at consecutive units of one
        reservation come as spans where :attr:`max_span_pages` allows (:meth:`_fresh_pages`; not
        with ``spans=False``).  Returns the number of pages mapped."""
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
                self._ensure_pool(num_fresh, exclude)
                if given is None:       # every hole is fresh: the pages come in hole order
                    fresh = self._fresh_pages(holes, exclude, reuse, acquired, spans)
                    items = [(u, r, fresh[(u, r)]) for u, r in holes]
                else:
                    fresh = self._fresh_pages([(u, r) for u, r, p in items if p is None], exclude, reuse,
                                              acquired, spans)
                    items = [(u, r, fresh.pop((u, r)) if p is None else p) for u, r, p in items]
            self._map_batch(slot, items)
        except BaseException:
            self.pool.give_back_many(acquired)
            raise
        return len(items)

    def _fresh_pages(self, holes: Sequence[tuple[int, int]], exclude: frozenset, reuse: bool,
                     acquired: list, spans: bool = True) -> dict:
        """A fresh page for each ``(unit, res)`` of ``holes`` (the pool holds enough plain available
        pages: :meth:`_ensure_pool`), appended to ``acquired`` as they are taken.  Runs of holes at
        consecutive units of one reservation get spans of up to :attr:`max_span_pages` while the
        cap leaves room to create them (one cuMemCreate, later one cuMemMap and one cuMemSetAccess
        per span); a span creation out of memory ends the spans quietly.  The rest: plain free
        pages first, in one go, then created (or, with ``reuse``, idle pages on out of memory)."""
        out: dict = {}
        pool = self.pool
        if spans and self.max_span_pages > 1 and len(holes) > 1:
            for run in _runs(holes):
                while len(run) > 1:
                    if len(run) == pool.ready_span_pages and pool.num_ready_spans:
                        pages = pool.take_ready_span()      # a grow's chunk: created ahead of need
                        acquired += pages
                        out.update(zip(run, pages))
                        break
                    n = min(len(run), self.max_span_pages, pool.max_pages - pool.num_created)
                    if n < 2:
                        break
                    try:
                        pages = pool.create_span(n)
                    except VMMError as e:
                        if not creation_out_of_memory(self.driver, e):
                            raise
                        spans = False       # out of memory: no more spans in this call
                        break
                    acquired += pages
                    out.update(zip(run[:n], pages))
                    run = run[n:]
                if not spans:
                    break
        rest = [h for h in holes if h not in out] if out else holes
        fresh = pool.take_free(len(rest))
        acquired += fresh
        while len(fresh) < len(rest):
            p = self._acquire(exclude, len(rest) - len(fresh)) if reuse else pool.acquire()
            fresh.append(p)
            acquired.append(p)
        out.update(zip(rest, fresh))
        return out

    # ------------------------------------------------------------------ occupy (allocate)
    def _copied_hits(self, slot: Slot, hits: Sequence[Sequence[int]]) -> tuple[list, frozenset]:
        """The prefix hits of an admission into ``slot`` that are pages of a span mapped in another
        slot: they cannot be mapped here (a span is mapped once), so their bytes are copied into
        fresh pages instead.  Returns ``([(unit, res, page)], the pages of their spans)`` (those
        spans stay mapped until the copies are made)."""
        span_of = self.pool.span_of
        if not span_of or not hits:
            return [], frozenset()
        copies, spans = [], {}
        for u, pages in enumerate(hits):
            for r, p in enumerate(pages):
                span = span_of.get(p)
                if span is not None and slot.index not in self.table.slots_of(p):
                    copies.append((u, r, p))
                    spans[id(span)] = span
        return copies, frozenset(p for span in spans.values() for p in span.pages)

    def plan_occupy(self, slot: Slot, num_units: int, hits: Sequence[Sequence[int]]) -> tuple[int, int]:
        """``(fresh pages needed, pages available)`` for :meth:`occupy`."""
        num_units, doomed = self._claim_plan(slot, num_units, hits)
        if not hits and self.unshared(slot):    # every kept page below num_units is reused in place
            kept = self.mapped_below(slot, num_units)
            if doomed:
                kept -= sum(1 for u in range(num_units) for p in slot.units.get(u, ()) if p in doomed)
            return num_units * self.num_res - kept, self.available_pages() - kept
        reclaimable, is_cached_free = self.table.reclaimable, self.pool.is_cached_free
        copies, protected = self._copied_hits(slot, hits)
        copied = {p for *_, p in copies}
        leaving = {hit for u in range(min(len(hits), num_units)) for hit in hits[u]
                   if (hit in reclaimable or is_cached_free(hit)) and hit not in copied}  # become claimed
        leaving |= protected & reclaimable      # copy sources: never reclaimed meanwhile
        fresh = len(copies)
        kept = 0
        get, entries = slot.units.get, self.table.entries
        for u in range(len(hits), num_units):
            pages = get(u)
            if pages is None:
                fresh += self.num_res
                continue
            for p in pages:
                if p is None or len(entries[p].slots) > 1 or p in doomed:
                    fresh += 1          # a hole, a shared kept page to replace, or a replaced span's
                else:
                    kept += 1                       # kept page reused in place (one slot: no hit)
        return fresh, self.available_pages() - len(leaving) - kept

    def occupy(self, slot: Slot, seq_id: int, num_units: int, hits: Sequence[Sequence[int]]) -> list[tuple]:
        """Give free ``slot`` to ``seq_id`` with units ``[0, num_units)`` claimed (and on to the end of
        a kept span they reach into: :meth:`_claim_plan`): units ``[0, len(hits))`` map the
        prefix-hit pages, the rest reuse the slot's kept unshared pages without a prefix entry or
        get fresh ones (kept cached pages move out, see :meth:`_move_out_cached`).  A hit that is a
        span's page in another slot gets a fresh page and a copy.

        Returns:
            The copies to make (:meth:`_copy_pairs`; empty without spans)."""
        assert slot.is_free, f"slot {slot.index} is live"
        num_units, doomed = self._claim_plan(slot, num_units, hits)
        copies, protected = self._copied_hits(slot, hits)
        if copies:                          # span pages of other slots: copied, not mapped
            hits = [list(pages) for pages in hits]
            for u, r, _ in copies:
                hits[u][r] = None
        self._set_occupant(slot, seq_id)
        self.adopt(slot, num_units)         # a parked slot's claims become this sequence's
        if doomed:
            self._unmap_spans(slot, doomed)
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
                        self._wait_slot(slot)
                        self._unmap(slot, u, r)
            self._move_out_cached(slot, range(len(hits), num_units),
                                  frozenset(p for pages in hits for p in pages))
        self._set_claimed(slot, num_units)
        if fast and self.mapped_below(slot, num_units) == num_units * self.num_res:
            return []                       # a warm admission: the kept pages back it all, no hole
        try:
            # hit pages and fresh pages in one batch: adjacent units share one set_access
            self._fill_holes(slot, range(num_units), lambda u, r: hits[u][r] if u < len(hits) else None,
                             protect=protected)
        except BaseException:
            self._set_claimed(slot, 0)      # the slot stays free; what got mapped is kept
            self._set_occupant(slot, None)
            raise
        return self._copy_pairs(slot, copies)

    def _copy_pairs(self, slot: Slot, copies: Sequence[tuple[int, int, int]]) -> list[tuple]:
        """The copies of ``copies`` (``(unit, res, source page)``, each source a span's page mapped in
        one other slot) into ``slot``'s pages at the same positions, in :meth:`make_writable`'s form
        (the caller copies them, then calls :meth:`copied`)."""
        pairs = []
        for u, r, p in copies:
            (s,) = self.table.slots_of(p)
            src = self.slots[s]
            pairs.append((self.va(r, s, u), self.va(r, slot.index, u), src, u))
            self._pending.add(p)
        self.num_span_copies += len(pairs)
        return pairs

    # ------------------------------------------------------------------ grow (extend)
    def plan_grow(self, slot: Slot, num_units: int, cow_units: Iterable[int]) -> tuple[int, int]:
        """``(fresh pages needed, pages available)`` for :meth:`grow`."""
        cow_units = [u for u in cow_units if u < slot.claimed]
        cow = self.plan_writable(slot, cow_units, range(self.num_res)) if cow_units else 0
        num_units, doomed = self._claim_plan(slot, num_units, grow=num_units > slot.claimed, extra=cow)
        fresh = leaving = 0
        get, entries = slot.units.get, self.table.entries
        for u in range(slot.claimed, num_units):
            pages = get(u)
            if pages is None:
                fresh += self.num_res
                continue
            for p in pages:
                if p is None or len(entries[p].slots) > 1 or p in doomed:
                    fresh += 1
                else:
                    leaving += 1
        return fresh + cow, self.available_pages() - leaving

    def _claim_units(self, slot: Slot, old: int, end: int, reuse: bool = True,
                     plan: tuple[int, frozenset] | None = None) -> None:
        """Claim units ``[old, end)`` of ``slot``: kept pages shared with other slots are unmapped
        (after the slot's fence), kept cached pages move out (:meth:`_move_out_cached`), other kept
        pages are reused, holes get fresh pages in one batch; on failure the claim is undone.
        ``end`` moves on to the end of a kept span it reaches into, or that span goes
        (:meth:`_claim_plan`; ``plan``: its result, taken before the caller changed the pool)."""
        end, doomed = self._claim_plan(slot, end) if plan is None else plan
        if doomed:
            self._unmap_spans(slot, doomed)
        get, entries = slot.units.get, self.table.entries
        for u in range(old, end):
            for r, cur in enumerate(get(u, ())):
                if cur is not None and len(entries[cur].slots) > 1:
                    self._wait_slot(slot)
                    self._unmap(slot, u, r)
        self._move_out_cached(slot, range(old, end))
        self._set_claimed(slot, end)
        try:
            self._fill_holes(slot, range(old, end), reuse=reuse)
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
        cow = self.plan_writable(slot, cow_units, range(self.num_res)) if cow_units else 0
        # before the copies' pages leave the pool (plan_grow's state)
        num_units, doomed = self._claim_plan(slot, num_units, grow=num_units > slot.claimed, extra=cow)
        if doomed:                  # first: the copies may take their memory (plan_grow counts it so)
            self._unmap_spans(slot, doomed)
        plan = (num_units, frozenset())
        fresh: list[int] = []
        if cow_units:       # the copies' pages first, all or none (a creation out of memory)
            kept = frozenset(p for u in range(old, num_units) for p in slot.units.get(u, ()) if p is not None)
            fresh = self.acquire_for_cow([(slot, cow_units)], range(self.num_res), kept)
        try:
            if num_units > old:
                self._claim_units(slot, old, num_units, plan=plan)
            page_bytes = self.layout.page_size_bytes
            pairs = []
            for u in cow_units:
                pairs += self.make_writable(slot, [u], range(self.num_res),
                                            copy=u * page_bytes < copy_below_bytes, fresh=fresh)
        finally:
            self.give_back_fresh(fresh)
        return pairs

    # ------------------------------------------------------------------ copy-on-write
    def any_shared(self, slot: Slot, units: Iterable[int]) -> bool:
        """Does any mapped page of ``units`` of ``slot`` have a reference count above 1?  (O(1) when
        no page of the slot is mapped in another slot, ``PageTable.shared_positions``: every decode
        step asks it of every sequence, and a per_layer unit holds one page per K/V tensor.)"""
        if slot.index not in self.table.shared_positions:
            return False
        refcount = self.pool.refcount
        for u in units:
            for p in slot.units.get(u, ()):
                if p is not None and refcount(p) > 1:
                    return True
        return False

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

    def make_writable(self, slot: Slot, units: Iterable[int], reservations: Iterable[int],
                      copy: bool = True, fresh: list[int] | None = None) -> list[tuple]:
        """Before writing into claimed ``units``: give every shared page a private copy
        (copy-on-write) and drop the prefix entry of unshared pages (their content changes).

        Returns:
            ``(src_va, dst_va, src_slot, unit)`` of each page whose bytes the caller must copy (in
            reverse order, after the whole batch: a later copy may remap an earlier source), then
            pass to :meth:`copied`.  Sources stay mapped until then (:attr:`_pending`).
            ``fresh``: pages of :meth:`acquire_for_cow` to take the copies' pages from (the caller
            gives back what is left); default: acquired here, all before any page is replaced.
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
                            self._pending.add(page)
                    else:
                        self._forget(page)
        finally:
            if own:
                self.give_back_fresh(fresh)
        return pairs

    def acquire_for_cow(self, targets: Sequence[tuple], reservations: Iterable[int],
                        exclude: frozenset = frozenset()) -> list[int]:
        """The fresh pages :meth:`make_writable` of each ``(slot, units)`` of ``targets`` needs, all
        acquired before any page is replaced, so that a creation out of memory (after reusing idle
        pages, :meth:`_acquire`) refuses with nothing changed: a page replaced and its copy never
        made would lose the sequence's K/V.  All or none: on a failure those acquired go back.
        ``exclude``: pages the reclaiming must leave alone (besides the shared pages themselves)."""
        reservations = tuple(reservations)
        shared = [p for slot, units in targets for p in self.shared_pages(slot, units, reservations)]
        if not shared:
            return []
        exclude = frozenset(exclude | set(shared) | self._pending)
        pages: list[int] = []
        try:
            for _ in shared:
                self._ensure_pool(1, exclude)
                pages.append(self._acquire(exclude))
        except BaseException:
            self.give_back_fresh(pages)
            raise
        return pages

    def give_back_fresh(self, pages: list[int]) -> None:
        """Return the unused pages of :meth:`acquire_for_cow` to the pool (the list is emptied)."""
        while pages:
            self.pool.give_back(pages.pop())

    def copied(self, pairs: Sequence[tuple]) -> None:
        """The bytes of ``pairs`` (from :meth:`make_writable`) are copied: a source mapping that is
        not claimed may be reclaimed later, after a fence recorded now."""
        self._pending.clear()
        fence = None
        for *_, src, unit in pairs:
            if not self._is_claimed(src, unit):
                fence = self.driver.record_fence() if fence is None else fence
                src.fence = fence

    def _cow(self, slot: Slot, unit: int, res: int, new: int) -> tuple:
        """Replace the shared page at ``(unit, res)`` of ``slot`` with ``new`` (acquired, unmapped)."""
        old = slot.page(unit, res)
        src = self.slots[min(self.table.slots_of(old) - {slot.index})]
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
    def share(self, child: Slot, parent: Slot, seq_id: int, num_units: int) -> list[tuple]:
        """Give free ``child`` to ``seq_id``, mapping the parent's pages of units ``[0, num_units)``; a
        page of a span gets a fresh page and a copy instead (:meth:`plan_share` counts them).

        Returns:
            The copies to make (:meth:`_copy_pairs`; empty without spans)."""
        assert child.is_free, f"slot {child.index} is live"
        self._set_occupant(child, seq_id)
        self.adopt(child, num_units)
        for u in range(num_units):
            for r in range(self.num_res):
                cur = child.page(u, r)
                if cur is not None and cur != parent.page(u, r):
                    self._wait_slot(child)
                    self._unmap(child, u, r)
        self._set_claimed(child, num_units)
        span_of = self.pool.span_of
        copies = [(u, r, p) for u in range(num_units) for r, p in enumerate(parent.units.get(u, ()))
                  if p in span_of] if span_of else []
        given = parent.page if not copies else (
            lambda u, r: None if (p := parent.page(u, r)) in span_of else p)
        try:
            self._fill_holes(child, range(num_units), given)
        except BaseException:
            self._set_claimed(child, 0)
            self._set_occupant(child, None)
            raise
        return self._copy_pairs(child, copies)

    def plan_share(self, parent: Slot, num_units: int) -> int:
        """Fresh pages :meth:`share` needs: the parent's span pages among units ``[0, num_units)``
        (copied, a span is mapped once; every other page is mapped in the child too)."""
        span_of = self.pool.span_of
        if not span_of:
            return 0
        return sum(1 for u in range(num_units) for p in parent.units.get(u, ()) if p in span_of)

    def vacate(self, slot: Slot) -> None:
        """Free a live slot; its pages stay mapped (kept) behind a fence recorded now, and its claims
        are released now or, when nothing could tell the difference, lazily (parking.py)."""
        self._tick += 1
        if not self._park(slot):
            self._set_claimed(slot, 0)
        self._set_occupant(slot, None)
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
        # the claim really ends where _claim_plan says (on to the end of a kept span it reaches into,
        # whose units may hold holes in other reservations, or the span goes): back off to a claim
        # whose fresh pages the plain pool has, less what its doomed spans give back
        budget = self.pool.num_plain_available
        while end > old:
            plan = self._claim_plan(slot, end)
            if self._claim_cost(slot, old, plan) <= budget:
                break
            end -= 1
        if end == old:
            return
        try:
            self._claim_units(slot, old, plan[0], reuse=False, plan=plan)   # no reuse on out of memory
        except VMMError as e:       # a creation out of memory ends it quietly (the claim is undone)
            if not creation_out_of_memory(self.driver, e):
                raise

    def _claim_cost(self, slot: Slot, start: int, plan: tuple[int, frozenset]) -> int:
        """Plain pool pages :meth:`_claim_units` of units ``[start, end)`` with ``plan`` (``(end,
        doomed)`` of :meth:`_claim_plan`) takes at most: a page per hole, shared page, cached kept
        page or page of a doomed span, less the doomed spans' pages (released: room to create)."""
        end, doomed = plan
        get, num_res = slot.units.get, self.num_res
        need = 0
        for u in range(start, end):
            pages = get(u)
            if pages is None:
                need += num_res
                continue
            need += sum(1 for p in pages
                        if p is None or p in doomed or self._needs_fresh(p) or self._is_cached_kept(p))
        return need - len(doomed)

    def prefetch(self, slot: Slot, num_units: int, hits: Sequence[Sequence[int]] = ()) -> int:
        """Best effort, off the critical path: map the holes of units ``[claimed, num_units)`` of
        ``slot`` (live, or free: an admission expected soon, from unit 0) from free pool pages, in
        one batch, **without claiming them**; on a free slot, ``hits`` (prefix-hit pages per unit,
        from unit 0) fill the holes of the first units instead.

        The pages stay kept (reclaimable, so they count as available for admission); the grow that
        later claims those units reuses them without a driver call.  Never reclaims, never waits
        for a fence; stops at the first unit holding a shared page or not fitting in the pool.

        Returns:
            The number of pages mapped.
        """
        mapped = 0
        copies, _ = self._copied_hits(slot, hits)
        if copies:          # a span's page is copied at admission, not mapped: stop before it
            num_units = min(num_units, min(u for u, *_ in copies))
            hits = hits[:num_units]
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
        # a live slot's prefetched units as single pages: the grows claim them one unit at a time,
        # and a span they reached into part of would go whole (SlotMapper._claim_plan)
        mapped += self._fill_holes(slot, range(start, end), reuse=False, spans=slot.seq_id is None)
        if all(u in slot.units and None not in slot.units[u] for u in range(len(hits))):
            slot.mapped_to = max(slot.mapped_to, end)
        self.num_prefetched_pages += mapped
        return mapped
