"""The slot mapper's introspection: statistics, integrity checks and teardown (a mixin of
:class:`~vmkv.vmem.mapper.SlotMapper`)."""

from __future__ import annotations

from typing import Iterable

from vmkv.vmem.free_slots import FreeSlotIndex

__all__ = ["MapperCheckMixin"]


def _percentile(samples: Iterable[float], q: float) -> float:
    data = sorted(samples)
    if not data:
        return 0.0
    return data[min(len(data) - 1, int(q / 100.0 * len(data)))]


class MapperCheckMixin:
    """Needs the state of :class:`~vmkv.vmem.mapper.SlotMapper`."""

    # ------------------------------------------------------------------ introspection
    def refcount(self, page: int) -> int:
        return self.pool.refcount(page)

    def num_mapped_pages(self) -> int:
        return self.table.num_mapped_pages

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
            "num_released_pages": self.num_released_pages,
            "num_topped_up_pages": self.num_topped_up_pages,
            "num_idle_pages": self.num_idle_pages(),
            "num_reused_on_oom": self.num_reused_on_oom,
            "num_parked_slots": len(self._parked),
            "num_parked_pages": self.num_parked_pages,
            "num_parks": self.num_parks,
            "num_adoptions": self.num_adoptions,
            "max_span_pages": self.max_span_pages,
            "num_spans_created": self.pool.num_spans_created,
            "num_span_pages": len(self.pool.span_of),
            "num_released_span_pages": self.num_released_span_pages,
            "num_span_copies": self.num_span_copies,
        }

    def check_integrity(self) -> None:
        """Walk every slot and compare with the page table, the pool, the prefix index and (where
        the driver keeps a mapping table: :class:`~vmkv.vmem.checked_driver.CheckedDriver`) the
        driver."""
        walk: dict[int, tuple] = {}        # page -> ((res, unit), slots, claimed mappings)
        expected_va: dict[int, int] = {}   # va -> page
        parked_pages = 0
        for slot in self.slots:
            parked = self.is_parked(slot)
            if parked and not slot.is_free:
                raise AssertionError(f"live slot {slot.index} is parked")
            if slot.is_free and slot.claimed and not parked:
                raise AssertionError(f"free slot {slot.index} claims {slot.claimed} units")
            if parked:
                parked_pages += slot.claimed * self.num_res
                for u in range(slot.claimed):
                    for p in slot.units.get(u, ()):
                        if p is not None and (self.pool.refcount(p) != 1 or self.prefix.is_cached(p)):
                            raise AssertionError(f"parked slot {slot.index} holds page {p}, shared or cached")
            for u in range(slot.claimed):
                if any(p is None for p in slot.units.get(u, [None])):
                    raise AssertionError(f"slot {slot.index} claims unit {u} but it is not fully mapped")
            num_mapped = sum(len(pages) - pages.count(None) for pages in slot.units.values())
            if num_mapped != slot.num_mapped:
                raise AssertionError(f"slot {slot.index} counts {slot.num_mapped} mapped pages, "
                                     f"maps {num_mapped}")
            units_end = max(slot.units, default=-1) + 1
            if units_end != slot.units_end:
                raise AssertionError(f"slot {slot.index} says its units end at {slot.units_end}, "
                                     f"they end at {units_end}")
            for u, pages in slot.units.items():
                if all(p is None for p in pages):
                    raise AssertionError(f"slot {slot.index} keeps an empty unit {u}")
                for r, p in enumerate(pages):
                    if p is None:
                        continue
                    pos, slots, claimed = walk.get(p, ((r, u), set(), 0))
                    if pos != (r, u):
                        raise AssertionError(f"page {p} mapped at (reservation, unit) {pos} and {(r, u)}")
                    slots.add(slot.index)
                    walk[p] = (pos, slots, claimed + (self._is_claimed(slot, u) or (parked and u < slot.claimed)))
                    span = self.pool.span_of.get(p)
                    expected_va[self.va(r, slot.index, u)] = (
                        p if span is None else (span.handle, span.pages.index(p)))
        self.free_slots.check({s.index: len(s.units) for s in self.slots if s.is_free})
        if parked_pages != self.num_parked_pages:
            raise AssertionError(f"parked slots hold {parked_pages} claimed pages, the count says "
                                 f"{self.num_parked_pages}")
        self.table.check_against(walk)
        self._check_spans(walk)
        check_driver = getattr(self.driver, "check_mappings", None)
        if check_driver is not None:
            check_driver(expected_va)
        unmapped_in_use = [p for p, e in self.table.entries.items() if not e.slots]
        if unmapped_in_use:
            raise AssertionError(f"pages {sorted(unmapped_in_use)} are in use but mapped nowhere "
                                 f"(acquired and not given back)")
        stray = self.prefix.handles() - set(walk) - self.pool.cached_pages()
        if stray:
            raise AssertionError(f"prefix entries name {len(stray)} pages neither mapped nor cached free")
        for p, (pos, _, _) in walk.items():
            entry = self.prefix.entry_of(p)
            if entry is not None and (entry.depth, entry.handles.index(p)) != pos[::-1]:
                raise AssertionError(f"page {p} mapped at (reservation, unit) {pos} caches "
                                     f"unit {entry.depth}, reservation {entry.handles.index(p)}")
        missing = (self.pool.cached_pages() | set(walk)) - self.table.last_use.keys()
        if missing:
            raise AssertionError(f"pages {sorted(missing)} have no last-use tick")
        self.pool.check_integrity()
        num_driver_pages = getattr(self.driver, "num_pages", None)
        if num_driver_pages is not None and num_driver_pages != self.pool.num_created:
            raise AssertionError(f"the driver holds {num_driver_pages} pages, the pool created "
                                 f"{self.pool.num_created} (a page released twice or never)")
        self.prefix.check_integrity()

    def _check_spans(self, walk: dict) -> None:
        """Every span is mapped whole in one slot at consecutive units of one reservation, and
        claimed whole or not at all (``page_pool.py``, "Spans"; :meth:`SlotMapper._claim_plan`)."""
        seen: set[int] = set()
        for p, span in self.pool.span_of.items():
            if id(span) in seen:
                continue
            seen.add(id(span))
            got = [walk.get(q) for q in span.pages]
            if any(g is None for g in got):
                raise AssertionError(f"span {span.pages} is in use but not mapped whole")
            (r0, u0), slots, _ = got[0]
            if len(slots) != 1:
                raise AssertionError(f"span {span.pages} is mapped in slots {sorted(slots)}")
            for i, ((r, u), ss, _) in enumerate(got):
                if (r, u) != (r0, u0 + i) or ss != slots:
                    raise AssertionError(f"span {span.pages}: page {i} at {(r, u)} in {sorted(ss)}, "
                                         f"expected {(r0, u0 + i)} in {sorted(slots)}")
            claimed = {bool(c) for *_, c in got}
            if len(claimed) > 1:
                raise AssertionError(f"span {span.pages} in slot {min(slots)} is claimed in part "
                                     f"(units {u0}..{u0 + len(span) - 1})")

    def close(self) -> None:
        """Unmap everything (after all queued work), release the pages and the reservations."""
        self._sync()
        self.unpark_all()
        self.prefix.clear()
        for slot in self.slots:
            self._set_claimed(slot, 0)
            slot.seq_id = None
            for u in sorted(slot.units):
                for r in range(self.num_res):
                    if slot.page(u, r) is not None:
                        self._unmap(slot, u, r)
        self.free_slots = FreeSlotIndex(len(self.slots))
        self.pool.close()
        for va in self.bases:
            self.driver.free_reservation(va, self.layout.reservation_bytes)
        self.bases = []
