"""Elastic vmem memory: give idle physical pages back to the device (or the OS) after a grace period
(DESIGN.md, vmem backend, "Elastic"; torch-free).

**Idle pages** are created pages that no live sequence claims: plain free pool pages, cached free pool
pages (an unmapped page that still holds a prefix-cache unit), and mapped pages that are not claimed
(the kept pages of freed slots, and units of a live slot past what it claims, e.g. prefetched ones).
:class:`IdleWindow` decides how many may go: the pages that stayed idle beyond ``reserve_pages`` during
the whole last ``grace_s`` seconds (the minimum of the idle count over that window, less the
reserve), so a dip between two bursts shorter than the grace releases nothing.

The reserve is also kept **ahead of need**, in the form the next allocations can use without a driver
call, which depends on whether sequences are live (:meth:`ElasticMixin.top_up_idle`, off the
critical path, never beyond the cap):

* **while sequences are live** it serves their grows: ``reserve_pages`` of **plain free** pages are
  kept created, so a grow takes one instead of calling ``cuMemCreate``.  Kept pages of freed slots
  do not count: only the slot that kept them can use them without a driver call (a warm admission),
  so a grow elsewhere would still create a page.  During a burst the pages held are therefore at
  most the claimed ones, the kept ones (released after the grace period) and the reserve.
* **while none is** it serves the next admission: every idle page counts, and the shrink keeps the
  kept pages of freed slots last, so the reserve stays mapped in a free slot that the next admission
  adopts without a map call (:func:`~vmkv.vmem.placement.pick_slot` prefers it).  Once the burst is
  over, the reserve is all that is held.

:class:`ElasticMixin` (a mixin of :class:`~vmkv.vmem.mapper.SlotMapper`) releases idle pages in this
order: plain free pages (while sequences are live, only those beyond the reserve; no driver call but
the release), then kept pages without a prefix entry, then cached pages (cached free or kept) least
recently used first, whose prefix entries are dropped first (a later lookup is a miss, never a stale
read).  Idle pages up to the reserve, counted as the top-up counts them, are never released, so the
top-up and the shrink never undo each other's work.  A kept page is unmapped only when the fence of
every slot it is mapped in has completed (checked without waiting: a page whose fence is pending
waits for a later call), so no kernel can still read it; pages a live sequence claims, and sources of pending
copy-on-write copies, are never candidates.  A span (``page_pool.py``) goes only whole, so one can take
the release past ``num_pages`` (by less than the span); the top-up then creates the reserve again as
plain free pages.
"""

from __future__ import annotations

import collections
import math

__all__ = ["IdleWindow", "ElasticMixin"]


class IdleWindow:
    """Sliding minimum of the idle page count over the grace period.

    Args:
        reserve_pages: idle pages always kept (>= 0).
        grace_s: seconds the idle count must stay above the reserve before the excess is released;
            0: at once; negative or ``inf``: never.
    """

    def __init__(self, reserve_pages: int, grace_s: float) -> None:
        if reserve_pages < 0:
            raise ValueError(f"reserve_pages must be >= 0, got {reserve_pages}")
        self.reserve_pages = int(reserve_pages)
        self.grace_s = float(grace_s)
        self.enabled = 0.0 <= self.grace_s < math.inf
        # (time, idle + released so far): increasing values, each in effect from its time until the
        # next entry's; the first is the one in effect at the window's start (releases shift every
        # later reading, hence the offset)
        self._samples: collections.deque = collections.deque()
        self._first_s: float | None = None
        self._released = 0

    def observe(self, now: float, num_idle: int) -> int:
        """Record ``num_idle`` idle pages at time ``now`` (seconds, non-decreasing); returns how many
        pages may be released now (0 while the grace period has not passed)."""
        if not self.enabled:
            return 0
        value = num_idle + self._released
        dq = self._samples
        since = now
        while dq and dq[-1][1] >= value:     # larger readings since then no longer matter, but
            since = dq.pop()[0]              # where the smaller one before them ended does
        dq.append((since, value))
        start = now - self.grace_s
        while len(dq) >= 2 and dq[1][0] <= start:
            dq.popleft()
        if self._first_s is None:
            self._first_s = now
        if num_idle <= self.reserve_pages:
            self._first_s = now          # below the reserve: the grace period starts again
            return 0
        if now - self._first_s < self.grace_s:
            return 0
        return max(0, dq[0][1] - self._released - self.reserve_pages)

    def released(self, num_pages: int) -> None:
        """``num_pages`` idle pages were released (the idle count fell by that much)."""
        self._released += int(num_pages)


class ElasticMixin:
    """Needs the state and primitives of :class:`~vmkv.vmem.mapper.SlotMapper`."""

    def num_idle_pages(self) -> int:
        """Created pages no live sequence claims (see the module docstring)."""
        return self.pool.num_created - self.num_allocated_pages()

    def top_up_idle(self, reserve_pages: int, max_pages: int, live: bool = True) -> int:
        """Create plain free pages until ``reserve_pages`` are plain free (``live``: sequences are
        live, so kept and cached pages do not count) or idle (not ``live``), see the module
        docstring; at most ``max_pages`` of them now and never beyond the pool's cap
        (:meth:`PagePool.top_up`: out of memory ends it quietly).  Returns the number of pages
        created.  Raises VMMError: a creation failed for another reason than memory."""
        if not live:
            need = min(reserve_pages - self.num_idle_pages(), max_pages)
            created = self.pool.top_up(need) if need > 0 else 0
        else:
            singles, spans = self.reserve_split(reserve_pages)
            need = min(singles - self.pool.num_free, max_pages)
            created = self.pool.top_up(need) if need > 0 else 0
            g = self.pool.ready_span_pages
            missing = min(spans - self.pool.num_ready_spans, (max_pages - created) // g) if spans else 0
            if missing > 0:
                created += self.pool.top_up_spans(missing)
        self.num_topped_up_pages += created
        return created

    def reserve_split(self, reserve_pages: int) -> tuple[int, int]:
        """``(plain free pages, ready spans)`` the reserve is kept as while sequences are live: with
        ready spans (``PagePool.ready_span_pages``, megacache with spans) half of it, in whole spans,
        serves the grows that take a span, the rest the grows of one page."""
        g = self.pool.ready_span_pages
        if g < 2:
            return reserve_pages, 0
        spans = reserve_pages // 2 // g
        return reserve_pages - spans * g, spans

    def _fence_pending(self, page: int) -> bool:
        for s in self.table.slots_of(page):
            fence = self.slots[s].fence
            if fence is not None and not self.driver.fence_done(fence):
                return True
        return False

    def release_idle_pages(self, num_pages: int, keep_free: int = 0, keep_spans: int = 0) -> int:
        """Release up to ``num_pages`` idle pages to the driver (order and safety rules: the module
        docstring); never waits for a fence, never takes the plain free list below ``keep_free``
        pages nor the ready spans below ``keep_spans`` (the reserve, while sequences are live:
        :meth:`reserve_split`; else 0; ready spans go first).  Below ``keep_free`` (at the cap, or
        when creation is out of memory) an unmapped page refills the reserve instead of going, so a
        call unmaps or evicts at most ``num_pages`` plus the pages missing from the reserve when it
        starts (the grows that follow would otherwise reclaim them on the critical path); a span
        is released whole, which can pass ``num_pages`` by less than the span.  Returns the number
        of pages released."""
        released = 0

        def drain() -> None:
            nonlocal released
            while released < num_pages and self.pool.num_ready_spans > keep_spans:
                released += self.pool.release_ready_span()      # whole: may pass num_pages
            while released < num_pages and self.pool.num_free > keep_free:
                self.pool.release_free()
                released += 1

        drain()
        if released < num_pages:
            if self._parked:
                self.unpark_all()         # their pages become reclaimable, as at their vacate
            candidates = (self.table.reclaimable | self.pool.cached_pages()) - self._pending
            spans = bool(self.pool.span_of) or bool(self.pool.ready_span_pages)
            for page in self._eviction_order(candidates):
                if released >= num_pages:
                    # a span cannot refill the plain free reserve as an unmapped page does: it goes,
                    # up to the reserve's deficit more (the top-up that follows creates it back)
                    if not spans or released >= num_pages + max(0, keep_free - self.pool.num_free):
                        break
                if self.pool.is_cached_free(page):
                    self.pool.evict(page)
                    self.num_prefix_evictions += 1
                elif page in self.table.reclaimable and not self._fence_pending(page):
                    span = self.pool.span_of.get(page)
                    if span is not None and not self._span_idle(span):
                        continue
                    if self.prefix.is_cached(page):
                        self._forget(page)
                        self.num_prefix_evictions += 1
                    res, unit = self.table.position(page)
                    for s in sorted(self.table.slots_of(page)):
                        slot = self.slots[s]
                        self._wait_slot(slot)     # done already: clears the fence
                        self._unmap(slot, unit, res)
                    if span is not None:          # unmapped whole and released at once
                        released += len(span)
                else:
                    continue    # fence pending, or already plain free (an eviction above freed it)
                drain()
        self.num_released_pages += released
        return released
