"""Introspection of the slot mapper: its statistics and the integrity check that walks every slot and
compares the walk with the page table, the free-slot index, the pool, the prefix index and the driver
(torch-free)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from vmkv.vmem.slots import SlotSpace

__all__ = ["mapper_stats", "check_mapper"]


def _percentile(samples: Iterable[float], q: float) -> float:
    data = sorted(samples)
    if not data:
        return 0.0
    return data[min(len(data) - 1, int(q / 100.0 * len(data)))]


def mapper_stats(m: SlotSpace) -> dict:
    """Counts and latency percentiles (us) of the maps, unmaps, reclamation and parking of ``m``."""
    return {
        "num_maps": m.num_maps,
        "num_unmaps": m.num_unmaps,
        "map_us_p50": _percentile(m.map_us, 50),
        "map_us_p99": _percentile(m.map_us, 99),
        "num_map_batches": m.num_map_batches,
        "num_set_access_calls": m.num_set_access_calls,
        "map_batch_us_p50": _percentile(m.map_batch_us, 50),
        "map_batch_us_p99": _percentile(m.map_batch_us, 99),
        "pages_per_batch_mean": (sum(m.pages_per_batch) / len(m.pages_per_batch)
                                 if m.pages_per_batch else 0.0),
        "pages_per_batch_max": max(m.pages_per_batch, default=0),
        "num_prefetched_pages": m.num_prefetched_pages,
        "unmap_us_p50": _percentile(m.unmap_us, 50),
        "unmap_us_p99": _percentile(m.unmap_us, 99),
        "num_reclaimed_pages": m.num_reclaimed_pages,
        "num_prefix_evictions": m.num_prefix_evictions,
        "num_cached_free_pages": len(m.pool.cached_pages()),
        "num_fence_waits": m.num_fence_waits,
        "num_pages_created": m.pool.num_created,
        "num_released_pages": m.num_released_pages,
        "num_idle_pages": m.num_idle_pages(),
        "num_reused_on_oom": m.num_reused_on_oom,
        "num_parked_slots": m.num_parked_slots,
        "num_parked_pages": m.num_parked_pages,
        "num_parks": m.num_parks,
        "num_adoptions": m.num_adoptions,
    }


def check_mapper(m: SlotSpace) -> None:
    """Walk every slot of ``m`` and compare with the page table, the free-slot index, the pool, the
    prefix index and the driver (:meth:`VMMDriver.check_mappings`: a driver that keeps a mapping table
    compares it).  Raises AssertionError naming the numbers on a difference."""
    walk: dict[int, tuple] = {}        # page -> ((res, unit), slots, claimed mappings)
    expected_va: dict[int, int] = {}   # va -> page
    parked_pages = 0
    for slot in m.slots:
        parked = m.is_parked(slot)
        if parked and not slot.is_free:
            raise AssertionError(f"live slot {slot.index} is parked")
        if slot.is_free and slot.claimed and not parked:
            raise AssertionError(f"free slot {slot.index} claims {slot.claimed} units")
        if parked:
            parked_pages += slot.claimed * m.num_res
            for u in range(slot.claimed):
                for p in slot.units.get(u, ()):
                    if p is not None and (m.pool.refcount(p) != 1 or m.prefix.is_cached(p)):
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
                walk[p] = (pos, slots, claimed + (m.is_claimed(slot, u) or (parked and u < slot.claimed)))
                expected_va[m.va(r, slot.index, u)] = p
    m.free_slots.check({s.index: len(s.units) for s in m.slots if s.is_free})
    if parked_pages != m.num_parked_pages:
        raise AssertionError(f"parked slots hold {parked_pages} claimed pages, the count says "
                             f"{m.num_parked_pages}")
    m.table.check_against(walk)
    m.driver.check_mappings(expected_va)
    unmapped_in_use = [p for p, e in m.table.entries.items() if not e.slots]
    if unmapped_in_use:
        raise AssertionError(f"pages {sorted(unmapped_in_use)} are in use but mapped nowhere "
                             f"(acquired and not given back)")
    stray = m.prefix.handles() - set(walk) - m.pool.cached_pages()
    if stray:
        raise AssertionError(f"prefix entries name {len(stray)} pages neither mapped nor cached free")
    for p, (pos, _, _) in walk.items():
        entry = m.prefix.entry_of(p)
        if entry is not None and (entry.depth, entry.handles.index(p)) != pos[::-1]:
            raise AssertionError(f"page {p} mapped at (reservation, unit) {pos} caches "
                                 f"unit {entry.depth}, reservation {entry.handles.index(p)}")
    missing = (m.pool.cached_pages() | set(walk)) - m.table.last_use.keys()
    if missing:
        raise AssertionError(f"pages {sorted(missing)} have no last-use tick")
    m.pool.check_integrity()
    num_driver_pages = m.driver.num_live_pages
    if num_driver_pages is not None and num_driver_pages != m.pool.num_created:
        raise AssertionError(f"the driver holds {num_driver_pages} pages, the pool created "
                             f"{m.pool.num_created} (a page released twice or never)")
    m.prefix.check_integrity()
