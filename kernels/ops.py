"""Dispatch of the cache's per-step operations: Triton kernels on CUDA, torch references elsewhere.

Backends call only these functions; each takes explicit tensors (no engine types).
"""

from __future__ import annotations

import torch

from vmkv.kernels import reference as ref


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter ``k, v: [num_tokens, H, D]`` into ``[dim0, dim1, H, D]`` cache views at
    ``slot_mapping: int64 [num_tokens]`` (flat ``index0 * dim1 + index1``)."""
    ref.write_kv_ref(key_cache, value_cache, k, v, slot_mapping)


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, *, seq_lens_host: list[int], query_lens_host: list[int],
                    max_query_len: int, max_seq_len: int, scale: float) -> torch.Tensor:
    """Causal attention over a paged cache.

    Args:
        q: ``[num_tokens, num_heads, D]``.
        key_cache, value_cache: ``[num_blocks, block_size, H, D]``.
        block_tables: ``int32 [num_seqs, max_blocks]``.
        query_start_loc: ``int32 [num_seqs + 1]``; seq_lens: ``int32 [num_seqs]``.
    Returns:
        ``[num_tokens, num_heads, D]`` in ``q.dtype``.
    """
    return ref.paged_attention_ref(q, key_cache, value_cache, block_tables, seq_lens_host,
                                   query_lens_host, scale)


def contiguous_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         slot_indices: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, *, seq_lens_host: list[int],
                         query_lens_host: list[int], max_query_len: int, max_seq_len: int,
                         scale: float, slot_indices_host: list[int] | None = None) -> torch.Tensor:
    """Causal attention over virtually contiguous slots.

    Args:
        q: ``[num_tokens, num_heads, D]``.
        key_cache, value_cache: ``[max_num_seqs, max_model_len, H, D]`` strided views.
        slot_indices: ``int32 [num_seqs]``.
    Returns:
        ``[num_tokens, num_heads, D]`` in ``q.dtype``.
    """
    slots = slot_indices_host if slot_indices_host is not None else slot_indices
    return ref.contiguous_attention_ref(q, key_cache, value_cache, slots, seq_lens_host,
                                        query_lens_host, scale)
