"""Reclamation: which idle pages go first when the pool runs short, and when memory goes back to the
device (torch-free; DESIGN.md "vmem backend / Pool and reclamation").

When the pool runs short, pages are taken in this order (as the paged block pool does): plain pool pages,
kept pages without a prefix entry, then the least recently used cached pages (kept or cached free),
whose entries are dropped (eviction: a later lookup misses, never reads a stale page).  The same order
applies when creating a page fails for want of memory (another process holds it): idle pages are reused
instead (:meth:`Reclaimer.acquire`), those whose fence is pending excepted, before the operation gives
up with a transient full cache.  The elastic shrink (:meth:`Reclaimer.release`) releases idle pages to
the driver in the same order, without waiting for any fence.  Pages a live sequence claims and sources
of pending copy-on-write copies are never candidates.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable

from vmkv.vmem.page_pool import PagePoolExhaustedError, creation_out_of_memory
from vmkv.vmem.protocol import VMMError

if TYPE_CHECKING:
    from vmkv.vmem.slots import SlotSpace

__all__ = ["Reclaimer"]

logger = logging.getLogger(__name__)


class Reclaimer:
    """Makes idle pages of ``space`` plain free (reclamation) or gives them back to the driver (shrink),
    counting in the space's ``num_reclaimed_pages`` (kept pages unmapped to make room),
    ``num_prefix_evictions`` (prefix-cache units dropped), ``num_released_pages`` (pages released to
    the driver) and ``num_reused_on_oom`` (page creations out of memory answered by idle pages)."""

    def __init__(self, space: SlotSpace) -> None:
        self.space = space

    def eviction_order(self, candidates: Iterable[int]) -> list[int]:
        """Pages without a prefix entry first, then least recently used; among pages used at the same
        tick, the deepest prefix unit first (a chain is evicted from its tail, as the paged backend
        frees a sequence's blocks tail first), and of pages without an entry the highest unit first (a
        freed slot keeps its first units longest: a later admission into it adopts them)."""
        table, prefix = self.space.table, self.space.prefix
        entries, last_use = table.entries, table.last_use

        def key(p: int):
            entry = prefix.entry_of(p)
            if entry is not None:
                return (True, last_use[p], -entry.depth, p)
            mapped = entries.get(p)
            return (False, last_use[p], -mapped.pos[1] if mapped is not None else 0, p)
        return sorted(candidates, key=key)

    def _free_one(self, page: int, wait: bool) -> bool:
        """Make one candidate ``page`` plain free: evict it if cached free, else unmap it everywhere
        (dropping its prefix entry first).  ``wait=False``: a page whose fence is pending is skipped.
        Returns whether anything changed."""
        space = self.space
        pool = space.pool
        if pool.is_cached_free(page):
            pool.evict(page)
            space.num_prefix_evictions += 1
            return True
        if page not in space.table.reclaimable:
            return False        # an eviction before dropped its entry and made it plain free already
        if not wait and space.fence_pending(page):
            return False
        if space.prefix.is_cached(page):
            pool.forget(page)
            space.num_prefix_evictions += 1
        space.unmap_everywhere(page)
        return True

    def _candidates(self, exclude: frozenset) -> list[int]:
        space = self.space
        space.unpark_all()              # parked slots' pages become reclaimable, as at their vacate
        return self.eviction_order((space.table.reclaimable | space.pool.cached_pages()) - exclude)

    def reclaim(self, num_pages: int, exclude: frozenset = frozenset(), wait: bool = True) -> int:
        """Make ``num_pages`` more pool pages plain available (order: module docstring); never a page
        in ``exclude``.  ``wait=False``: skip a kept page whose fence is pending instead of waiting.
        Returns the number of pages made available."""
        pool = self.space.pool
        start = pool.num_plain_available
        target = start + num_pages
        for page in self._candidates(exclude):
            if pool.num_plain_available >= target:
                break
            mapped = page in self.space.table.reclaimable
            if self._free_one(page, wait) and mapped:
                self.space.num_reclaimed_pages += 1
        return pool.num_plain_available - start

    def release(self, num_pages: int, keep_free: int = 0) -> int:
        """Release up to ``num_pages`` idle pages to the driver: plain free pages beyond ``keep_free``
        first (no driver call but the release), then unmapped or evicted ones in the order of the
        module docstring.  Never waits for a fence (a page whose kernels may still run waits for a later
        call).  Below ``keep_free`` an unmapped page refills the plain free list instead of going, so
        the grows that follow need not reclaim on the critical path.  Returns the pages released."""
        pool = self.space.pool
        released = 0

        def drain() -> None:
            nonlocal released
            while released < num_pages and pool.num_free > keep_free:
                pool.release_free()
                released += 1

        drain()
        if released < num_pages:
            for page in self._candidates(frozenset(self.space.pending)):
                if released >= num_pages:
                    break
                if self._free_one(page, wait=False):
                    drain()
        self.space.num_released_pages += released
        return released

    def ensure_pool(self, num_pages: int, exclude: frozenset = frozenset()) -> None:
        """Reclaim until ``num_pages`` pages are plain available.  Raises PagePoolExhaustedError:
        they are not (the operation's plan said they would be)."""
        pool = self.space.pool
        short = num_pages - pool.num_plain_available
        if short > 0:
            self.reclaim(short, exclude)
        if pool.num_plain_available < num_pages:
            raise PagePoolExhaustedError(f"needed {num_pages} pages, {pool.num_plain_available} available "
                                         f"after reclaiming (plan/execute mismatch)")

    def acquire(self, exclude: frozenset = frozenset(), want: int = 1) -> int:
        """A fresh pool page (plain free first, else a new one).  When the driver cannot create one for
        want of memory (held by another process), idle pages are reused instead: up to ``want`` made
        plain free in reclamation order, never a page in ``exclude`` or a pending copy source, never one
        whose fence is pending.  Raises the driver's out-of-memory VMMError when none is left (the cache
        turns it into a transient ``KVCacheFullError``)."""
        space = self.space
        try:
            return space.pool.acquire()
        except VMMError as e:
            if not creation_out_of_memory(space.driver, e):
                raise
            if not self.reclaim(max(1, want), exclude | space.pending, wait=False):
                raise
            space.num_reused_on_oom += 1
            logger.debug("page creation out of memory (%s): reusing idle pages", e.code)
        return space.pool.acquire()
