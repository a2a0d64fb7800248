"""Elastic vmem memory: the pages kept created ahead of need (the reserve) and the idle pages given back to
the device (or the OS) when demand falls (DESIGN.md, vmem backend, "Elastic"; torch-free).

**Idle pages** are created pages no live sequence claims: plain free pool pages, cached free pool pages
(unmapped, still holding a prefix-cache unit) and kept pages (mapped in a freed slot, or past what a live
slot claims).

**The reserve** (``reserve_pages``) is kept ahead of need, in the form the next allocations can use
without a driver call (:meth:`ElasticPolicy.top_up`, off the critical path, never beyond the cap): while
sequences are live, as **plain free** pages, so a grow takes one instead of calling ``cuMemCreate`` (kept
pages of freed slots do not count: only their own slot uses them without a driver call); while none is,
every idle page counts, and the shrink releases freed slots' kept pages last, so the reserve stays
mapped in a free slot the next admission adopts without a map call.

**The shrink never fights the load** (:class:`ShrinkWindow`).  Under steady online traffic the pages
sequences claim go up and down step by step, and pages released in a dip are created and mapped again
at the next peak on the step's path: a freed slot's kept pages, once released, turn the next admission
into it from a warm one (no driver call) into a cold one (a create and map per page).  So memory goes
back only when demand has really fallen:

* the **high-water mark** of the pages live sequences claim over the last ``grace_s`` seconds sets what
  stays: ``hwm * (1 + band / 2) + reserve_pages`` pages created;
* **hysteresis**: nothing goes until the created pages exceed ``hwm * (1 + band) + reserve_pages``, so
  the load's own fluctuation (within the band) releases nothing;
* **no release while requests wait** for admission (their admissions will need the memory at once);
  the grace period starts again when the queue empties;
* a **rate limit**: while sequences are live at most :data:`RELEASE_PAGES_PER_CALL` pages go per call;
* **learning**: the high-water mark of claimed pages undercounts what a load of mixed lengths needs
  created (a long prompt admitted into a slot that kept few pages creates fresh ones while another freed
  slot's kept pages sit idle), so pages released while sequences are live and then created again
  (``PagePool.num_creations``) are kept from then on while sequences are live (``learned_pages``, at
  most what was released), until the load ends (nothing claimed for a whole grace period).

Once a burst is over the high-water mark falls to 0 after ``grace_s``, and memory returns to the reserve
(co-location: ``vmkv compare colocate``).  Idle pages are released in reclamation order (plain free,
kept without a prefix entry, cached least recently used first; ``reclaim.py``), never waiting for a fence.
"""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from vmkv.vmem.placement import pick_slot

if TYPE_CHECKING:
    from vmkv.vmem.mapper import SlotMapper
    from vmkv.vmem.slots import Slot

__all__ = ["ShrinkWindow", "ElasticPolicy", "RELEASE_PAGES_PER_CALL", "TOP_UP_PAGES_PER_CALL",
           "SHRINK_BAND"]

#: pages :meth:`ElasticPolicy.release_idle` releases per call at most while sequences are live
RELEASE_PAGES_PER_CALL = 32
#: pages a top-up creates per call at most while sequences are live (the whole reserve when none is)
TOP_UP_PAGES_PER_CALL = 32
#: the hysteresis band of the shrink, as a fraction of the high-water mark (module docstring)
SHRINK_BAND = 0.25


class ShrinkWindow:
    """How many pages may go now: a sliding maximum of the pages live sequences claim over the grace
    period, with hysteresis, and nothing while requests wait (module docstring).

    Args:
        reserve_pages: idle pages always kept (>= 0).
        grace_s: the window in seconds; 0: at once; negative or ``inf``: never release.
        band: hysteresis band, a fraction of the high-water mark (>= 0).
    Raises:
        ValueError: ``reserve_pages`` or ``band`` is negative.
    """

    def __init__(self, reserve_pages: int, grace_s: float, band: float = SHRINK_BAND) -> None:
        if reserve_pages < 0:
            raise ValueError(f"reserve_pages must be >= 0, got {reserve_pages}")
        if not band >= 0:
            raise ValueError(f"band must be >= 0, got {band}")
        self.reserve_pages, self.grace_s, self.band = int(reserve_pages), float(grace_s), float(band)
        self.enabled = 0.0 <= self.grace_s < math.inf
        self._peaks: collections.deque = collections.deque()   # (time, claimed), claimed decreasing
        self._since: float | None = None     # when the current window of observation started

    def high_water(self) -> int:
        """The most pages live sequences claimed in the window (0 before any observation)."""
        return self._peaks[0][1] if self._peaks else 0

    def observe(self, now: float, num_created: int, num_claimed: int, num_waiting: int = 0,
                extra_pages: int = 0) -> int:
        """Record ``num_claimed`` pages claimed at ``now`` (seconds, non-decreasing), with
        ``num_created`` pages created and ``num_waiting`` requests waiting; returns how many pages
        may be released now.  ``extra_pages`` are kept on top of the reserve (what the load was seen
        to need again: :class:`ElasticPolicy`)."""
        if not self.enabled:
            return 0
        if num_waiting > 0:
            self._since = None           # the grace period starts again once the queue is empty
            self._peaks.clear()
            return 0
        dq = self._peaks
        while dq and dq[-1][1] <= num_claimed:
            dq.pop()
        dq.append((now, num_claimed))
        while dq[0][0] < now - self.grace_s:
            dq.popleft()
        if self._since is None:
            self._since = now
        if now - self._since < self.grace_s:
            return 0
        hwm, keep = dq[0][1], self.reserve_pages + max(0, int(extra_pages))
        if num_created <= hwm * (1.0 + self.band) + keep:
            return 0
        return max(0, num_created - math.ceil(hwm * (1.0 + self.band / 2)) - keep)


class ElasticPolicy:
    """Every page made ahead of need and every idle page given back, in one place: the reserve's
    top-up, the shrink (module docstring), the look-ahead claim and the prefetches the engine asks for
    between steps (vAttention, Prabhu et al., ASPLOS'25, section 6.1: overlap allocation with compute).

    Args:
        mapper: the slot mapper (its pool and reclaimer).
        reserve_pages: idle pages kept ahead of need.
        grace_s: the shrink's window (``ShrinkWindow``); ``inf`` when the pool is preallocated.
        max_model_len: positions per slot (look-ahead and prefetch stop there).
        lookahead_tokens: positions past a sequence's length claimed at each allocation and grow.
    """

    def __init__(self, mapper: SlotMapper, reserve_pages: int, grace_s: float, max_model_len: int,
                 lookahead_tokens: int = 0) -> None:
        self.mapper = mapper
        self.max_model_len, self.lookahead_tokens = int(max_model_len), int(lookahead_tokens)
        self.window = ShrinkWindow(reserve_pages, grace_s)
        self.reserve_pages = self.window.reserve_pages
        self.num_topped_up_pages = 0
        # learning (module docstring): pages released while sequences were live since the load began,
        # the pool's creations at the first of those releases, and what is kept on top
        self._released_live = 0
        self._created_mark: int | None = None
        self.learned_pages = 0

    def top_up(self, live: bool) -> int:
        """Create plain free pages until ``reserve_pages`` are plain free (``live``: sequences are
        live, so kept and cached pages do not count; at most :data:`TOP_UP_PAGES_PER_CALL` now) or idle
        (not ``live``); never beyond the pool's cap, and a creation out of memory ends it quietly.
        Returns the pages created.  Raises VMMError: a creation failed for another reason."""
        m = self.mapper
        if live:
            need = min(self.reserve_pages - m.pool.num_free, TOP_UP_PAGES_PER_CALL)
        else:
            need = self.reserve_pages - m.num_idle_pages()
        created = m.pool.top_up(need) if need > 0 else 0
        self.num_topped_up_pages += created
        return created

    def release_idle(self, now: float, live: bool, num_waiting: int = 0) -> int:
        """Top the reserve up, then release the idle pages the shrink window allows (module
        docstring); returns the pages released.  Raises VMMError: a driver call failed other than a
        top-up's creation out of memory."""
        self.top_up(live)               # first, so that the window sees the reserve as created
        m = self.mapper
        if not live and self.window.high_water() == 0:
            self._released_live, self._created_mark, self.learned_pages = 0, None, 0   # the load ended
        elif self._created_mark is not None:
            recreated = m.pool.num_creations - self._created_mark
            self.learned_pages = min(self._released_live, recreated)
        num = self.window.observe(now, m.pool.num_created, m.num_allocated_pages(), num_waiting,
                                  self.learned_pages if live else 0)
        if num <= 0:
            return 0
        if live:
            num = min(num, RELEASE_PAGES_PER_CALL)
        released = m.reclaimer.release(num, keep_free=self.reserve_pages if live else 0)
        if released and live:
            if self._created_mark is None:
                self._created_mark = m.pool.num_creations
            self._released_live += released
        return released

    # ------------------------------------------------------------------ mapping ahead of need
    def map_ahead(self, slot, seq_len: int) -> None:
        """``lookahead_tokens``: claim (best effort, from plain pool pages) the units of that many
        positions past ``seq_len`` of live ``slot``."""
        if self.lookahead_tokens:
            layout = self.mapper.layout
            target = min(self.max_model_len, seq_len + self.lookahead_tokens)
            self.mapper.map_ahead(slot, layout.num_units(target))

    def prefetch(self, targets: Iterable[tuple[Slot, int]], live: bool) -> None:
        """Map, unclaimed, the holes of each live ``(slot, positions)`` up to ``positions`` (capped at
        ``max_model_len``; :meth:`SlotMapper.prefetch`), then top the reserve up."""
        m = self.mapper
        available = m.pool.num_available          # changes only when pages get mapped
        for slot, num_tokens in targets:
            if available == 0:
                break
            if m.prefetch(slot, m.layout.num_units(min(self.max_model_len, num_tokens))):
                available = m.pool.num_available
        self.top_up(live)

    def prefetch_admissions(self, num_tokens: Sequence[int], hits_of: Callable[[int], Sequence],
                            live: bool) -> None:
        """Map, unclaimed, the pages of the admissions expected next (prompt lengths in admission order,
        plus ``lookahead_tokens``; ``hits_of(i)``: the prefix-hit pages per unit of the ``i``-th, asked
        only while the pool has free pages) into the free slot
        :func:`~vmkv.vmem.placement.pick_slot` would give each, then top the reserve up."""
        m = self.mapper
        taken: set[int] = set()
        for i, n in enumerate(num_tokens):
            if m.pool.num_plain_available == 0:
                break
            hits = hits_of(i)
            units = m.layout.num_units(min(self.max_model_len, int(n) + self.lookahead_tokens))
            slot = pick_slot(m, units, hits, frozenset(taken))
            if slot is None:
                break
            taken.add(slot.index)
            m.prefetch(slot, units, hits)
        self.top_up(live)
