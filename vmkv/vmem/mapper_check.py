"""The slot mapper's introspection: statistics, integrity checks and teardown (a mixin of
:class:`~vmkv.vmem.mapper.SlotMapper`)."""

from __future__ import annotations

import collections
from typing import Iterable

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
