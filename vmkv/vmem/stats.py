"""The vmem cache's views, introspection and off-critical-path work: slot views, usage, map/unmap statistics,
integrity checks and prefetch (a mixin of :class:`~vmkv.vmem.cache.VMemKVCache`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Sequence

from vmkv.kvcache.seqtable import check_count
from vmkv.vmem.page_pool import creation_out_of_memory
from vmkv.vmem.placement import pick_slot
from vmkv.vmem.protocol import VMMError

if TYPE_CHECKING:
    import torch

__all__ = ["VMemStatsMixin", "RELEASE_PAGES_PER_CALL", "TOP_UP_PAGES_PER_CALL"]

logger = logging.getLogger(__name__)

#: pages :meth:`VMemStatsMixin.release_idle` releases per call at most while sequences are live
RELEASE_PAGES_PER_CALL = 32
#: pages a top-up (:meth:`VMemStatsMixin.release_idle`, :meth:`VMemStatsMixin.prefetch`) creates per
#: call at most while sequences are live (the whole reserve when none is)
TOP_UP_PAGES_PER_CALL = 32


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

    def prefetch(self, seq_ids: Sequence[int], num_tokens: int) -> None:
        """Map ahead, off the critical path: back positions up to ``seq_len + num_tokens`` of each
        live sequence in ``seq_ids`` now (unknown ids are skipped), so the ``extend`` calls that
        reach them find their pages mapped and make no driver call (vAttention, Prabhu et al.,
        ASPLOS'25, section 6.1: overlap memory allocation with compute).

        Best effort: only free pool pages are used (no reclaiming, no fence wait), units holding
        a shared page are left alone, ``seq_len`` does not change.  The pages are not claimed: they
        stay reclaimable, so they count in ``usage().free_tokens`` and ``can_allocate`` and an
        admission that needs them unmaps them; ``usage().mapped_bytes`` includes them,
        ``allocated_bytes`` does not until ``extend`` reaches them.  Each sequence's pages are
        mapped in one batch (one ``set_access`` per run of adjacent pages).  Then the reserve is
        topped up (:meth:`release_idle`).

        Args:
            seq_ids: sequence ids.
            num_tokens: look-ahead in positions, an int >= 0 (0 does nothing).
        Raises:
            ValueError: ``num_tokens`` is not an int >= 0.  VMMError: a driver call failed (the
            batch is undone; the cache stays consistent), except a page creation out of memory,
            which ends the prefetch quietly.  Never KVCacheFullError.
        """
        self._check_open()
        num_tokens = check_count("num_tokens", num_tokens, 0)
        if not num_tokens:
            return
        t0 = time.perf_counter_ns()
        try:
            mapper, lookup, num_units = self.mapper, self.seqs.lookup, self.layout.num_units
            available = mapper.pool.num_available          # changes only when pages get mapped
            for seq_id in seq_ids:
                if available == 0:
                    break
                seq = lookup(seq_id)
                if seq is None:
                    continue
                if mapper.prefetch(seq.units, num_units(min(self.max_model_len, seq.seq_len + num_tokens))):
                    available = mapper.pool.num_available
            self._top_up()
        except VMMError as e:
            if not creation_out_of_memory(self.driver, e):
                raise
        finally:
            self._prefetch_ns += time.perf_counter_ns() - t0

    @property
    def wants_admission_hints(self) -> bool:
        return True

    def prefetch_admission(self, num_tokens: Sequence[int], token_ids: Sequence | None = None,
                           extra_keys: Sequence | None = None) -> None:
        """Map, off the critical path, the pages of the admissions expected next (prompt lengths in
        admission order, plus the look-ahead): each gets the free slot :func:`pick_slot` would give
        it; its prefix-cache hits (when ``token_ids`` are given; looked up without counting) are
        mapped into it, and its other holes filled from free pool pages, all unclaimed
        (:meth:`SlotMapper.prefetch`; no reclaiming, no fence wait), so the ``allocate`` that follows
        finds them in place and makes no driver call.  Then the reserve is topped up (:meth:`release_idle`).
        Best effort (a page creation out of memory ends it quietly); never raises KVCacheFullError;
        time counted with :meth:`prefetch`."""
        self._check_open()
        t0 = time.perf_counter_ns()
        taken: set[int] = set()
        try:
            for i, n in enumerate(num_tokens):
                if self.mapper.pool.num_plain_available == 0:
                    break
                hits: list = []
                ids = None if token_ids is None else token_ids[i]
                if ids is not None and self.enable_prefix_caching and self.unit_tokens:
                    extra = None if extra_keys is None else extra_keys[i]
                    hits = [e.handles for e in self.prefix.lookup(ids, self.unit_tokens, extra).hits]
                units = self.layout.num_units(min(self.max_model_len, int(n) + self.lookahead_tokens))
                slot = pick_slot(self.mapper, units, hits, frozenset(taken))
                if slot is None:
                    break
                taken.add(slot.index)
                self.mapper.prefetch(slot, units, hits)
            self._top_up()
        except VMMError as e:
            if not creation_out_of_memory(self.driver, e):
                raise
        finally:
            self._prefetch_ns += time.perf_counter_ns() - t0

    def release_idle(self, now: float | None = None) -> int:
        """:meth:`KVCache.release_idle`: give idle physical pages back to the driver (``cuMemUnmap`` +
        ``cuMemRelease``; host: unmap + ``fallocate(PUNCH_HOLE)``) once they have stayed above
        ``kv_reserve_bytes`` for ``kv_shrink_grace_s`` (rules and order: :mod:`vmkv.vmem.elastic`).
        Never waits for a fence (a page whose kernels may still run waits for a later call), never
        touches a claimed page; while sequences are live at most :data:`RELEASE_PAGES_PER_CALL` pages
        go per call (the step's critical path stays short), all of them when none is.

        First it tops the reserve up ahead of need: while fewer than ``kv_reserve_bytes`` of pages
        are plain free (while sequences are live: kept pages of freed slots do not count) or idle
        (while none is; :mod:`vmkv.vmem.elastic`), plain free pages are created (never beyond
        ``memory_bytes``; at most :data:`TOP_UP_PAGES_PER_CALL` per call while sequences are live),
        so the next grows and admissions find created pages; a creation out of memory ends the
        top-up quietly (``backend_stats()["num_topped_up_pages"]`` counts them).  A span
        (:mod:`vmkv.vmem.page_pool`) is released only whole, which can take the idle pages below
        the reserve; the top-up runs again after the release and creates them back.

        Args:
            now: ``time.monotonic()`` seconds (default: now); tests pass a fake clock.
        Returns:
            Bytes released (0 most calls; pages the top-up created are not subtracted).
        Raises:
            VMMError: a driver call failed other than a top-up's creation out of memory (the cache
            stays consistent).
        """
        self._check_open()
        now = time.monotonic() if now is None else float(now)
        self._top_up()                  # first, so that the window sees the reserve as idle
        num = self._idle_window.observe(now, self.mapper.num_idle_pages())
        released = 0
        if num > 0:
            if len(self.seqs):
                num = min(num, RELEASE_PAGES_PER_CALL)
            keep_free, keep_spans = (self.mapper.reserve_split(self._idle_window.reserve_pages)
                                     if len(self.seqs) else (0, 0))
            released = self.mapper.release_idle_pages(num, keep_free=keep_free, keep_spans=keep_spans)
            self._idle_window.released(released)
            if released:
                logger.debug("released %d idle pages (%d created)", released, self.pool.num_created)
                self._top_up()          # a span goes whole: what it took below the reserve comes back
        return released * self.layout.page_size_bytes

    def _top_up(self) -> int:
        """Create pages until ``kv_reserve_bytes`` are plain free, or idle while no sequence is live
        (:meth:`ElasticMixin.top_up_idle`)."""
        live = bool(len(self.seqs))
        limit = TOP_UP_PAGES_PER_CALL if live else self.pool.max_pages
        return self.mapper.top_up_idle(self._idle_window.reserve_pages, limit, live)

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
        stats = self.mapper.stats()
        stats.update({
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
        self.mapper.check_integrity()
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
