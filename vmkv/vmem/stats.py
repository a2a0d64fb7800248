"""The vmem cache's views and introspection: slot views, capacity, usage, map/unmap statistics and
integrity checks (a mixin of :class:`~vmkv.vmem.cache.VMemKVCache`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vmkv.vmem.checks import check_mapper, mapper_stats

if TYPE_CHECKING:
    import torch

__all__ = ["VMemStatsMixin"]

logger = logging.getLogger(__name__)


class VMemStatsMixin:
    """Needs ``layout``, ``mapper``, ``pool``, ``driver``, ``prefix``, ``seqs`` of the cache."""

    # ------------------------------------------------------------------ views
    @property
    def page_size_bytes(self) -> int:
        return self.layout.page_size_bytes

    def slot_of(self, seq_id: int) -> int:
        """The slot index of a live sequence."""
        self._check_open()
        return self.seqs.get(seq_id).units.index

    def key_view(self, layer: int) -> torch.Tensor:
        """``[max_num_seqs, max_model_len, H, D]`` K view of ``layer`` (only backed positions may be
        touched)."""
        self._check_open()
        self._check_layer(layer)
        return self._k[layer]

    def value_view(self, layer: int) -> torch.Tensor:
        self._check_open()
        self._check_layer(layer)
        return self._v[layer]

    # ------------------------------------------------------------------ capacity
    def _free_tokens(self) -> int:
        """Token positions the obtainable pages can back, pool-wide (not capped at max_model_len;
        the same meaning as the paged backend's free blocks x block_size)."""
        units = self.mapper.available_pages() // self.layout.pages_per_unit
        return units * self.layout.page_size_bytes // self.layout.row_token_bytes

    def _can_back(self, n: int) -> bool:
        return self.layout.num_units(n) * self.layout.pages_per_unit <= self.mapper.available_pages()

    # ------------------------------------------------------------------ usage counters
    # allocated pages are the page table's counter; used bytes are every sequence's bytes
    # (sum of seq_len, the core's counter) less the bytes counted twice: a page claimed by k
    # slots counts k - 1 times extra.  A shared page's content cannot change while it is shared
    # (a write or growth into it copies it first), so what was added when it got shared is
    # exactly what is taken back when a claim on it goes.
    def _shared_bytes_of(self, slot, units, num_tokens: int, reservations=None) -> int:
        """Bytes of the claimed mappings among ``units`` of ``slot`` whose page another slot also
        claims (each such mapping adds its page's used bytes to the double count)."""
        table, res = self.mapper.table, reservations
        if slot.index not in table.shared_positions:
            return 0                        # no page of the slot is mapped twice, so none is claimed twice
        total = 0
        for u in units:
            if u >= slot.claimed:
                continue
            used = self.layout.unit_used_bytes(num_tokens, u)
            pages = slot.units.get(u, ())
            for r in (range(len(pages)) if res is None else res):
                if pages[r] is not None and table.num_claimed(pages[r]) >= 2:
                    total += used
        return total

    def _memory_usage(self) -> dict:
        """O(1): counters kept by the operations (checked against :meth:`_usage_walk`)."""
        page = self.layout.page_size_bytes
        allocated = self.mapper.num_allocated_pages() * page
        used = (self.seqs.num_used_tokens * self.layout.row_token_bytes * self.layout.pages_per_unit
                - self._shared_used_bytes)
        return dict(allocated_bytes=allocated, waste_bytes=allocated - used,
                    capacity_bytes=self.pool.max_pages * page,
                    mapped_bytes=self.mapper.num_mapped_pages() * page,
                    created_bytes=self.pool.num_created * page,
                    reserved_bytes=self.layout.num_reservations * self.layout.reservation_bytes,
                    free_tokens=self._free_tokens())

    def _usage_walk(self) -> tuple[int, int]:
        """``(allocated_bytes, waste_bytes)`` by a walk over every claimed unit."""
        page = self.layout.page_size_bytes
        used: dict[int, int] = {}
        for seq in self.seqs.values():
            slot = seq.units
            for u in range(slot.claimed):
                b = self.layout.unit_used_bytes(seq.seq_len, u)
                for p in slot.units[u]:
                    if used.get(p, -1) < b:
                        used[p] = b
        allocated = len(used) * page
        return allocated, allocated - sum(used.values())

    def _check_usage(self) -> None:
        counted = self._memory_usage()
        walked = self._usage_walk()
        if (counted["allocated_bytes"], counted["waste_bytes"]) != walked:
            raise AssertionError(f"usage counters (allocated, waste) = ({counted['allocated_bytes']}, "
                                 f"{counted['waste_bytes']}) bytes, a walk over the units gives {walked}")

    def backend_stats(self) -> dict:
        """Map/unmap counts and latency (us, p50/p99), reclamation, copy-on-write and the total time
        spent in allocation (allocate/extend/fork/free and prepare's copy-on-write), for benchmarks.

        ``map_us_*`` are per page (a batch's wall time / its pages); ``map_batch_us_*``,
        ``pages_per_batch_*``, ``num_map_batches`` and ``num_set_access_calls`` describe the batches.
        ``prefetch_time_us`` / ``num_prefetched_pages``: time and pages of :meth:`prefetch` (not in
        ``alloc_time_us``)."""
        self._check_open()
        stats = mapper_stats(self.mapper)
        stats.update({
            "num_topped_up_pages": self.elastic.num_topped_up_pages,
            "num_cow_copies": self.num_cow_copies,
            "alloc_time_us": self._alloc_ns / 1e3,
            "prefetch_time_us": self._prefetch_ns / 1e3,
            "page_size_bytes": self.layout.page_size_bytes,
            "pages_per_unit": self.layout.pages_per_unit,
            "num_prefix_entries": len(self.prefix),
            "created_bytes": self.pool.num_created * self.layout.page_size_bytes,
            "kv_reserve_bytes": self.kv_reserve_bytes,
            "driver": self.driver.name,
            "layout": self.layout.name,
        })
        return stats

    #: the name benchmarks used before :meth:`KVCache.backend_stats`
    def vmm_stats(self) -> dict:
        """Alias of :meth:`backend_stats`."""
        return self.backend_stats()

    def map_latency_samples_us(self) -> tuple[list[float], list[float]]:
        """Raw ``(map_us, unmap_us)`` samples (the most recent 100k of each); a map sample is per
        page: its batch's wall time / the batch's pages."""
        return list(self.mapper.map_us), list(self.mapper.unmap_us)

    def backend_samples(self) -> dict[str, list[float]]:
        """:meth:`KVCache.backend_samples`: ``map_us`` and ``unmap_us`` of :meth:`map_latency_samples_us`
        (counted by ``backend_stats()``' ``num_maps`` / ``num_unmaps``)."""
        map_us, unmap_us = self.map_latency_samples_us()
        return {"map_us": map_us, "unmap_us": unmap_us}

    def map_batch_samples(self) -> tuple[list[float], list[int]]:
        """Raw ``(batch wall time us, pages in the batch)`` of the most recent 100k map batches."""
        return list(self.mapper.map_batch_us), list(self.mapper.pages_per_batch)

    def _check_units(self) -> None:
        check_mapper(self.mapper)
        self._check_usage()
        unbacked = self.layout.unbacked_anchors(self.driver, self.base_tensors)
        if unbacked:
            raise AssertionError(f"kernel launches would receive unbacked addresses {unbacked}")
        live = {s.index: s for s in self.mapper.slots if not s.is_free}
        if len(live) != len(self.seqs):
            raise AssertionError(f"{len(live)} live slots for {len(self.seqs)} sequences")
        for seq in self.seqs.values():
            slot = seq.units
            if live.get(slot.index) is not slot or slot.seq_id != seq.seq_id:
                raise AssertionError(f"sequence {seq.seq_id!r} owns slot {slot.index}, which holds "
                                     f"{slot.seq_id!r}")
            need = self.layout.num_units(seq.seq_len)
            if slot.claimed < need:
                raise AssertionError(f"sequence {seq.seq_id!r}: seq_len {seq.seq_len} needs {need} "
                                     f"units, slot claims {slot.claimed}")

    def _warn_map_count(self, max_pages: int) -> None:
        if self.driver.name != "host":
            return
        try:
            with open("/proc/sys/vm/max_map_count") as f:
                limit = int(f.read())
        except (OSError, ValueError):
            return
        # each mapped page may split its reservation's mapping in two
        if 2 * max_pages + 2 * self.layout.num_reservations > limit:
            logger.warning("up to %d host mappings may exceed vm.max_map_count=%d; raise "
                           "page_size_bytes or the sysctl", 2 * max_pages, limit)
