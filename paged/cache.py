"""``PagedKVCache``: the PagedAttention backend (Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention", SOSP'23).

Memory is one preallocated tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``;
layer ``l``'s key cache is ``t[l, 0]`` and value cache ``t[l, 1]``, each ``[num_blocks, block_size,
H, D]``.  A sequence's logical block ``i`` (positions ``i*block_size .. (i+1)*block_size-1``) lives in
physical block ``block_table[i]``, so position ``p`` is written at flat index
``block_table[p // block_size] * block_size + p % block_size`` (the slot mapping).

Sharing (section 4.4 of the paper): ``fork`` shares every block by reference count and the first
write into a block with ``refcount > 1`` copies it (copy-on-write, all layers); full prompt blocks
are registered in a prefix cache keyed by a chained hash and verified against their token ids
(:mod:`vmkv.kvcache.prefix`) once their K/V is written, and later prompts with the same prefix
reuse them.  Block bookkeeping lives in
:class:`~vmkv.paged.block_pool.BlockPool`; this module turns it into tensors, through the
per-sequence numpy rows of :class:`~vmkv.paged.host_tables.HostBlockTables`.
"""

from __future__ import annotations

import logging
from collections import Counter
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
from vmkv.paged.block_pool import BlockPool
from vmkv.paged.host_tables import HostBlockTables

__all__ = ["PagedKVCache", "TooManySequencesError"]

logger = logging.getLogger(__name__)


class TooManySequencesError(KVCacheFullError, ValueError):
    """``max_num_seqs`` sequences are already live (a ``KVCacheFullError`` and a ``ValueError``)."""


@dataclass
class _Seq:
    """Host bookkeeping of one live sequence."""

    block_table: list[int]
    seq_len: int
    # row of the cache's host block-table array holding block_table (zero-padded)
    row: int
    # positions 0..written_all-1 hold K/V in every layer (the minimum of the per-layer marks)
    written_all: int
    # per-layer written marks, only while layers differ (write() layer by layer); None: every
    # layer's mark is written_all
    written_layers: list[int] | None = None
    # prefix-cache keys of the prompt's full blocks and how many are cached (None: no prefix caching)
    prefix: PrefixChain | None = None

    def written(self, layer: int) -> int:
        """Positions ``0..written(layer)-1`` hold K/V in ``layer``."""
        return self.written_all if self.written_layers is None else self.written_layers[layer]

    def set_written(self, marks: list[int]) -> None:
        """Store per-layer marks, collapsing them to ``written_all`` when all layers agree."""
        low = min(marks)
        self.written_all = low
        self.written_layers = None if max(marks) == low else marks

    def copy(self, row: int) -> "_Seq":
        layers = None if self.written_layers is None else list(self.written_layers)
        return _Seq(list(self.block_table), self.seq_len, row, self.written_all, layers,
                    None if self.prefix is None else self.prefix.copy())


class PagedKVCache(KVCache):
    """KV cache of fixed-size blocks with block tables, reference counts, copy-on-write and
    prefix caching.

    Args:
        spec: model KV shape, dtype, device.
        max_num_seqs: live sequences at most.
        max_model_len: positions per sequence at most.
        memory_bytes: KV budget; ``num_blocks = memory_bytes // (block_size * spec.bytes_per_token)``.
        block_size: tokens per block (> 0, default 16).
        enable_prefix_caching: share identical full prompt blocks across sequences.
    Raises:
        ValueError: a bad argument, or ``memory_bytes`` too small for one block.
    """

    backend = "paged"

    def __init__(self, spec: KVCacheSpec, *, max_num_seqs: int, max_model_len: int,
                 memory_bytes: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        super().__init__(spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         memory_bytes=memory_bytes)
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.block_bytes = block_size * spec.bytes_per_token
        num_blocks = self.memory_bytes // self.block_bytes
        if num_blocks == 0:
            raise ValueError(
                f"memory_bytes={self.memory_bytes} holds no block of {self.block_bytes} bytes "
                f"(block_size {block_size} x {spec.bytes_per_token} bytes per token); give at "
                f"least {self.block_bytes} bytes or a smaller block_size")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.prefix = PrefixIndex()
        self.pool = BlockPool(num_blocks, self.prefix)
        self._kv: torch.Tensor | None = torch.zeros(
            (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim),
            dtype=spec.dtype, device=spec.torch_device)
        self._seqs: dict[int, _Seq] = {}
        # block tables mirrored in a numpy row per sequence (_Seq.row) for prepare()
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self._host_tables = HostBlockTables(max_num_seqs, self.max_blocks_per_seq)
        self._num_cow_copies = 0
        logger.info("paged KV cache: %d blocks x %d tokens (%d bytes each), %d layers, %s on %s",
                    num_blocks, block_size, self.block_bytes, spec.num_layers, spec.dtype, spec.device)

    # ------------------------------------------------------------------ views
    @property
    def kv_tensor(self) -> torch.Tensor:
        """``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, ``spec.dtype``."""
        self._check_open()
        return self._kv

    def key_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys, a view ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        self._check_layer(layer)
        return self.kv_tensor[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s values, a view ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        self._check_layer(layer)
        return self.kv_tensor[layer, 1]

    def block_table(self, seq_id: int) -> list[int]:
        """Copy of ``seq_id``'s block table (logical block -> physical block id)."""
        return list(self._get(seq_id).block_table)

    # ------------------------------------------------------------------ lifecycle
    def allocate(self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None = None,
                 extra_key: Hashable = None) -> int:
        """Create ``seq_id`` with ``num_tokens`` positions backed by ``ceil(num_tokens / block_size)``
        blocks, reusing prefix-cached full blocks of ``token_ids``.

        Args:
            num_tokens: 1..max_model_len.
            token_ids: prompt token ids (``len == num_tokens``) for the prefix cache, or ``None``.
            extra_key: salt mixed into every block hash (tenant, LoRA, multimodal hash).
        Returns:
            Hit tokens: ``block_size * hit_blocks``, at most ``(num_tokens - 1) // block_size``
            blocks, so always ``< num_tokens``.
        Raises:
            DuplicateSequenceError, ValueError (num_tokens or token_ids length),
            TooManySequencesError (``max_num_seqs`` live; a KVCacheFullError),
            KVCacheFullError (not enough free blocks; nothing changed).
        """
        self._check_open()
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id} is already allocated; free it first")
        self._check_new_len(num_tokens)
        if token_ids is not None and len(token_ids) != num_tokens:
            raise ValueError(f"token_ids has {len(token_ids)} ids, num_tokens is {num_tokens}")
        self._check_seq_slot(num_tokens)
        bs = self.block_size
        lookup = None
        hits: list[int] = []
        if self.enable_prefix_caching and token_ids is not None:
            lookup = self.prefix.lookup(token_ids, bs, extra_key)
            hits = [e.handles[0] for e in lookup.hits]
        num_new = -(-num_tokens // bs) - len(hits)
        # reviving a cached free hit block takes it out of the evictable set
        available = self.pool.num_free_blocks - sum(self.pool.is_cached_free(b) for b in hits)
        if num_new > available:
            raise KVCacheFullError(num_tokens, (len(hits) + available) * bs,
                                   f"sequence {seq_id} needs {num_new} new blocks, {available} free")
        for b in hits:
            self.pool.incref(b)
        table = hits + [self.pool.allocate() for _ in range(num_new)]
        hit_tokens = len(hits) * bs
        row = self._host_tables.new_row(table)
        chain = None
        if lookup is not None:
            chain = PrefixChain(lookup.keys, lookup.hits)
            self.prefix.record(lookup)
        self._seqs[seq_id] = _Seq(table, num_tokens, row, hit_tokens, None, chain)
        return hit_tokens

    def extend(self, seq_id: int, num_tokens: int) -> None:
        """Back ``num_tokens`` more positions; copy the shared block holding the next position
        first (copy-on-write), so writing the new positions needs no memory.

        Raises:
            UnknownSequenceError; ValueError (negative, or past max_model_len);
            KVCacheFullError (not enough free blocks; nothing changed).
        """
        s = self._get(seq_id)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        new_len = s.seq_len + num_tokens
        if new_len > self.max_model_len:
            raise ValueError(f"sequence {seq_id}: seq_len {s.seq_len} + {num_tokens} exceeds "
                             f"max_model_len {self.max_model_len}")
        if num_tokens == 0:
            return
        table = s.block_table
        num_old = len(table)
        num_new = -(-new_len // self.block_size) - num_old
        # copy-on-write of the block holding the next position (_cow_plan of one target)
        i = s.seq_len // self.block_size
        cow = [(seq_id, i)] if i < num_old and self.pool.refcount(table[i]) > 1 else []
        needed = num_new + len(cow)
        if needed > self.pool.num_free_blocks:
            # in tokens: the new positions plus whole copied blocks, against the room left in the
            # last block plus the free blocks
            bs = self.block_size
            room = len(s.block_table) * bs - s.seq_len
            raise KVCacheFullError(num_tokens + len(cow) * bs, room + self.pool.num_free_blocks * bs,
                                   f"sequence {seq_id} needs {num_new} new blocks + {len(cow)} "
                                   f"copy-on-write, {self.pool.num_free_blocks} free")
        if cow:
            self._apply_cow(cow)
        if num_new > 0:
            new = [self.pool.allocate() for _ in range(num_new)]
            table.extend(new)
            self._host_tables.append(s.row, num_old, new)
        s.seq_len = new_len

    def fork(self, parent_id: int, child_id: int) -> None:
        """``child_id`` shares every block of ``parent_id`` (refcount + 1 each), same ``seq_len``.

        Raises:
            UnknownSequenceError, DuplicateSequenceError, TooManySequencesError.
        """
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {child_id} is already allocated; fork into a new id")
        self._check_seq_slot(parent.seq_len)
        for b in parent.block_table:
            self.pool.incref(b)
        self._seqs[child_id] = parent.copy(self._host_tables.copy_row(parent.row))

    def free(self, seq_id: int, *, written: bool = True) -> None:
        """Release ``seq_id``: each block loses a reference, tail first (so the tail of a cached
        prompt is evicted before its head).  ``written=False``: drop the prefix entries of the
        blocks it registered first (see :meth:`KVCache.free`).  Raises UnknownSequenceError."""
        s = self._get(seq_id)
        if not written and s.prefix is not None:
            for i in s.prefix.own_units:
                self.pool.forget(s.block_table[i])
        del self._seqs[seq_id]
        self._host_tables.release(s.row, len(s.block_table))
        self.pool.free(reversed(s.block_table))

    def can_allocate(self, num_tokens: int) -> bool:
        """Would ``allocate(new_id, num_tokens)`` succeed now, ignoring prefix hits?"""
        if self._kv is None or not 1 <= num_tokens <= self.max_model_len:
            return False
        if len(self._seqs) >= self.max_num_seqs:
            return False
        return -(-num_tokens // self.block_size) <= self.pool.num_free_blocks

    @property
    def free_tokens(self) -> int:
        """Tokens of free KV memory: ``num_free_blocks * block_size`` (plain free + evictable
        cached blocks).  While fewer than ``max_num_seqs`` sequences are live,
        ``can_allocate(n)`` is true exactly for ``1 <= n <= min(free_tokens, max_model_len)``."""
        return self.pool.num_free_blocks * self.block_size

    def seq_len(self, seq_id: int) -> int:
        return self._get(seq_id).seq_len

    # ------------------------------------------------------------------ data
    def write(self, seq_id: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v: [n, num_kv_heads, head_dim]`` at positions ``start..start+n-1`` of ``layer``,
        copying shared blocks in that range first.

        Raises:
            UnknownSequenceError; ValueError (shape, layer, or range past seq_len);
            KVCacheFullError (a copy-on-write found no free block; nothing changed).
        """
        s = self._get(seq_id)
        self._check_layer(layer)
        self._check_kv("k", k)
        self._check_kv("v", v, k.shape[0])
        n = k.shape[0]
        if start < 0 or start + n > s.seq_len:
            raise ValueError(f"write of positions [{start}, {start + n}) outside [0, {s.seq_len}) "
                             f"of sequence {seq_id}; extend() it first")
        if n == 0:
            return
        bs = self.block_size
        self._cow_or_raise([(seq_id, i) for i in range(start // bs, (start + n - 1) // bs + 1)])
        pos = torch.arange(start, start + n)
        table = torch.tensor(s.block_table, dtype=torch.int64)
        slots = (table[pos // bs] * bs + pos % bs).to(self.spec.torch_device)
        dev = self.spec.torch_device
        ops.write_kv(self.key_cache(layer), self.value_cache(layer),
                     k.to(dev, self.spec.dtype), v.to(dev, self.spec.dtype), slots)
        if start <= s.written(layer) < start + n:
            marks = (list(s.written_layers) if s.written_layers is not None
                     else [s.written_all] * self.spec.num_layers)
            marks[layer] = start + n
            s.set_written(marks)
            self._register_written(s)

    def gather(self, seq_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of ``seq_id``'s K and V in ``layer``: ``[seq_len, num_kv_heads, head_dim]`` each."""
        s = self._get(seq_id)
        self._check_layer(layer)
        idx = torch.tensor(s.block_table, dtype=torch.int64, device=self.spec.torch_device)
        shape = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        k = self.key_cache(layer)[idx].reshape(shape)[:s.seq_len]
        v = self.value_cache(layer)[idx].reshape(shape)[:s.seq_len]
        return k, v  # advanced indexing already made copies

    # ------------------------------------------------------------------ per-step path
    def prepare(self, batch: Sequence[StepSeq]) -> AttentionMetadata:
        """Build the step's metadata: ``block_tables int32 [num_seqs, max_blocks]`` (padded with 0),
        slot mapping ``block_table[p // block_size] * block_size + p % block_size``.

        First copies every shared block the step writes into (copy-on-write); then marks positions
        ``0..num_computed_tokens + num_new_tokens - 1`` as written in every layer, registering newly
        full prompt blocks in the prefix cache.

        Host cost: one Python pass over the batch (checks, copy-on-write candidates, written
        marks: O(1) per sequence); the block tables are one fancy index of the host block-table
        rows and the slot mapping one numpy expression, with no per-token Python call.  On CUDA
        the block tables are pinned so their copy is asynchronous.

        Raises:
            UnknownSequenceError; ValueError (empty batch, repeated seq_id, no new tokens, or
            computed + new > seq_len); KVCacheFullError (copy-on-write short of blocks; nothing
            changed).
        """
        if not batch:
            raise ValueError("prepare() needs at least one scheduled sequence")
        seen: set = set()
        bs = self.block_size
        refcount = self.pool.refcount
        seqs = []
        targets = []
        for e in batch:
            s = self._get(e.seq_id)
            if e.seq_id in seen:
                raise ValueError(f"sequence {e.seq_id} appears twice in the batch")
            seen.add(e.seq_id)
            if e.num_new_tokens < 1 or e.num_computed_tokens < 0:
                raise ValueError(f"bad {e}: num_new_tokens must be >= 1, num_computed_tokens >= 0")
            end = e.num_computed_tokens + e.num_new_tokens
            if end > s.seq_len:
                raise ValueError(f"{e} writes up to position {end}, past seq_len {s.seq_len}; "
                                 f"extend() the sequence first")
            seqs.append(s)
            # only shared blocks can need a copy (_cow_plan's counts only go down)
            table = s.block_table
            targets += [(e.seq_id, i) for i in range(e.num_computed_tokens // bs, (end - 1) // bs + 1)
                        if refcount(table[i]) > 1]
        if targets:
            self._cow_or_raise(targets)
        width = max(len(s.block_table) for s in seqs)
        bt = self._host_tables.gather((s.row for s in seqs), len(seqs), width)
        seq_index, positions = step_token_positions(batch)
        slots = bt[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        bt_t = torch.from_numpy(bt)
        if self.spec.torch_device.type == "cuda":
            bt_t = bt_t.pin_memory()  # lets build_metadata's non_blocking copy be asynchronous
        meta = build_metadata(batch, device=self.spec.torch_device, block_tables=bt_t,
                              slot_mapping=slots)
        for e, s in zip(batch, seqs):
            end = e.num_computed_tokens + e.num_new_tokens
            if s.written_layers is not None:
                s.set_written([max(w, end) for w in s.written_layers])
            elif end > s.written_all:
                s.written_all = end
            else:
                continue
            if s.prefix is not None and not s.prefix.done and s.prefix.num_registered < s.written_all // bs:
                self._register_written(s)
        return meta

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Scatter ``k, v: [num_tokens, num_kv_heads, head_dim]`` (token order of ``meta``) into
        ``layer``'s blocks at ``meta.slot_mapping`` (via :func:`vmkv.kernels.ops.write_kv`)."""
        self._check_layer(layer)
        self._check_kv("k", k, meta.num_tokens)
        self._check_kv("v", v, meta.num_tokens)
        ops.write_kv(self.key_cache(layer), self.value_cache(layer), k, v, meta.slot_mapping)

    def attention(self, layer: int, q: torch.Tensor, meta: AttentionMetadata,
                  scale: float | None = None) -> torch.Tensor:
        """Causal attention through the block tables (:func:`vmkv.kernels.ops.paged_attention`).

        Args:
            q: ``[num_tokens, num_heads, head_dim]``, ``num_heads`` a multiple of ``num_kv_heads``.
            scale: softmax scale, default ``head_dim ** -0.5``.
        Returns:
            ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
        """
        self._check_layer(layer)
        s = self.spec
        if (q.dim() != 3 or q.shape[0] != meta.num_tokens or q.shape[2] != s.head_dim
                or q.shape[1] % s.num_kv_heads):
            raise ValueError(f"q must be [{meta.num_tokens}, k * {s.num_kv_heads}, {s.head_dim}], "
                             f"got {tuple(q.shape)}")
        if meta.block_tables is None:
            raise ValueError("metadata has no block_tables; build it with this cache's prepare()")
        return ops.paged_attention(
            q, self.key_cache(layer), self.value_cache(layer), meta.block_tables,
            meta.query_start_loc, meta.seq_lens, seq_lens_host=meta.seq_lens_host,
            query_lens_host=meta.query_lens_host, max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len, scale=s.head_dim ** -0.5 if scale is None else scale)

    # ------------------------------------------------------------------ introspection
    def usage(self) -> CacheUsage:
        """Snapshot: allocated = distinct blocks of live sequences; waste = allocated minus the
        positions covered (per shared block, the most positions any sharer uses); mapped = reserved
        = capacity = the whole preallocated pool."""
        bs = self.block_size
        covered: dict[int, int] = {}
        for s in self._seqs.values():
            for i, b in enumerate(s.block_table):
                covered[b] = max(covered.get(b, 0), min(bs, s.seq_len - i * bs))
        allocated = len(covered) * self.block_bytes
        capacity = self.num_blocks * self.block_bytes
        return CacheUsage(
            num_seqs=len(self._seqs),
            used_tokens=sum(s.seq_len for s in self._seqs.values()),
            allocated_bytes=allocated,
            waste_bytes=allocated - self.spec.kv_bytes(sum(covered.values())),
            capacity_bytes=capacity, mapped_bytes=capacity, reserved_bytes=capacity,
            free_tokens=self.free_tokens,
            prefix_query_tokens=self.prefix.num_query_tokens,
            prefix_hit_tokens=self.prefix.num_hit_tokens,
            num_cow_copies=self._num_cow_copies,
            unit_tokens=bs)

    def backend_stats(self) -> dict:
        """Block-pool counts: ``num_blocks``, ``block_size``, ``num_free_blocks``,
        ``num_cached_free_blocks``, ``num_cached_blocks`` (prefix entries), ``num_cow_copies``,
        ``num_prefix_evictions``."""
        self._check_open()
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_free_blocks": self.pool.num_free_blocks,
            "num_cached_free_blocks": self.pool.num_cached_free_blocks,
            "num_cached_blocks": self.pool.num_cached_blocks,
            "num_cow_copies": self._num_cow_copies,
            "num_prefix_evictions": self.pool.num_evictions,
        }

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the numbers if block tables, refcounts, the free list or
        the hash map disagree."""
        refs: Counter = Counter()
        for sid, s in self._seqs.items():
            want = -(-s.seq_len // self.block_size)
            if len(s.block_table) != want:
                raise AssertionError(f"sequence {sid}: {len(s.block_table)} blocks for seq_len "
                                     f"{s.seq_len}, expected {want}")
            if not 0 < s.seq_len <= self.max_model_len:
                raise AssertionError(f"sequence {sid}: seq_len {s.seq_len} outside [1, {self.max_model_len}]")
            refs.update(s.block_table)
        if len(self._seqs) > self.max_num_seqs:
            raise AssertionError(f"{len(self._seqs)} live sequences > max_num_seqs {self.max_num_seqs}")
        bad = [b for b in refs if not 0 <= b < self.num_blocks]
        if bad:
            raise AssertionError(f"block tables reference ids {bad} outside [0, {self.num_blocks})")
        self._host_tables.check({sid: (s.row, s.block_table) for sid, s in self._seqs.items()})
        self.pool.check_integrity(dict(refs))
        if self.pool.num_used_blocks != len(refs):
            raise AssertionError(f"pool has {self.pool.num_used_blocks} used blocks, block tables "
                                 f"reference {len(refs)}")

    def close(self) -> None:
        """Drop the KV tensor and every sequence (idempotent)."""
        self._kv = None
        self._seqs.clear()
        self.prefix.clear()
        self.pool = BlockPool(self.num_blocks, self.prefix)
        self._host_tables.reset()

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._kv is None:
            raise KVCacheError("the paged KV cache is closed; build a new one")

    def _get(self, seq_id: int) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"sequence {seq_id} is not allocated (or was freed)") from None

    def _check_new_len(self, num_tokens: int) -> None:
        if not 1 <= num_tokens <= self.max_model_len:
            raise ValueError(f"num_tokens must be in [1, {self.max_model_len}] (max_model_len), "
                             f"got {num_tokens}")

    def _check_seq_slot(self, num_tokens: int) -> None:
        if len(self._seqs) >= self.max_num_seqs:
            raise TooManySequencesError(
                num_tokens, 0, f"max_num_seqs reached: {len(self._seqs)} of {self.max_num_seqs} "
                               f"live; free a sequence first")

    def _cow_plan(self, targets: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Which ``(seq_id, logical block)`` targets need a copy before being written, simulating
        the refcount drop of each earlier copy (two sharers writing: only the first copies)."""
        rc: dict[int, int] = {}
        plan = []
        for sid, i in dict.fromkeys(targets):
            table = self._seqs[sid].block_table
            if i >= len(table):
                continue
            b = table[i]
            count = rc.get(b, self.pool.refcount(b))
            if count > 1:
                plan.append((sid, i))
                rc[b] = count - 1
        return plan

    def _cow_or_raise(self, targets: list[tuple[int, int]]) -> None:
        """Copy the shared blocks among ``targets`` or, short of free blocks, raise
        KVCacheFullError (needed/available counted in whole blocks' tokens) changing nothing."""
        plan = self._cow_plan(targets)
        if len(plan) > self.pool.num_free_blocks:
            raise KVCacheFullError(len(plan) * self.block_size,
                                   self.pool.num_free_blocks * self.block_size,
                                   f"copy-on-write of {len(plan)} shared blocks, "
                                   f"{self.pool.num_free_blocks} free")
        self._apply_cow(plan)

    def _apply_cow(self, plan: list[tuple[int, int]]) -> None:
        kv = self.kv_tensor
        for sid, i in plan:
            table = self._seqs[sid].block_table
            old = table[i]
            new = self.pool.allocate()
            kv[:, :, new] = kv[:, :, old]
            self.pool.decref(old)
            table[i] = new
            self._host_tables.set(self._seqs[sid].row, i, new)
            self._num_cow_copies += 1
            logger.debug("copy-on-write: sequence %s block %d: %d -> %d", sid, i, old, new)

    def _register_written(self, s: _Seq) -> None:
        """Offer newly written full prompt blocks to the prefix cache."""
        if s.prefix is not None:
            s.prefix.register_upto(s.written_all // self.block_size,
                                   lambda key, parent, i: self.pool.register(s.block_table[i], key, parent))
