"""``VMemKVCache``: KV cache in virtually contiguous slots backed by pages mapped on demand.

The vAttention design (Prabhu et al., "vAttention: Dynamic Memory Management for Serving LLMs
without PagedAttention", ASPLOS'25): every request gets a **slot**, a row of a virtual reservation
``[max_num_seqs, max_model_len, ...]`` reserved once; physical **pages** are mapped into the slot only
as its sequence grows (section 5), so attention reads plain strided tensors and needs no block table.
Freed slots keep their pages mapped (deferred reclamation, section 6.2) and the next request takes
the best-fitting one; pages are unmapped only when the pool runs short.  On top of the paper: fork
and page-aligned prefix sharing map one physical page into several slots with reference counts, and
the first write into a shared page copies it (copy-on-write).  See DESIGN.md, "vmem backend".
"""

from __future__ import annotations

import logging
import math
import mmap
import time
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np
import torch

from vmkv.kernels import ops
from vmkv.kvcache.base import (
    AttentionMetadata,
    CacheUsage,
    DuplicateSequenceError,
    KVCache,
    KVCacheError,
    KVCacheFullError,
    KVCacheSpec,
    StepSeq,
    UnknownSequenceError,
)
from vmkv.kvcache.metadata import build_metadata, step_token_positions
from vmkv.kvcache.prefix import PrefixChain, PrefixIndex
from vmkv.vmem.driver import DEFAULT_HOST_PAGE_BYTES, VMMDriver, get_driver
from vmkv.vmem.host_driver import HostDriver
from vmkv.vmem.layout import LAYOUTS, make_layout
from vmkv.vmem.mapper import Slot, SlotMapper
from vmkv.vmem.page_pool import PagePool

__all__ = ["VMemKVCache", "SlotsExhaustedError", "default_host_page_size"]

logger = logging.getLogger(__name__)

#: the host driver's default page is the smallest multiple of lcm(OS page, token bytes) >= this ...
_HOST_TARGET_PAGE_BYTES = DEFAULT_HOST_PAGE_BYTES
#: ... unless that lcm exceeds this (then pages hold fractional tokens and prefix caching is off)
_HOST_MAX_PAGE_BYTES = 2 * 1024 * 1024


_ATTENTION_IMPLS = ("auto", "triton", "torch", "sdpa")


class SlotsExhaustedError(KVCacheFullError, ValueError):
    """Every slot (``max_num_seqs`` of them) is live.  Both a full cache and an out-of-range request
    for one more sequence, so it is a :class:`KVCacheFullError` and a ``ValueError``."""


def default_host_page_size(layout: str, spec: KVCacheSpec, max_model_len: int) -> int:
    """Host page size: whole tokens per page (so prefix caching works) and about 64 KiB.

    The smallest multiple of ``lcm(OS page size, bytes of one token in a slot row)`` that is at least
    64 KiB, but no larger than one slot row needs; 64 KiB (fractional tokens per page) when that lcm
    exceeds 2 MiB.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown vmem layout {layout!r}; choose one of {list(LAYOUTS)}")
    token_bytes = LAYOUTS[layout].token_bytes_in_row(spec)
    base = math.lcm(mmap.PAGESIZE, token_bytes)
    if base > _HOST_MAX_PAGE_BYTES:
        return _HOST_TARGET_PAGE_BYTES
    row_bytes = max_model_len * token_bytes
    return base * max(1, min(-(-_HOST_TARGET_PAGE_BYTES // base), -(-row_bytes // base)))


@dataclass
class _Seq:
    seq_id: int
    slot: Slot
    seq_len: int
    written: list[int]      # per layer: positions [0, written) hold K/V (prefix registration;
                            # prepare() stops advancing it once every prompt unit is registered)
    prefix: PrefixChain | None  # the prompt's unit keys and how many are cached (None: no caching)


class VMemKVCache(KVCache):
    """vmem backend of :class:`~vmkv.kvcache.base.KVCache` (see the module docstring).

    Args:
        spec: KV shape, dtype and device.
        max_num_seqs: slots (live sequences at most).
        max_model_len: positions per slot.
        memory_bytes: physical budget; ``memory_bytes // page_size_bytes`` pages at most.
        driver: ``"auto"`` | ``"cuda"`` | ``"host"`` or a :class:`VMMDriver` (not closed by the cache).
        layout: ``"megacache"`` (one reservation, a page covers all layers of a token range) or
            ``"per_layer"`` (``2 * num_layers`` reservations).
        page_size_bytes: page size; default: CUDA allocation granularity (2 MiB) or
            :func:`default_host_page_size`.
        enable_prefix_caching: share full pages of identical prompt prefixes (needs an integral
            number of tokens per page; otherwise disabled with a log message).
        lookahead_tokens: also map (best effort, from free pool pages) the pages of this many
            positions past ``seq_len``, so decode steps rarely map on the critical path.  These
            pages are claimed (held by the sequence, not available to others); :meth:`prefetch`
            is the engine's alternative that keeps them reclaimable.
        preallocate: create every page up front instead of on first use.
        attention_impl: ``vmkv.kernels.ops.contiguous_attention`` implementation: ``"auto"``
            (Triton on CUDA, torch reference on CPU), ``"triton"``, ``"torch"`` or ``"sdpa"``
            (unmodified ``scaled_dot_product_attention`` on the slot views).
    Raises:
        ValueError: a bad argument (names the value and the allowed range).
        VMMError: a virtual-memory call failed.
    """

    backend = "vmem"

    def __init__(self, spec: KVCacheSpec, *, max_num_seqs: int, max_model_len: int, memory_bytes: int,
                 driver: str | VMMDriver = "auto", layout: str = "megacache",
                 page_size_bytes: int | None = None, enable_prefix_caching: bool = True,
                 lookahead_tokens: int = 0, preallocate: bool = False,
                 attention_impl: str = "auto") -> None:
        super().__init__(spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         memory_bytes=memory_bytes)
        if layout not in LAYOUTS:
            raise ValueError(f"unknown vmem layout {layout!r}; choose one of {list(LAYOUTS)}")
        if int(lookahead_tokens) < 0:
            raise ValueError(f"lookahead_tokens must be >= 0, got {lookahead_tokens}")
        if attention_impl not in _ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {_ATTENTION_IMPLS}, got {attention_impl!r}")
        self.attention_impl = attention_impl
        self._closed = True
        self._owns_driver = not isinstance(driver, VMMDriver)
        if self._owns_driver:
            if page_size_bytes is None and (driver == "host" or (driver == "auto" and not spec.is_cuda)):
                page_size_bytes = default_host_page_size(layout, spec, self.max_model_len)
            drv = get_driver(driver, spec.torch_device, page_size_bytes)
        else:
            drv = driver
            if page_size_bytes is not None and page_size_bytes != drv.page_size_bytes:
                raise ValueError(f"page_size_bytes={page_size_bytes} disagrees with the given driver's "
                                 f"{drv.page_size_bytes}; leave it None")
        try:
            if drv.device.type != spec.torch_device.type:
                raise ValueError(f"driver {drv.name!r} serves {drv.device}, spec.device is {spec.device}")
            self.layout = make_layout(layout, spec, self.max_num_seqs, self.max_model_len,
                                      drv.page_size_bytes)
            page = self.layout.page_size_bytes
            max_pages = self.memory_bytes // page
            if max_pages < self.layout.pages_per_unit:
                raise ValueError(
                    f"memory_bytes={self.memory_bytes} holds {max_pages} pages of {page} B; the "
                    f"{layout} layout maps {self.layout.pages_per_unit} page(s) per token range; raise "
                    f"memory_bytes to >= {self.layout.bytes_per_unit} or lower page_size_bytes")
            self.prefix = PrefixIndex()
            self.pool = PagePool(drv, max_pages, preallocate, self.prefix)
            self.mapper = SlotMapper(drv, self.layout, self.pool, self.prefix)
            try:  # kernel launches receive guard addresses, never slot 0's (layout.py, "guard page")
                self.layout.map_guards(drv, self.mapper.bases)
            except BaseException:
                self.mapper.close()
                raise
            self._k, self._v = self.layout.kv_views(self.mapper.base_tensors)
            self._k_anchor, self._v_anchor = self.layout.kv_anchors(self.mapper.base_tensors)
        except BaseException:
            if self._owns_driver:
                drv.close()
            raise
        self.driver = drv
        self._closed = False
        self.lookahead_tokens = int(lookahead_tokens)
        self.unit_tokens = self.layout.unit_tokens
        self.enable_prefix_caching = bool(enable_prefix_caching) and self.unit_tokens > 0
        if enable_prefix_caching and not self.enable_prefix_caching:
            logger.info("vmem prefix caching disabled: a %d-byte page holds %s tokens (not integral)",
                        page, self.layout.tokens_per_page)
        self._seqs: dict[int, _Seq] = {}
        self._alloc_ns = 0
        self._prefetch_ns = 0
        self._warn_map_count(max_pages)
        logger.info("vmem cache: %s, driver %s, %d pages max", self.layout.describe(), drv.name, max_pages)

    def _warn_map_count(self, max_pages: int) -> None:
        if not isinstance(self.driver, HostDriver):
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

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise KVCacheError("this VMemKVCache is closed")

    def _seq(self, seq_id: int) -> _Seq:
        self._check_open()
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}: never allocated or already freed") from None

    def _check_num_tokens(self, num_tokens: int) -> int:
        if isinstance(num_tokens, bool) or int(num_tokens) != num_tokens or not 1 <= num_tokens <= self.max_model_len:
            raise ValueError(f"num_tokens must be an int in [1, {self.max_model_len}] (max_model_len), "
                             f"got {num_tokens!r}")
        return int(num_tokens)

    def _free_slots(self) -> list[Slot]:
        return [s for s in self.mapper.slots if s.is_free]

    def _free_tokens(self) -> int:
        """Token positions the obtainable pages can back, pool-wide (not capped at max_model_len;
        the same meaning as the paged backend's free blocks x block_size)."""
        units = self.mapper.available_pages() // self.layout.pages_per_unit
        return units * self.layout.page_size_bytes // self.layout.row_token_bytes

    def _map_ahead(self, slot: Slot, seq_len: int) -> None:
        if self.lookahead_tokens:
            target = min(self.max_model_len, seq_len + self.lookahead_tokens)
            self.mapper.map_ahead(slot, self.layout.num_units(target))

    def _register(self, seq: _Seq) -> None:
        """Register the prompt's full units whose tokens are written in every layer."""
        if seq.prefix is None:
            return
        units = seq.slot.units
        seq.prefix.register_upto(min(seq.written) // self.unit_tokens,
                                 lambda key, parent, u: self.prefix.register(key, parent, tuple(units[u])))

    def _pick_slot(self, free: list[Slot], num_units: int, hits: list[tuple[int, ...]]) -> Slot:
        """Best fit among free slots: fewest driver calls to occupy it (a prefix-hit page already in
        place costs none, a hole one map, a page to replace or a cached prefix page to move out an
        unmap and a map); then the kept mapping closest to ``num_units`` from above (else the
        largest below); then the lowest index."""
        refcount, is_cached = self.mapper.refcount, self.prefix.is_cached
        num_res = self.layout.num_reservations

        def calls(s: Slot) -> int:
            n = num_units * num_res         # a map per position, corrected for what is in place
            for u, pages in s.units.items():
                if u >= num_units:
                    continue
                for r, p in enumerate(pages):
                    if p is None:
                        continue
                    if u < len(hits):
                        n += -1 if p == hits[u][r] else 1
                    elif refcount(p) > 1 or is_cached(p):
                        n += 1
                    else:
                        n -= 1
            return n

        def key(s: Slot):
            kept = len(s.units)
            fit = (0, kept - num_units) if kept >= num_units else (1, num_units - kept)
            return (calls(s), fit, s.index)
        # slots that keep no pages all score alike: only the lowest-index one competes (keeps the
        # choice O(slots with kept pages) instead of O(free slots x units) per admission)
        candidates = [s for s in free if s.units]
        empty = [s for s in free if not s.units]
        if empty:
            candidates.append(min(empty, key=lambda s: s.index))
        return min(candidates, key=key)

    # ------------------------------------------------------------------ lifecycle
    def allocate(self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None = None,
                 extra_key: Hashable = None) -> int:
        """See :meth:`KVCache.allocate`; ``extra_key`` (tenant, LoRA, ...) salts every unit hash, so
        prompts only share pages with prompts of the same key.  Hits are whole units (pages)."""
        self._check_open()
        t0 = time.perf_counter_ns()
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already live; free it or use a new seq_id")
        n = self._check_num_tokens(num_tokens)
        if token_ids is not None and len(token_ids) != n:
            raise ValueError(f"token_ids has {len(token_ids)} ids, num_tokens is {n}; they must match")
        free = self._free_slots()
        if not free:
            raise SlotsExhaustedError(n, 0, f"all {self.max_num_seqs} slots are live (max_num_seqs); "
                                            f"free a sequence or raise max_num_seqs")
        num_units = self.layout.num_units(n)
        lookup = None
        hits: list[tuple[int, ...]] = []
        if self.enable_prefix_caching and token_ids is not None:
            lookup = self.prefix.lookup(token_ids, self.unit_tokens, extra_key)
            hits = [e.handles for e in lookup.hits]
        slot = self._pick_slot(free, num_units, hits)
        fresh, available = self.mapper.plan_occupy(slot, num_units, hits)
        if fresh > available:
            raise KVCacheFullError(n, self._free_tokens(),
                                   f"needs {fresh} more pages of {self.layout.page_size_bytes} B, "
                                   f"{available} obtainable")
        self.mapper.occupy(slot, seq_id, num_units, hits)
        self._map_ahead(slot, n)
        hit_tokens = len(hits) * self.unit_tokens
        chain = None
        if lookup is not None:
            chain = PrefixChain(lookup.keys, lookup.hits)
            self.prefix.record(lookup)
        self._seqs[seq_id] = _Seq(seq_id, slot, n, [hit_tokens] * self.spec.num_layers, chain)
        self._alloc_ns += time.perf_counter_ns() - t0
        return hit_tokens

    def extend(self, seq_id: int, num_tokens: int) -> None:
        seq = self._seq(seq_id)
        t0 = time.perf_counter_ns()
        if isinstance(num_tokens, bool) or int(num_tokens) != num_tokens or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        new_len = seq.seq_len + int(num_tokens)
        if new_len > self.max_model_len:
            raise ValueError(f"extend({seq_id!r}, {num_tokens}) would make seq_len {new_len} > "
                             f"max_model_len {self.max_model_len}")
        if new_len == seq.seq_len:
            return
        slot = seq.slot
        # fast path (most decode steps): the positions lie in claimed, unshared units and the
        # look-ahead target is already claimed: no page to map or copy
        ahead_len = min(self.max_model_len, new_len + self.lookahead_tokens)
        if (self.layout.num_units(ahead_len) <= slot.claimed and not self.mapper.any_shared(
                slot, self.layout.units_overlapping(seq.seq_len, new_len))):
            seq.seq_len = new_len
            self._alloc_ns += time.perf_counter_ns() - t0
            return
        num_units = max(slot.claimed, self.layout.num_units(new_len))
        cow = [u for u in self.layout.units_overlapping(seq.seq_len, new_len) if u < slot.claimed]
        fresh, available = self.mapper.plan_grow(slot, num_units, cow)
        if fresh > available:
            # any growth first needs the copy of the shared unit at seq_len, then whole units
            cow_pages = self.mapper.plan_writable(slot, cow, range(self.layout.num_reservations))
            spare = self.mapper.available_pages() - cow_pages
            can = 0
            if spare >= 0:
                units = slot.claimed + spare // self.layout.pages_per_unit
                can = max(0, self.layout.max_tokens_for_units(units) - seq.seq_len)
            raise KVCacheFullError(int(num_tokens), can, f"sequence {seq_id!r} needs {fresh} more pages, "
                                                         f"{available} obtainable")
        self.mapper.grow(slot, num_units, cow, copy_below_bytes=seq.seq_len * self.layout.row_token_bytes)
        seq.seq_len = new_len
        self._map_ahead(slot, new_len)
        self._alloc_ns += time.perf_counter_ns() - t0

    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self._seq(parent_id)
        t0 = time.perf_counter_ns()
        if child_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {child_id!r} is already live; use a new child_id")
        free = self._free_slots()
        if not free:
            raise SlotsExhaustedError(parent.seq_len, 0, f"fork needs a slot; all {self.max_num_seqs} "
                                                         f"are live (max_num_seqs)")
        num_units = self.layout.num_units(parent.seq_len)
        res = range(self.layout.num_reservations)

        def mismatches(s: Slot) -> int:
            return sum(1 for u in range(num_units) for r in res
                       if s.page(u, r) is not None and s.page(u, r) != parent.slot.page(u, r))
        slot = min(free, key=lambda s: (mismatches(s), s.index))
        self.mapper.share(slot, parent.slot, child_id, num_units)
        self._seqs[child_id] = _Seq(child_id, slot, parent.seq_len, list(parent.written),
                                    None if parent.prefix is None else parent.prefix.copy())
        self._map_ahead(slot, parent.seq_len)
        self._alloc_ns += time.perf_counter_ns() - t0

    def free(self, seq_id: int, *, written: bool = True) -> None:
        """See :meth:`KVCache.free`; the slot keeps its pages mapped (deferred reclamation)."""
        seq = self._seq(seq_id)
        t0 = time.perf_counter_ns()
        if not written and seq.prefix is not None:
            for u in seq.prefix.own_units:
                for page in seq.slot.units[u]:
                    self.pool.forget(page)
        self.mapper.vacate(seq.slot)
        del self._seqs[seq_id]
        self._alloc_ns += time.perf_counter_ns() - t0

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
        mapped in one batch (one ``set_access`` per run of adjacent pages).

        Args:
            seq_ids: sequence ids.
            num_tokens: look-ahead in positions, an int >= 0 (0 does nothing).
        Raises:
            ValueError: ``num_tokens`` is not an int >= 0.  VMMError: a driver call failed (the
            batch is undone; the cache stays consistent).  Never KVCacheFullError.
        """
        self._check_open()
        if isinstance(num_tokens, bool) or int(num_tokens) != num_tokens or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if not num_tokens:
            return
        t0 = time.perf_counter_ns()
        try:
            for seq_id in seq_ids:
                if self.mapper.pool.num_available == 0:
                    break
                seq = self._seqs.get(seq_id)
                if seq is None:
                    continue
                target = min(self.max_model_len, seq.seq_len + int(num_tokens))
                self.mapper.prefetch(seq.slot, self.layout.num_units(target))
        finally:
            self._prefetch_ns += time.perf_counter_ns() - t0

    def can_allocate(self, num_tokens: int) -> bool:
        if self._closed or isinstance(num_tokens, bool) or int(num_tokens) != num_tokens:
            return False
        if not 1 <= num_tokens <= self.max_model_len or not self._free_slots():
            return False
        need = self.layout.num_units(int(num_tokens)) * self.layout.pages_per_unit
        return need <= self.mapper.available_pages()

    def seq_len(self, seq_id: int) -> int:
        return self._seq(seq_id).seq_len

    # ------------------------------------------------------------------ data
    def write(self, seq_id: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        seq = self._seq(seq_id)
        self._check_layer(layer)
        self._check_kv("k", k)
        self._check_kv("v", v, k.shape[0])
        n = int(k.shape[0])
        if int(start) != start or start < 0 or start + n > seq.seq_len:
            raise ValueError(f"write of {n} tokens at start={start} must fit in seq_len {seq.seq_len} "
                             f"of sequence {seq_id!r}; extend() first")
        if n == 0:
            return
        slot = seq.slot
        units = self.layout.units_overlapping(start, start + n)
        reservations = self.layout.reservations_for_layer(layer)
        need = self.mapper.plan_writable(slot, units, reservations)
        if need > self.mapper.available_pages():
            raise KVCacheFullError(n, 0, f"copy-on-write of {need} shared pages, "
                                         f"{self.mapper.available_pages()} obtainable")
        self.mapper.make_writable(slot, units, reservations)
        dev = self.spec.torch_device
        self._k[layer][slot.index, start:start + n] = k.to(device=dev, dtype=self.spec.dtype)
        self._v[layer][slot.index, start:start + n] = v.to(device=dev, dtype=self.spec.dtype)
        if start <= seq.written[layer]:
            seq.written[layer] = max(seq.written[layer], start + n)
        self._register(seq)

    def gather(self, seq_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self._seq(seq_id)
        self._check_layer(layer)
        s, length = seq.slot.index, seq.seq_len
        return (self._k[layer][s, :length].clone(memory_format=torch.contiguous_format),
                self._v[layer][s, :length].clone(memory_format=torch.contiguous_format))

    # ------------------------------------------------------------------ per-step path
    def prepare(self, batch: Sequence[StepSeq]) -> AttentionMetadata:
        self._check_open()
        if not batch:
            raise ValueError("prepare() needs at least one scheduled sequence")
        t0 = time.perf_counter_ns()
        entries = []
        seen = set()
        for e in batch:
            seq = self._seq(e.seq_id)
            if e.seq_id in seen:
                raise ValueError(f"sequence {e.seq_id!r} appears twice in the batch")
            seen.add(e.seq_id)
            if e.num_new_tokens < 1 or e.num_computed_tokens < 0:
                raise ValueError(f"bad {e}: num_new_tokens must be >= 1 and num_computed_tokens >= 0")
            end = e.num_computed_tokens + e.num_new_tokens
            if end > seq.seq_len:
                raise ValueError(f"{e} writes up to position {end} > seq_len {seq.seq_len}; extend() first")
            entries.append((e, seq, self.layout.units_overlapping(e.num_computed_tokens, end)))
        all_res = range(self.layout.num_reservations)
        shared = [x for x in entries if self.mapper.any_shared(x[1].slot, x[2])]
        need = sum(self.mapper.plan_writable(seq.slot, units, all_res) for _, seq, units in shared)
        if need > self.mapper.available_pages():
            raise KVCacheFullError(sum(e.num_new_tokens for e in batch), 0,
                                   f"copy-on-write of {need} shared pages, "
                                   f"{self.mapper.available_pages()} obtainable")
        for _, seq, units in shared:
            self.mapper.make_writable(seq.slot, units, all_res)
        for e, seq, units in entries:
            if seq.prefix is None or seq.prefix.done:
                continue        # marks only feed prefix registration; nothing left to register
            end = e.num_computed_tokens + e.num_new_tokens
            seq.written = [max(w, end) if e.num_computed_tokens <= w else w for w in seq.written]
            self._register(seq)
        self._alloc_ns += time.perf_counter_ns() - t0
        slot_list = [seq.slot.index for _, seq, _ in entries]
        # flat write index into the [max_num_seqs, max_model_len, H, D] views: slot * max_model_len + pos
        seq_index, positions = step_token_positions(batch)
        slot_mapping = np.asarray(slot_list, dtype=np.int64)[seq_index] * self.max_model_len + positions
        return build_metadata(batch, device=self.spec.torch_device, slot_mapping=slot_mapping,
                              slot_indices=torch.tensor(slot_list, dtype=torch.int32))

    def _check_meta(self, meta: AttentionMetadata) -> None:
        if meta.slot_indices is None:
            raise ValueError("metadata has no slot_indices: it was not built by a vmem cache's prepare()")

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        self._check_open()
        self._check_layer(layer)
        self._check_meta(meta)
        self._check_kv("k", k, meta.num_tokens)
        self._check_kv("v", v, meta.num_tokens)
        ops.write_kv(self._k[layer], self._v[layer], k, v, meta.slot_mapping,
                     key_anchor=self._k_anchor[layer], value_anchor=self._v_anchor[layer])

    def attention(self, layer: int, q: torch.Tensor, meta: AttentionMetadata,
                  scale: float | None = None) -> torch.Tensor:
        self._check_open()
        self._check_layer(layer)
        self._check_meta(meta)
        s = self.spec
        if (q.dim() != 3 or q.shape[0] != meta.num_tokens or q.shape[2] != s.head_dim
                or q.shape[1] % s.num_kv_heads):
            raise ValueError(f"q must be [{meta.num_tokens}, a multiple of {s.num_kv_heads}, "
                             f"{s.head_dim}], got {tuple(q.shape)}")
        scale = s.head_dim ** -0.5 if scale is None else float(scale)
        # host copy of the slots (no device sync for the reference and sdpa paths)
        slots_host = [self._seq(seq_id).slot.index for seq_id in meta.seq_ids]
        extra = {} if self.attention_impl == "auto" else {"impl": self.attention_impl}
        return ops.contiguous_attention(
            q, self._k[layer], self._v[layer], meta.slot_indices, meta.query_start_loc, meta.seq_lens,
            seq_lens_host=meta.seq_lens_host, query_lens_host=meta.query_lens_host,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, scale=scale,
            slot_indices_host=slots_host, key_anchor=self._k_anchor[layer],
            value_anchor=self._v_anchor[layer], **extra)

    # ------------------------------------------------------------------ introspection
    @property
    def page_size_bytes(self) -> int:
        return self.layout.page_size_bytes

    def slot_of(self, seq_id: int) -> int:
        """The slot index of a live sequence."""
        return self._seq(seq_id).slot.index

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

    def usage(self) -> CacheUsage:
        self._check_open()
        page = self.layout.page_size_bytes
        used: dict[int, int] = {}
        for seq in self._seqs.values():
            slot = seq.slot
            for u in range(slot.claimed):
                b = self.layout.unit_used_bytes(seq.seq_len, u)
                for p in slot.units[u]:
                    if used.get(p, -1) < b:
                        used[p] = b
        allocated = len(used) * page
        return CacheUsage(
            num_seqs=len(self._seqs),
            used_tokens=sum(seq.seq_len for seq in self._seqs.values()),
            allocated_bytes=allocated,
            waste_bytes=allocated - sum(used.values()),
            capacity_bytes=self.pool.max_pages * page,
            mapped_bytes=self.mapper.num_mapped_pages() * page,
            reserved_bytes=self.layout.num_reservations * self.layout.reservation_bytes,
            free_tokens=self._free_tokens(),
            prefix_query_tokens=self.prefix.num_query_tokens,
            prefix_hit_tokens=self.prefix.num_hit_tokens,
            num_cow_copies=self.mapper.num_cow_copies,
            unit_tokens=self.unit_tokens,
        )

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
            "alloc_time_us": self._alloc_ns / 1e3,
            "prefetch_time_us": self._prefetch_ns / 1e3,
            "page_size_bytes": self.layout.page_size_bytes,
            "pages_per_unit": self.layout.pages_per_unit,
            "num_prefix_entries": len(self.prefix),
            "driver": self.driver.name,
            "layout": self.layout.name,
        })
        return stats

    #: the name benchmarks used before :meth:`KVCache.backend_stats`
    vmm_stats = backend_stats

    def map_latency_samples_us(self) -> tuple[list[float], list[float]]:
        """Raw ``(map_us, unmap_us)`` samples (the most recent 100k of each); a map sample is per
        page: its batch's wall time / the batch's pages."""
        return list(self.mapper.map_us), list(self.mapper.unmap_us)

    def map_batch_samples(self) -> tuple[list[float], list[int]]:
        """Raw ``(batch wall time us, pages in the batch)`` of the most recent 100k map batches."""
        return list(self.mapper.map_batch_us), list(self.mapper.pages_per_batch)

    def check_integrity(self) -> None:
        self._check_open()
        self.mapper.check_integrity()
        unbacked = self.layout.unbacked_anchors(self.driver, self.mapper.base_tensors)
        if unbacked:
            raise AssertionError(f"kernel launches would receive unbacked addresses {unbacked}")
        live = {s.index: s for s in self.mapper.slots if not s.is_free}
        if len(live) != len(self._seqs):
            raise AssertionError(f"{len(live)} live slots for {len(self._seqs)} sequences")
        for seq in self._seqs.values():
            slot = seq.slot
            if live.get(slot.index) is not slot or slot.seq_id != seq.seq_id:
                raise AssertionError(f"sequence {seq.seq_id!r} owns slot {slot.index}, which holds "
                                     f"{slot.seq_id!r}")
            need = self.layout.num_units(seq.seq_len)
            if slot.claimed < need:
                raise AssertionError(f"sequence {seq.seq_id!r}: seq_len {seq.seq_len} needs {need} units, "
                                     f"slot claims {slot.claimed}")
            if max(seq.written) > seq.seq_len:
                raise AssertionError(f"sequence {seq.seq_id!r}: written {seq.written} > seq_len "
                                     f"{seq.seq_len}")
            if seq.prefix is not None and seq.prefix.num_registered > len(seq.prefix.keys):
                raise AssertionError(f"sequence {seq.seq_id!r}: {seq.prefix.num_registered} units "
                                     f"registered of {len(seq.prefix.keys)}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._k = self._v = self._k_anchor = self._v_anchor = None
        self._seqs.clear()
        self.mapper.close()
        if self._owns_driver:
            self.driver.close()
