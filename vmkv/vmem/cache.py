"""``VMemKVCache``: KV cache in virtually contiguous slots backed by pages mapped on demand.

The vAttention design (Prabhu et al., "vAttention: Dynamic Memory Management for Serving LLMs
without PagedAttention", ASPLOS'25): every request gets a **slot**, a row of a virtual reservation
``[max_num_seqs, max_model_len, ...]`` reserved once; physical **pages** are mapped into the slot only
as its sequence grows (section 5), so attention reads plain strided tensors and needs no block table.
Freed slots keep their pages mapped (deferred reclamation, section 6.2) and the next request takes
the best-fitting one; pages are unmapped when the pool runs short (``reclaim.py``), and what is made
ahead of need and given back when demand falls is one policy (``elastic.py``).  On top of the paper: fork
and page-aligned prefix sharing map one physical page into several slots with reference counts, and
the first write into a shared page copies it (copy-on-write).  See DESIGN.md, "vmem backend".

The sequence table, validation, prefix caching, written marks, the copy-on-write protocol and the
``prepare()`` skeleton are the shared core's (:class:`~vmkv.kvcache.core.KVCacheCore`); the page
bookkeeping is the :class:`~vmkv.vmem.mapper.SlotMapper`'s (torch-free); ``backing.py`` builds the
driver, layout, pool, mapper and views; ``stats.py`` holds views, usage and statistics.  This
module holds the hooks and the calls the engine makes between steps.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Sequence

import numpy as np
import torch

from vmkv.kernels import ops
from vmkv.kvcache.core import KVCacheCore, Room
from vmkv.kvcache.errors import SlotsExhaustedError
from vmkv.kvcache.metadata import build_metadata, step_token_positions
from vmkv.kvcache.records import AttentionMetadata, StepSeq
from vmkv.kvcache.seqtable import SeqState, check_count
from vmkv.kvcache.spec import KVCacheSpec
from vmkv.vmem.backing import build_backing, default_host_page_size
from vmkv.vmem.driver import VMMDriver
from vmkv.vmem.elastic import ElasticPolicy
from vmkv.vmem.options import (ATTENTION_IMPLS, DEFAULT_KV_RESERVE_BYTES, DEFAULT_KV_SHRINK_GRACE_S,
                               VMemOptions)
from vmkv.vmem.page_pool import creation_out_of_memory, out_of_memory_is_full
from vmkv.vmem.placement import pick_fork_slot, pick_slot
from vmkv.vmem.protocol import VMMError
from vmkv.vmem.stats import VMemStatsMixin

__all__ = ["VMemKVCache", "SlotsExhaustedError", "default_host_page_size"]

logger = logging.getLogger(__name__)


class VMemKVCache(VMemStatsMixin, KVCacheCore):
    """vmem backend of :class:`~vmkv.kvcache.base.KVCache` (see the module docstring).

    Args:
        spec: KV shape, dtype and device.
        max_num_seqs: slots (live sequences at most).
        max_model_len: positions per slot.
        memory_bytes: physical budget; ``memory_bytes // page_size_bytes`` pages at most.
        driver: ``"auto"`` | ``"cuda"`` | ``"host"`` or a :class:`VMMDriver` the caller owns (not
            closed by the cache; tests pass a checked driver around one).
        layout: ``"megacache"`` (one reservation, a page covers all layers of a token range) or
            ``"per_layer"`` (``2 * num_layers`` reservations).
        page_size_bytes: page size; default: CUDA allocation granularity (2 MiB) or
            :func:`default_host_page_size`.
        enable_prefix_caching: share full pages of identical prompt prefixes (needs an integral
            number of tokens per page; otherwise disabled with a log message).
        lookahead_tokens: also map (best effort, from free pool pages) the pages of this many
            positions past ``seq_len``; these pages are claimed.  :meth:`prefetch` is the engine's
            alternative that keeps them reclaimable.
        preallocate: create every page up front instead of on first use.
        attention_impl: ``vmkv.kernels.ops.contiguous_attention`` implementation: ``"auto"``,
            ``"triton"``, ``"torch"`` or ``"sdpa"`` (unmodified SDPA on the slot views).
        kv_reserve_bytes, kv_shrink_grace_s: elastic memory (:meth:`release_idle`, ``elastic.py``):
            ``kv_reserve_bytes`` of idle pages are kept ahead of need, and pages beyond the
            high-water mark of demand over ``kv_shrink_grace_s`` seconds are released (0: at once;
            negative or ``inf``: never; off with ``preallocate``); ``memory_bytes`` is the cap.
    Raises:
        ValueError: a bad argument (names the value and the allowed range).
        VMMError: a virtual-memory call failed.
    """

    backend = "vmem"
    _meta_field = "slot_indices"

    def __init__(self, spec: KVCacheSpec, *, max_num_seqs: int, max_model_len: int, memory_bytes: int,
                 driver: str | VMMDriver = "auto", layout: str = "megacache",
                 page_size_bytes: int | None = None, enable_prefix_caching: bool = True,
                 lookahead_tokens: int = 0, preallocate: bool = False,
                 attention_impl: str = "auto", kv_reserve_bytes: int = DEFAULT_KV_RESERVE_BYTES,
                 kv_shrink_grace_s: float = DEFAULT_KV_SHRINK_GRACE_S) -> None:
        super().__init__(spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         memory_bytes=memory_bytes)
        self.lookahead_tokens = check_count("lookahead_tokens", lookahead_tokens, 0)
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
        self.attention_impl = attention_impl
        for name, value in (("kv_reserve_bytes", kv_reserve_bytes), ("kv_shrink_grace_s", kv_shrink_grace_s)):
            VMemOptions.check_field(name, value, owner="VMemKVCache")
        self.kv_reserve_bytes, self.kv_shrink_grace_s = kv_reserve_bytes, float(kv_shrink_grace_s)
        b = build_backing(spec, max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                          memory_bytes=self.memory_bytes, driver=driver, layout=layout,
                          page_size_bytes=page_size_bytes, preallocate=preallocate, prefix=self.prefix)
        self.driver, self._owns_driver, self.layout, self.pool, self.mapper = (
            b.driver, b.owns_driver, b.layout, b.pool, b.mapper)
        self.base_tensors, self._k, self._v = b.base_tensors, b.keys, b.values
        self._k_anchor, self._v_anchor = b.key_anchors, b.value_anchors
        max_pages, page = b.max_pages, b.layout.page_size_bytes
        self.unit_tokens = self.layout.unit_tokens
        self.enable_prefix_caching = bool(enable_prefix_caching) and self.unit_tokens > 0
        if enable_prefix_caching and not self.enable_prefix_caching:
            logger.info("vmem prefix caching disabled: a %d-byte page holds %s tokens (not integral)",
                        page, self.layout.tokens_per_page)
        self._prefetch_ns = 0
        self._shared_used_bytes = 0     # bytes counted twice in the sum of seq_len (stats.py)
        # elastic memory (elastic.py): a preallocated pool is held for good
        self.elastic = ElasticPolicy(self.mapper, kv_reserve_bytes // page,
                                     math.inf if preallocate else self.kv_shrink_grace_s,
                                     self.max_model_len, self.lookahead_tokens)
        self._init_core()
        self._warn_map_count(max_pages)
        logger.info("vmem cache: %s, driver %s, %d pages max", self.layout.describe(), self.driver.name,
                    max_pages)

    # ------------------------------------------------------------------ lifecycle hooks
    def _plan_allocate(self, n: int, hits: list) -> Room:
        num_units = self.layout.num_units(n)
        hits = [e.handles for e in hits]
        slot = pick_slot(self.mapper, num_units, hits)
        fresh, available = self.mapper.plan_occupy(slot, num_units, hits)
        page = self.layout.page_size_bytes
        return Room(fresh, available, n, self._free_tokens,
                    lambda: f"needs {fresh} more pages of {page} B, {available} obtainable",
                    (slot, num_units, hits))

    def _occupy(self, seq_id, n: int, hits: list, room: Room):
        slot, num_units, hit_pages = room.payload
        table = self.mapper.table
        shared = sum(self.layout.unit_used_bytes(n, u) for u, pages in enumerate(hit_pages)
                     for p in pages if table.num_claimed(p)) if hit_pages else 0
        with out_of_memory_is_full(self.driver, n):
            self.mapper.occupy(slot, seq_id, num_units, hit_pages)
        self._shared_used_bytes += shared
        self.elastic.map_ahead(slot, n)
        return slot, None

    def _plan_extend(self, s: SeqState, new_len: int) -> Room | None:
        slot, layout = s.units, self.layout
        new_units = layout.units_overlapping(s.seq_len, new_len)
        # fast path (most decode steps): the positions lie in claimed, unshared units and the
        # look-ahead target is already claimed: no page to map or copy
        ahead_len = min(self.max_model_len, new_len + self.lookahead_tokens)
        if layout.num_units(ahead_len) <= slot.claimed and not self.mapper.any_shared(slot, new_units):
            return None
        num_units = max(slot.claimed, layout.num_units(new_len))
        cow = [u for u in new_units if u < slot.claimed]
        fresh, available = self.mapper.plan_grow(slot, num_units, cow)
        return Room(fresh, available, new_len - s.seq_len,
                    self._extend_room_tokens(s, cow) if fresh > available else 0,
                    lambda: f"sequence {s.seq_id!r} needs {fresh} more pages, {available} obtainable",
                    (num_units, cow))

    def _extend_room_tokens(self, s: SeqState, cow: list) -> int:
        """Positions ``s`` could still grow by (the error's ``available_tokens``; only on a refusal)."""
        layout = self.layout
        # any growth first needs the copy of the shared unit at seq_len, then whole units
        spare = self.mapper.available_pages() - self.mapper.plan_writable(
            s.units, cow, range(layout.num_reservations))
        return 0 if spare < 0 else max(0, layout.max_tokens_for_units(
            s.units.claimed + spare // layout.pages_per_unit) - s.seq_len)

    def _grow(self, s: SeqState, new_len: int, room: Room) -> list:
        num_units, cow = room.payload
        shared = self._shared_bytes_of(s.units, cow, s.seq_len)
        with out_of_memory_is_full(self.driver, new_len - s.seq_len):
            pairs = self.mapper.grow(s.units, num_units, cow,
                                     copy_below_bytes=s.seq_len * self.layout.row_token_bytes)
        self._shared_used_bytes -= shared
        self.elastic.map_ahead(s.units, new_len)
        return pairs

    def _share(self, parent: SeqState, child_id):
        num_units = self.layout.num_units(parent.seq_len)
        slot = pick_fork_slot(self.mapper, parent.units, num_units)
        with out_of_memory_is_full(self.driver, parent.seq_len):
            self.mapper.share(slot, parent.units, child_id, num_units)
        self._shared_used_bytes += parent.seq_len * self.layout.row_token_bytes * self.layout.pages_per_unit
        self.elastic.map_ahead(slot, parent.seq_len)
        return slot, None

    def _release(self, s: SeqState) -> None:
        self._shared_used_bytes -= self._shared_bytes_of(s.units, range(s.units.claimed), s.seq_len)
        self.mapper.vacate(s.units)

    def _forget_unit(self, s: SeqState, u: int) -> None:
        for page in s.units.units[u]:
            self.pool.forget(page)

    def _register_unit(self, s: SeqState, key, parent, u: int):
        return self.prefix.register(key, parent, tuple(s.units.units[u]))

    def _units_overlapping(self, start: int, end: int) -> range:
        return self.layout.units_overlapping(start, end)

    def _plan_cow(self, targets: list, layers, num_tokens: int) -> Room | None:
        if layers is None:
            res = tuple(range(self.layout.num_reservations))
        else:   # write(): also drops the prefix entries of the unshared pages it overwrites
            res = tuple(sorted({r for layer in layers for r in self.layout.reservations_for_layer(layer)}))
        if layers is None:
            targets = [(s, units) for s, units in targets if self.mapper.any_shared(s.units, units)]
            if not targets:
                return None
        need = sum(self.mapper.plan_writable(s.units, units, res) for s, units in targets)
        available = self.mapper.available_pages()
        return Room(need, available, num_tokens, 0,
                    f"copy-on-write of {need} shared pages, {available} obtainable", (targets, res))

    def _apply_cow(self, room: Room) -> list:
        targets, res = room.payload
        pairs = []
        with out_of_memory_is_full(self.driver, 0):
            # every copy's page first, so that running out of memory changes nothing (mapper)
            fresh = self.mapper.acquire_for_cow([(s.units, units) for s, units in targets], res)
            try:
                for s, units in targets:
                    shared = self._shared_bytes_of(s.units, units, s.seq_len, res)
                    pairs += self.mapper.make_writable(s.units, units, res, fresh=fresh)
                    self._shared_used_bytes -= shared
            finally:
                self.mapper.give_back_fresh(fresh)
        return pairs

    def copy_units(self, pairs: Sequence[tuple]) -> None:
        """Copy each planned page ``(src_va, dst_va, src_slot, unit)`` (stream ordered on CUDA), in
        reverse planning order (a later copy-on-write may have remapped an earlier source)."""
        for src_va, dst_va, *_ in reversed(pairs):
            self.driver.copy_page(dst_va, src_va)
        self.mapper.copied(pairs)

    # ------------------------------------------------------------------ between steps (elastic.py)
    def prefetch(self, seq_ids: Sequence[int], num_tokens: int) -> None:
        """Map ahead, off the critical path: back positions up to ``seq_len + num_tokens`` of each
        live sequence in ``seq_ids`` now (unknown ids are skipped), so the ``extend`` calls that reach
        them find their pages mapped and make no driver call (vAttention, Prabhu et al., ASPLOS'25,
        section 6.1: overlap memory allocation with compute).

        Best effort: only free pool pages are used (no reclaiming, no fence wait), units holding a
        shared page are left alone, ``seq_len`` does not change.  The pages are not claimed: they stay
        reclaimable, so they count in ``usage().free_tokens`` and ``can_allocate``;
        ``usage().mapped_bytes`` includes them, ``allocated_bytes`` does not until ``extend`` reaches
        them.  Then the reserve is topped up.

        Args:
            seq_ids: sequence ids.
            num_tokens: look-ahead in positions, an int >= 0 (0 does nothing).
        Raises:
            ValueError: ``num_tokens`` is not an int >= 0.  VMMError: a driver call failed (the batch
            is undone; the cache stays consistent), except a page creation out of memory, which ends
            the prefetch quietly.  Never KVCacheFullError.
        """
        self._check_open()
        num_tokens = check_count("num_tokens", num_tokens, 0)
        if not num_tokens:
            return
        lookup = self.seqs.lookup
        targets = ((seq.units, seq.seq_len + num_tokens) for i in seq_ids if (seq := lookup(i)) is not None)
        self._between_steps(self.elastic.prefetch, targets, bool(len(self.seqs)))

    @property
    def wants_admission_hints(self) -> bool:
        return True

    def prefetch_admission(self, num_tokens: Sequence[int], token_ids: Sequence | None = None,
                           extra_keys: Sequence | None = None) -> None:
        """Map, off the critical path, the pages of the admissions expected next (prompt lengths in
        admission order, plus the look-ahead): each gets the free slot :func:`pick_slot` would give it;
        its prefix-cache hits (when ``token_ids`` are given; looked up without counting) are mapped
        into it and its other holes filled from free pool pages, all unclaimed, so the ``allocate``
        that follows finds them in place and makes no driver call.  Then the reserve is topped up.
        Best effort (a page creation out of memory ends it quietly); never raises KVCacheFullError;
        time counted with :meth:`prefetch`."""
        self._check_open()

        def hits_of(i: int) -> list:       # looked up only for an admission the pool can still back
            ids = None if token_ids is None else token_ids[i]
            if ids is None or not (self.enable_prefix_caching and self.unit_tokens):
                return []
            extra = None if extra_keys is None else extra_keys[i]
            return [e.handles for e in self.prefix.lookup(ids, self.unit_tokens, extra).hits]
        self._between_steps(self.elastic.prefetch_admissions, num_tokens, hits_of, bool(len(self.seqs)))

    def _between_steps(self, fn, *args) -> None:
        t0 = time.perf_counter_ns()
        try:
            fn(*args)
        except VMMError as e:
            if not creation_out_of_memory(self.driver, e):
                raise
        finally:
            self._prefetch_ns += time.perf_counter_ns() - t0

    def release_idle(self, now: float | None = None, num_waiting: int = 0) -> int:
        """:meth:`KVCache.release_idle`: top the reserve (``kv_reserve_bytes``) up ahead of need, then
        give back to the driver (``cuMemUnmap`` + ``cuMemRelease``; host: unmap +
        ``fallocate(PUNCH_HOLE)``) the idle pages beyond the high-water mark of demand over
        ``kv_shrink_grace_s``, with hysteresis, nothing while requests wait and at most
        ``RELEASE_PAGES_PER_CALL`` per call while sequences are live (the rules:
        :mod:`vmkv.vmem.elastic`).  Never waits for a fence, never touches a claimed page.

        Args:
            now: ``time.monotonic()`` seconds (default: now); tests pass a fake clock.
            num_waiting: requests waiting for admission (the engine's queue).
        Returns:
            Bytes released (0 most calls; pages the top-up created are not subtracted).
        Raises:
            VMMError: a driver call failed other than a top-up's creation out of memory (the cache
            stays consistent).
        """
        self._check_open()
        now = time.monotonic() if now is None else float(now)
        if not math.isfinite(now):
            raise ValueError(f"release_idle: now must be a finite number of seconds, got {now!r}")
        num_waiting = check_count("num_waiting", num_waiting, 0)
        released = self.elastic.release_idle(now, bool(len(self.seqs)), num_waiting)
        if released:
            logger.debug("released %d idle pages (%d created)", released, self.pool.num_created)
        return released * self.layout.page_size_bytes

    # ------------------------------------------------------------------ data hooks
    def _write_rows(self, s: SeqState, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[0]
        self._k[layer][s.units.index, start:start + n] = k
        self._v[layer][s.units.index, start:start + n] = v

    def _gather(self, s: SeqState, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        i, length = s.units.index, s.seq_len
        return (self._k[layer][i, :length].clone(memory_format=torch.contiguous_format),
                self._v[layer][i, :length].clone(memory_format=torch.contiguous_format))

    def _build_metadata(self, batch: Sequence[StepSeq], states: list[SeqState], pad_to: int | None,
                        out: torch.Tensor | None) -> AttentionMetadata:
        """``slot_indices int32 [num_seqs]`` and the flat write index ``slot * max_model_len + pos``
        into the ``[max_num_seqs, max_model_len, H, D]`` views."""
        slot_list = [s.units.index for s in states]
        seq_index, positions = step_token_positions(batch) if batch else (np.zeros(0, np.int64),) * 2
        slot_mapping = np.asarray(slot_list, dtype=np.int64)[seq_index] * self.max_model_len + positions
        return build_metadata(batch, device=self.spec.torch_device, slot_mapping=slot_mapping,
                              slot_indices=slot_list, pad_to=pad_to, out=out, staging=self._staging,
                              plan=lambda rows, longest: ops.plan_decode(
                                  rows, self.spec.num_kv_heads,
                                  self.max_model_len if pad_to is not None else longest,
                                  self.spec.torch_device, self.spec.dtype, self.spec.head_dim))

    @property
    def supports_cuda_graphs(self) -> bool:
        """Slots sit at fixed virtual addresses, so a graph stays valid while pages are mapped under
        it (vAttention, section 6); needs the Triton attention path on CUDA."""
        return self.attention_impl in ("auto", "triton") and ops.plan_decode(
            1, self.spec.num_kv_heads, 1, self.spec.torch_device, self.spec.dtype, self.spec.head_dim) > 0

    def _graph_table_width(self) -> int:
        return 0

    def _scatter(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        ops.write_kv(self._k[layer], self._v[layer], k, v, meta.slot_mapping,
                     key_anchor=self._k_anchor[layer], value_anchor=self._v_anchor[layer])

    def _attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        extra = {} if self.attention_impl == "auto" else {"impl": self.attention_impl}
        return ops.contiguous_attention(
            q, self._k[layer], self._v[layer], meta.slot_indices, meta.query_start_loc, meta.seq_lens,
            seq_lens_host=meta.seq_lens_host, query_lens_host=meta.query_lens_host,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, scale=scale,
            slot_indices_host=meta.slot_indices_host, key_anchor=self._k_anchor[layer],
            value_anchor=self._v_anchor[layer], num_splits=meta.num_splits, workspace=meta.workspace,
            num_decodes=meta.num_decodes, **extra)

    def _close(self) -> None:
        self._k = self._v = self._k_anchor = self._v_anchor = None
        self.base_tensors = []
        self.mapper.close()
        if self._owns_driver:
            self.driver.close()
