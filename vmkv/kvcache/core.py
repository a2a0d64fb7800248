"""``KVCacheCore``: the algorithm both backends share (DESIGN.md, "One core, two thin backends").

The core owns the sequence table and its validation (:mod:`vmkv.kvcache.seqtable`), prefix lookup,
statistics and registration (:mod:`vmkv.kvcache.prefix`), written marks, the copy-on-write
protocol (plan, check against the obtainable units, raise :class:`KVCacheFullError` changing
nothing, apply, then copy every planned unit in one batch), the ``prepare()`` skeleton and the
argument checks of the per-layer calls.  A backend fills in these hooks:

================================  ===========================================================
``_plan_allocate(n, hits)``       a :class:`Room` for a new sequence (hits: prefix entries)
``_occupy(seq_id, n, hits, room)`` back it; returns ``(units, row)``
``_plan_extend(s, new_len)``      a :class:`Room` for growth (copy-on-write included), or None
``_grow(s, new_len, room)``       back it; returns copy pairs
``_share(parent, child_id)``      fork: share the parent's units; returns ``(units, row)``
``_release(s, written)``          free the sequence's units
``_plan_cow(targets, layers)``    a :class:`Room` for making ``targets`` writable, or None
``_apply_cow(room)``              give each shared unit a private copy; returns copy pairs
``copy_units(pairs)``             the step's copies, in one batch (tensor work)
``_register_unit(s, key, parent, i)`` / ``_forget_unit(s, i)``   prefix entries of unit ``i``
``_units_overlapping(start, end)``, ``_can_back(n)``, ``_build_metadata(batch, states, pad_to,
out)``, ``_graph_table_width()``, ``supports_cuda_graphs``,
``_write_rows``, ``_gather``, ``_scatter``, ``_attend``, ``_memory_usage()``, ``_check_units()``,
``_close()``
================================  ===========================================================
"""

from __future__ import annotations

import time
from typing import Hashable, Sequence

import torch

from vmkv.kvcache.base import KVCache
from vmkv.kvcache.errors import KVCacheError
from vmkv.kvcache.metadata import StepStaging, step_layout
from vmkv.kvcache.prefix import PrefixChain, PrefixIndex
from vmkv.kvcache.records import AttentionMetadata, CacheUsage, StepSeq
from vmkv.kvcache.room import Room
from vmkv.kvcache.seqtable import SeqState, SeqTable, check_count
from vmkv.kvcache.spec import KVCacheSpec

__all__ = ["KVCacheCore", "Room"]


class KVCacheCore(KVCache):
    """Shared implementation of :class:`KVCache` over a backend's hooks (module docstring).

    Subclasses call :meth:`_init_core` once their units exist, set :attr:`unit_tokens` and
    :attr:`enable_prefix_caching`, and set :attr:`_meta_field` to the metadata field that marks
    their own ``prepare()`` output.
    """

    _meta_field = ""

    def __init__(self, spec: KVCacheSpec, *, max_num_seqs: int, max_model_len: int,
                 memory_bytes: int) -> None:
        super().__init__(spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         memory_bytes=memory_bytes)
        self.seqs = SeqTable(self.max_num_seqs, self.max_model_len)
        self.prefix = PrefixIndex()
        self.unit_tokens = 0
        self.enable_prefix_caching = False
        self.num_cow_copies = 0
        self._alloc_ns = 0
        self._staging = StepStaging(spec.torch_device)
        self._closed = True

    # ------------------------------------------------------------------ lifecycle
    def allocate(self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None = None,
                 extra_key: Hashable = None) -> int:
        self._check_open()
        t0 = time.perf_counter_ns()
        n = self.seqs.check_new(seq_id, num_tokens, token_ids)
        lookup = None
        if self.enable_prefix_caching and token_ids is not None:
            lookup = self.prefix.lookup(token_ids, self.unit_tokens, extra_key)
        hits = [] if lookup is None else lookup.hits
        room = self._plan_allocate(n, hits)
        room.check()
        units, row = self._occupy(seq_id, n, hits, room)
        hit_tokens = len(hits) * self.unit_tokens
        chain = None
        if lookup is not None:
            chain = PrefixChain(lookup.keys, lookup.hits)
            self.prefix.record(lookup)
        self.seqs.add(SeqState(seq_id, n, units, self.spec.num_layers, hit_tokens, chain, row))
        self._alloc_ns += time.perf_counter_ns() - t0
        return hit_tokens

    def extend(self, seq_id: int, num_tokens: int) -> None:
        self._check_open()
        t0 = time.perf_counter_ns()
        s, new_len = self.seqs.check_extend(seq_id, num_tokens)
        if new_len == s.seq_len:
            return
        room = self._plan_extend(s, new_len)
        if room is not None:
            room.check()
            self._copy(self._grow(s, new_len, room))
        self.seqs.set_len(s, new_len)
        self._alloc_ns += time.perf_counter_ns() - t0

    def fork(self, parent_id: int, child_id: int) -> None:
        self._check_open()
        t0 = time.perf_counter_ns()
        parent = self.seqs.check_fork(parent_id, child_id)
        units, row = self._share(parent, child_id)
        self.seqs.add(parent.fork(child_id, units, row))
        self._alloc_ns += time.perf_counter_ns() - t0

    def free(self, seq_id: int, *, written: bool = True) -> None:
        self._check_open()
        t0 = time.perf_counter_ns()
        s = self.seqs.get(seq_id)
        if not written and s.prefix is not None:
            for i in s.prefix.own_units:
                self._forget_unit(s, i)
        self.seqs.remove(s)
        self._release(s)
        self._alloc_ns += time.perf_counter_ns() - t0

    def can_allocate(self, num_tokens: int) -> bool:
        if self._closed:
            return False
        try:
            n = check_count("num_tokens", num_tokens, 1, self.max_model_len)
        except ValueError:
            return False
        return len(self.seqs) < self.max_num_seqs and self._can_back(n)

    def seq_len(self, seq_id: int) -> int:
        self._check_open()
        return self.seqs.get(seq_id).seq_len

    def has_seq(self, seq_id: int) -> bool:
        return not self._closed and seq_id in self.seqs

    # ------------------------------------------------------------------ data
    def write(self, seq_id: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check_open()
        s = self.seqs.get(seq_id)
        self._check_layer(layer)
        self._check_kv("k", k)
        self._check_kv("v", v, k.shape[0])
        n = int(k.shape[0])
        start = self.seqs.check_range(s, start, n)
        if n == 0:
            return
        self._make_writable([(s, self._units_overlapping(start, start + n))], (layer,), n)
        dev, dtype = self.spec.torch_device, self.spec.dtype
        self._write_rows(s, layer, start, k.to(dev, dtype), v.to(dev, dtype))
        if s.mark(start, start + n, (layer,)):
            self._register(s)

    def gather(self, seq_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_open()
        s = self.seqs.get(seq_id)
        self._check_layer(layer)
        return self._gather(s, layer)

    # ------------------------------------------------------------------ per-step path
    def prepare(self, batch: Sequence[StepSeq], *, pad_to: int | None = None,
                out: torch.Tensor | None = None) -> AttentionMetadata:
        """Validate the batch, copy every shared unit the step writes into (one plan, one check,
        one batch of copies), build the backend's metadata (``pad_to`` / ``out``: see
        :meth:`KVCache.prepare`), then advance the written marks and register newly full prompt
        units in the prefix cache.

        Raises:
            UnknownSequenceError; ValueError (empty batch, repeated seq_id, no new tokens, or
            computed + new > seq_len, ``pad_to`` below the batch or with a prefill entry);
            KVCacheFullError (copy-on-write short of units; nothing changed).
        """
        self._check_open()
        states = self.seqs.check_batch(batch)
        self._check_padding(batch, pad_to, out)      # before anything changes
        t0 = time.perf_counter_ns()
        targets = [(s, self._units_overlapping(e.num_computed_tokens,
                                                e.num_computed_tokens + e.num_new_tokens))
                   for e, s in zip(batch, states)]
        self._make_writable(targets, None, sum(e.num_new_tokens for e in batch))
        self._alloc_ns += time.perf_counter_ns() - t0
        meta = self._build_metadata(batch, states, pad_to, out)
        for e, s in zip(batch, states):
            if s.prefix is None or s.prefix.done:
                continue        # marks only feed prefix registration; nothing left to register
            if s.mark(e.num_computed_tokens, e.num_computed_tokens + e.num_new_tokens):
                self._register(s)
        return meta

    def _check_padding(self, batch: Sequence[StepSeq], pad_to: int | None, out: torch.Tensor | None) -> None:
        """ValueError unless ``pad_to`` and ``out`` are None, or the cache can be captured
        (``supports_cuda_graphs``), ``pad_to`` is an int >= the batch (all decode entries) and ``out``
        is None or, with ``pad_to``, a uint8 buffer of ``graph_buffer_bytes(pad_to)`` bytes or more on
        the cache's device type."""
        if (pad_to is not None or out is not None) and not self.supports_cuda_graphs:
            raise ValueError(f"pad_to/out lay a decode step out for a CUDA graph; this {self.backend} "
                             f"cache cannot be captured (supports_cuda_graphs is False: CPU, or a non-Triton path)")
        if pad_to is not None and (isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < 1
                                   or pad_to < len(batch) or any(e.num_new_tokens != 1 for e in batch)):
            raise ValueError(f"pad_to={pad_to!r} needs a decode batch (one new token each) of at most "
                             f"pad_to sequences; got {len(batch)} sequences")
        if out is None:
            return
        if pad_to is None:
            raise ValueError("out is the static buffer of a padded decode step (a CUDA graph's): give pad_to")
        need = self.graph_buffer_bytes(pad_to)
        if (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.numel() < need
                or out.device.type != self.spec.torch_device.type):
            raise ValueError(f"out must be a uint8 tensor of >= {need} bytes on "
                             f"{self.spec.torch_device.type}, got {getattr(out, 'dtype', type(out).__name__)} "
                             f"[{getattr(out, 'numel', lambda: '?')()}] on {getattr(out, 'device', '?')}")

    def graph_buffer_bytes(self, num_seqs: int) -> int:
        return step_layout(num_seqs, num_seqs, self._graph_table_width())[1]

    def capture_metadata(self, num_seqs: int, out: torch.Tensor) -> AttentionMetadata:
        self._check_open()
        if not self.supports_cuda_graphs:
            raise NotImplementedError(f"this {self.backend} cache does not support CUDA graphs")
        return self._build_metadata([], [], int(num_seqs), out)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        self._check_step(layer, meta)
        self._check_kv("k", k, meta.num_tokens)
        self._check_kv("v", v, meta.num_tokens)
        self._scatter(layer, k, v, meta)

    def attention(self, layer: int, q: torch.Tensor, meta: AttentionMetadata,
                  scale: float | None = None) -> torch.Tensor:
        self._check_step(layer, meta)
        s = self.spec
        if (q.dim() != 3 or q.shape[0] != meta.num_tokens or q.shape[2] != s.head_dim
                or q.shape[1] % s.num_kv_heads):
            raise ValueError(f"q must be [{meta.num_tokens}, a multiple of {s.num_kv_heads}, "
                             f"{s.head_dim}], got {tuple(q.shape)}")
        return self._attend(layer, q, meta, s.head_dim ** -0.5 if scale is None else float(scale))

    # ------------------------------------------------------------------ introspection
    def usage(self) -> CacheUsage:
        self._check_open()
        return CacheUsage(num_seqs=len(self.seqs), used_tokens=self.seqs.num_used_tokens,
                          prefix_query_tokens=self.prefix.num_query_tokens,
                          prefix_hit_tokens=self.prefix.num_hit_tokens,
                          num_cow_copies=self.num_cow_copies, unit_tokens=self.unit_tokens,
                          **self._memory_usage())

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the numbers if the table, the units or the prefix index
        disagree."""
        self._check_open()
        self.seqs.check_integrity()
        self._check_units()

    def close(self) -> None:
        """Release all memory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.seqs.clear()
        self._close()

    # ------------------------------------------------------------------ shared protocol
    def _init_core(self) -> None:
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise KVCacheError(f"this {type(self).__name__} is closed; build a new one")

    def _check_step(self, layer: int, meta: AttentionMetadata) -> None:
        self._check_open()
        self._check_layer(layer)
        if getattr(meta, self._meta_field, None) is None:
            raise ValueError(f"metadata has no {self._meta_field}: it was not built by a "
                             f"{self.backend} cache's prepare()")

    def _make_writable(self, targets: list, layers: tuple | None, num_tokens: int) -> None:
        """The copy-on-write protocol: plan, check, apply, copy in one batch."""
        room = self._plan_cow(targets, layers, num_tokens)
        if room is not None:
            room.check()
            self._copy(self._apply_cow(room))

    def _copy(self, pairs: list) -> None:
        if pairs:
            self.copy_units(pairs)
            self.num_cow_copies += len(pairs)

    def _register(self, s: SeqState) -> None:
        """Offer the prompt's newly full units (written in every layer) to the prefix cache."""
        if s.prefix is not None and not s.prefix.done:
            s.prefix.register_upto(s.written // self.unit_tokens,
                                   lambda key, parent, i: self._register_unit(s, key, parent, i))
