"""``PagedKVCache``: the PagedAttention backend (Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention", SOSP'23).

Memory is one preallocated tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``;
layer ``l``'s key cache is ``t[l, 0]`` and value cache ``t[l, 1]``, each ``[num_blocks, block_size,
H, D]``.  A sequence's logical block ``i`` (positions ``i*block_size .. (i+1)*block_size-1``) lives in
physical block ``block_table[i]``, so position ``p`` is written at flat index
``block_table[p // block_size] * block_size + p % block_size`` (the slot mapping).

The sequence table, validation, prefix caching, written marks, the copy-on-write protocol and the
``prepare()`` skeleton are the shared core's (:class:`~vmkv.kvcache.core.KVCacheCore`); the block
bookkeeping is the torch-free :class:`~vmkv.paged.block_manager.BlockManager`.  This module holds
the tensor and the core's hooks.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch

from vmkv.kernels import ops
from vmkv.kvcache.core import KVCacheCore, Room
from vmkv.kvcache.errors import TooManySequencesError
from vmkv.kvcache.metadata import build_metadata, step_token_positions
from vmkv.kvcache.records import AttentionMetadata, StepSeq
from vmkv.kvcache.seqtable import SeqState
from vmkv.kvcache.spec import KVCacheSpec
from vmkv.paged.block_manager import BlockManager
from vmkv.paged.options import PagedOptions

__all__ = ["PagedKVCache", "TooManySequencesError"]

logger = logging.getLogger(__name__)


class PagedKVCache(KVCacheCore):
    """KV cache of fixed-size blocks with block tables, reference counts, copy-on-write and
    prefix caching.

    Args:
        spec: model KV shape, dtype, device.
        max_num_seqs: live sequences at most.
        max_model_len: positions per sequence at most.
        memory_bytes: KV budget; ``num_blocks = memory_bytes // (block_size * spec.bytes_per_token)``.
        block_size: tokens per block (``PagedOptions``' rule: a power of two in [1, 1024], default 16).
        enable_prefix_caching: share identical full prompt blocks across sequences.
    Raises:
        ValueError: a bad argument, or ``memory_bytes`` too small for one block.
    """

    backend = "paged"
    _meta_field = "block_tables"

    def __init__(self, spec: KVCacheSpec, *, max_num_seqs: int, max_model_len: int,
                 memory_bytes: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        super().__init__(spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         memory_bytes=memory_bytes)
        PagedOptions.check_field("block_size", block_size, owner="PagedKVCache")
        self.block_size = self.unit_tokens = block_size
        self.block_bytes = block_size * spec.bytes_per_token
        num_blocks = self.memory_bytes // self.block_bytes
        if num_blocks == 0:
            raise ValueError(
                f"memory_bytes={self.memory_bytes} holds no block of {self.block_bytes} bytes "
                f"(block_size {block_size} x {spec.bytes_per_token} bytes per token); give at "
                f"least {self.block_bytes} bytes or a smaller block_size")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.blocks = BlockManager(num_blocks, block_size, self.max_num_seqs,
                                   self.max_blocks_per_seq, self.prefix)
        self._kv: torch.Tensor | None = torch.zeros(
            (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim),
            dtype=spec.dtype, device=spec.torch_device)
        self._init_core()
        logger.info("paged KV cache: %d blocks x %d tokens (%d bytes each), %d layers, %s on %s",
                    num_blocks, block_size, self.block_bytes, spec.num_layers, spec.dtype, spec.device)

    # ------------------------------------------------------------------ views
    @property
    def pool(self):
        """The :class:`~vmkv.paged.block_pool.BlockPool` (ids, refcounts, free lists)."""
        return self.blocks.pool

    @property
    def _host_tables(self):
        return self.blocks.tables

    @property
    def _seqs(self):
        return self.seqs

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
        return list(self.seqs.get(seq_id).units)

    @property
    def free_tokens(self) -> int:
        """Tokens of free KV memory: ``num_free_blocks * block_size`` (plain free + evictable
        cached blocks).  While fewer than ``max_num_seqs`` sequences are live,
        ``can_allocate(n)`` is true exactly for ``1 <= n <= min(free_tokens, max_model_len)``."""
        return self.pool.num_free_blocks * self.block_size

    # ------------------------------------------------------------------ lifecycle hooks
    def _plan_allocate(self, n: int, hits: list) -> Room:
        return self.blocks.plan_allocate(n, [e.handles[0] for e in hits])

    def _occupy(self, seq_id, n: int, hits: list, room: Room):
        return self.blocks.allocate(room)

    def _plan_extend(self, s: SeqState, new_len: int) -> Room:
        return self.blocks.plan_extend(s, new_len)

    def _grow(self, s: SeqState, new_len: int, room: Room) -> list:
        return self.blocks.extend(s, room)

    def _share(self, parent: SeqState, child_id):
        return self.blocks.fork(parent)

    def _release(self, s: SeqState) -> None:
        self.blocks.free(s)

    def _forget_unit(self, s: SeqState, i: int) -> None:
        self.pool.forget(s.units[i])

    def _register_unit(self, s: SeqState, key, parent, i: int):
        return self.pool.register(s.units[i], key, parent)

    def _units_overlapping(self, start: int, end: int) -> range:
        return range(start // self.block_size, (end - 1) // self.block_size + 1)

    def _can_back(self, n: int) -> bool:
        return -(-n // self.block_size) <= self.pool.num_free_blocks

    def _plan_cow(self, targets: list, layers, num_tokens: int) -> Room | None:
        return self.blocks.plan_cow(targets)

    def _apply_cow(self, room: Room) -> list:
        return self.blocks.apply_cow(room)

    def copy_units(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks ``src -> dst`` for every ``(src, dst)`` of ``pairs``, all layers, K and V, in
        one indexed copy (the step's copy-on-write batch)."""
        kv = self.kv_tensor
        dev = kv.device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64).to(dev, non_blocking=True)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64).to(dev, non_blocking=True)
        kv[:, :, dst] = kv[:, :, src]

    # ------------------------------------------------------------------ data hooks
    def _write_rows(self, s: SeqState, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``write()``'s rows.  A block it overwrites that holds a prefix-cache unit loses the entry
        (and its descendants'), as vmem's ``make_writable`` drops those of the pages it overwrites:
        its bytes change, so a later hit on the old tokens must miss, never read the new bytes (shared
        blocks were copied first, and the copy has no entry).  The unit is registered again once
        every layer of it is written (``SeqState.mark``)."""
        bs = self.block_size
        if len(self.prefix):
            for i in self._units_overlapping(start, start + k.shape[0]):
                if self.pool.is_cached(s.units[i]):
                    self._forget_unit(s, i)
        pos = torch.arange(start, start + k.shape[0])
        table = torch.tensor(s.units, dtype=torch.int64)
        slots = (table[pos // bs] * bs + pos % bs).to(self.spec.torch_device)
        ops.write_kv(self.key_cache(layer), self.value_cache(layer), k, v, slots)

    def _gather(self, s: SeqState, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(s.units, dtype=torch.int64, device=self.spec.torch_device)
        shape = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        k = self.key_cache(layer)[idx].reshape(shape)[:s.seq_len]
        v = self.value_cache(layer)[idx].reshape(shape)[:s.seq_len]
        return k, v  # advanced indexing already made copies

    def _build_metadata(self, batch: Sequence[StepSeq], states: list[SeqState], pad_to: int | None,
                        out: torch.Tensor | None) -> AttentionMetadata:
        """``block_tables int32 [num_seqs, width]`` (one fancy index of the host block-table rows,
        padded with 0; width a multiple of 16, the full ``max_blocks_per_seq`` for a padded graph step) and the slot
        mapping ``block_table[p // block_size] * block_size + p % block_size`` (one numpy
        expression)."""
        bs = self.block_size
        # a multiple of 16 columns (capped at max_blocks_per_seq): the kernels' table stride then
        # takes one Triton specialization, not a recompile whenever the widest sequence crosses one
        width = self.max_blocks_per_seq if pad_to is not None else min(
            self.max_blocks_per_seq, -(-max(len(s.units) for s in states) // 16) * 16)
        bt = self.blocks.tables.gather((s.row for s in states), len(states), width)
        seq_index, positions = step_token_positions(batch) if batch else (np.zeros(0, np.int64),) * 2
        slots = bt[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        return build_metadata(batch, device=self.spec.torch_device, block_tables=bt, slot_mapping=slots,
                              pad_to=pad_to, out=out, staging=self._staging,
                              plan=lambda rows, longest: ops.plan_decode(
                                  rows, self.spec.num_kv_heads,
                                  self.max_model_len if pad_to is not None else longest,
                                  self.spec.torch_device, self.spec.dtype, self.spec.head_dim, bs))

    @property
    def supports_cuda_graphs(self) -> bool:
        return ops.plan_decode(1, self.spec.num_kv_heads, 1, self.spec.torch_device, self.spec.dtype,
                               self.spec.head_dim, self.block_size) > 0 and not self.block_size & (self.block_size - 1)

    def _graph_table_width(self) -> int:
        return self.max_blocks_per_seq

    def _scatter(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        ops.write_kv(self.key_cache(layer), self.value_cache(layer), k, v, meta.slot_mapping)

    def _attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return ops.paged_attention(
            q, self.key_cache(layer), self.value_cache(layer), meta.block_tables,
            meta.query_start_loc, meta.seq_lens, seq_lens_host=meta.seq_lens_host,
            query_lens_host=meta.query_lens_host, max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len, scale=scale, num_splits=meta.num_splits,
            workspace=meta.workspace, num_decodes=meta.num_decodes)

    # ------------------------------------------------------------------ introspection hooks
    def _memory_usage(self) -> dict:
        """allocated = blocks in use; waste = allocated minus the positions they cover (counted
        by the block manager); created = mapped = reserved = capacity = the whole preallocated pool."""
        capacity = self.num_blocks * self.block_bytes
        allocated = self.pool.num_used_blocks * self.block_bytes
        return dict(allocated_bytes=allocated,
                    waste_bytes=allocated - self.spec.kv_bytes(self.blocks.num_covered_tokens),
                    capacity_bytes=capacity, mapped_bytes=capacity, reserved_bytes=capacity,
                    created_bytes=capacity, free_tokens=self.free_tokens)

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
            "num_cow_copies": self.num_cow_copies,
            "num_prefix_evictions": self.pool.num_evictions,
        }

    def _check_units(self) -> None:
        self.blocks.check_integrity(self.seqs)

    def _close(self) -> None:
        self._kv = None
        self.blocks.reset()
