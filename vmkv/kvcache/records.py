"""Records of the KV-cache interface: usage snapshots, step entries, step metadata.

Torch-free at import (tensors appear only in annotations), so the host-side bookkeeping that uses
``StepSeq`` imports without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["CacheUsage", "StepSeq", "AttentionMetadata"]


@dataclass(frozen=True)
class CacheUsage:
    """A snapshot of a cache's memory.  All ``*_bytes`` count K and V of all layers.

    Attributes:
        num_seqs: live sequences.
        used_tokens: sum of ``seq_len`` over live sequences (logical tokens, shared ones counted
            once per sequence that uses them).
        allocated_bytes: KV memory physically backing sequences now (blocks in use by a live
            sequence; pages mapped into a live slot).  Shared units count once.
        waste_bytes: part of ``allocated_bytes`` that holds no token of any live sequence
            (block or page tails, over-mapped pages).
        capacity_bytes: KV memory the cache may back in total (its budget).
        mapped_bytes: physical memory held by the backend now, including free-but-kept units
            (cached free blocks, pages kept mapped by deferred reclamation).
        reserved_bytes: virtual address space reserved (vmem; equals capacity for paged).
        free_tokens: token positions the free KV memory can still back, pool-wide (free blocks x
            block size; obtainable pages x tokens per page), not capped at ``max_model_len``.  While
            fewer than ``max_num_seqs`` sequences are live, ``can_allocate(n)`` holds for
            ``n <= min(free_tokens, max_model_len)`` (vmem: up to a page tail less when a page
            holds a fractional number of tokens).
        prefix_query_tokens / prefix_hit_tokens: prompt tokens looked up / found in the prefix cache.
        num_cow_copies: copy-on-write copies made so far.
        unit_tokens: tokens per allocation unit (block size, or tokens per page; 0 if fractional).
        created_bytes: physical KV memory that exists now (paged: the whole pool, created up front;
            vmem: pages created and not yet released back to the device), >= ``mapped_bytes``.
    """

    num_seqs: int
    used_tokens: int
    allocated_bytes: int
    waste_bytes: int
    capacity_bytes: int
    mapped_bytes: int = 0
    reserved_bytes: int = 0
    free_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_cow_copies: int = 0
    unit_tokens: int = 0
    created_bytes: int = 0

    @property
    def waste_pct(self) -> float:
        return 100.0 * self.waste_bytes / self.allocated_bytes if self.allocated_bytes else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass(frozen=True)
class StepSeq:
    """One sequence scheduled in a step.

    Args:
        seq_id: a live sequence.
        num_computed_tokens: positions ``0..num_computed_tokens-1`` already hold K/V.
        num_new_tokens: this step writes positions ``num_computed_tokens ..
            num_computed_tokens + num_new_tokens - 1`` (the query length; 1 for decode).
    Raises:
        ValueError: ``num_new_tokens < 1`` or ``num_computed_tokens < 0``.
    """

    seq_id: int
    num_computed_tokens: int
    num_new_tokens: int

    def __post_init__(self) -> None:
        # the one check of an entry (prepare() and the metadata builders rely on it)
        if self.num_new_tokens < 1 or self.num_computed_tokens < 0:
            raise ValueError(f"bad {self}: num_new_tokens must be >= 1, num_computed_tokens >= 0")


@dataclass
class AttentionMetadata:
    """Built once per step by :meth:`KVCache.prepare`, passed to every layer.

    Common fields (on the cache's device):
        seq_ids: the step's sequences, in batch order (host list).
        query_start_loc: ``int32 [num_seqs + 1]``, cumulative new-token counts (cu_seqlens_q).
        seq_lens: ``int32 [num_seqs]``, context length after this step (computed + new).
        context_lens: ``int32 [num_seqs]``, tokens already cached before this step.
        positions: ``int64 [num_tokens]``, position of every new token.
        slot_mapping: ``int64 [num_tokens]``, flat write index of every new token into the
            ``[dim0, dim1, H, D]`` cache view: ``index0 * dim1 + index1`` (paged: block id and
            offset in block; vmem: slot and position).
        max_query_len, max_seq_len: host ints.
        is_decode: every sequence has exactly one new token.
    Backend fields:
        block_tables: paged: ``int32 [num_seqs, max_blocks_per_seq]`` (padded with 0).
        slot_indices: vmem: ``int32 [num_seqs]``, each sequence's slot.
        last_token_indices: ``int64 [num_seqs]``, index in the step's tokens of each sequence's
            last new token (where logits are read).
        slot_indices_host: vmem: the slots as host ints (the sdpa and reference paths).
    Launch plan (decided once per step, not per layer):
        num_splits: split-K chunks of the decode kernel (0: chosen per call from ``max_seq_len``);
            in a mixed step, the plan of its decode rows.
        num_decodes: the leading sequences of the batch with one new token each (the scheduler puts
            decodes first, as vLLM v1 orders its batch); ``num_seqs`` for a decode step.  A mixed
            step runs these rows through the decode kernel and only the rest through the prefill
            kernel, whose query tiles would otherwise hold one real row out of ``BLOCK_M`` and read
            the context once per query head instead of once per KV head.
        workspace: scratch tensors a kernel allocates on its first layer and reuses in the others.
        num_padded_seqs: rows of the device tensors; above ``num_seqs`` when ``prepare(pad_to=)``
            padded a decode step to a captured CUDA graph's batch size (padding rows: seq_len 0,
            slot_mapping -1).
    """

    seq_ids: list
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    is_decode: bool
    last_token_indices: torch.Tensor
    block_tables: torch.Tensor | None = None
    slot_indices: torch.Tensor | None = None
    # host copies for reference paths (avoid device syncs)
    seq_lens_host: list = field(default_factory=list)
    query_lens_host: list = field(default_factory=list)
    slot_indices_host: list | None = None
    # the step's launch plan, decided once in prepare(): decode split-K chunks (0: the kernel
    # chooses) and per-step workspaces the kernels fill on first use and reuse in every layer
    num_splits: int = 0
    num_decodes: int = 0
    workspace: dict = field(default_factory=dict)
    @property
    def num_padded_seqs(self) -> int:
        """Rows of the tensor fields: ``num_seqs``, or more when a decode step is padded to a graph's
        size."""
        return int(self.seq_lens.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])
