"""Unmodified ``torch.nn.functional.scaled_dot_product_attention`` on vmem slot views, and on paged
blocks gathered into a contiguous view (the CPU path of both backends: torch's CPU flash kernel).

vAttention's thesis (Prabhu et al., "vAttention: Dynamic Memory Management for Serving LLMs without
PagedAttention", ASPLOS 2025, section 3): when each request's K/V is virtually contiguous, an
attention kernel written for contiguous tensors runs unchanged.  Here a slot's K is the view
``key_cache[slot, :seq_len]`` (``[seq_len, H, D]``, any token stride: megacache or per-layer) and SDPA
sees it as ``[1, H, seq_len, D]`` through ``transpose`` without a copy.

SDPA has no variable-length batch entry point, so a batch is one call when every sequence has the
same lengths and the slots are consecutive (one strided view covers them all) and otherwise one call
per sequence.  The causal mask is aligned bottom-right (queries are the last ``query_len`` positions):
``is_causal`` when the query covers the whole context, no mask for a single query token, and an
explicit boolean mask otherwise (chunked prefill).

The paged layout (:func:`sdpa_paged_attention`) gathers each sequence's blocks into one contiguous
``[seq_len, H, D]`` copy (once per sequence per layer call) and runs the same per-sequence SDPA.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_len: int, seq_len: int,
          scale: float) -> torch.Tensor:
    """q ``[B, Hq, n, D]``, k/v ``[B, Hkv, L, D]`` (views) -> ``[B, Hq, n, D]``."""
    gqa = q.shape[1] != k.shape[1]
    if query_len == seq_len and query_len > 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if query_len == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    qpos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
    mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos  # [n, L], bottom-right causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def sdpa_slot_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        slots: Sequence[int], seq_lens: Sequence[int], query_lens: Sequence[int],
                        scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens with SDPA on zero-copy slot views.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, sequences' new tokens concatenated.
        key_cache, value_cache: ``[max_num_seqs, max_model_len, num_kv_heads, head_dim]`` views (any
            strides, ``stride(-1) == 1`` for SDPA's fused backends), holding positions ``< seq_len``.
        slots, seq_lens, query_lens: host ints per sequence (slot, context after the step, new tokens).
        scale: softmax scale.
        out: optional ``[num_tokens, num_heads, head_dim]`` output.
    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    Raises:
        ValueError: the per-sequence lists disagree in length or with ``q``.
    """
    slots, seq_lens, query_lens = list(slots), list(seq_lens), list(query_lens)
    _check_lists(q, seq_lens, query_lens, len(slots), "slots")
    if out is None:
        out = torch.empty_like(q)
    num_seqs = len(slots)
    if num_seqs == 0:
        return out
    n, length = query_lens[0], seq_lens[0]
    uniform = all(x == n for x in query_lens) and all(x == length for x in seq_lens)
    consecutive = slots == list(range(slots[0], slots[0] + num_seqs))
    if uniform and consecutive:
        s0 = slots[0]
        k = key_cache[s0:s0 + num_seqs, :length].transpose(1, 2)      # [B, Hkv, L, D] view
        v = value_cache[s0:s0 + num_seqs, :length].transpose(1, 2)
        qb = q.view(num_seqs, n, *q.shape[1:]).transpose(1, 2)         # [B, Hq, n, D]
        o = _sdpa(qb, k, v, n, length, scale)
        out.view(num_seqs, n, *q.shape[1:]).copy_(o.transpose(1, 2))
        return out
    _per_sequence(q, out, ((key_cache[slot, :length], value_cache[slot, :length], length, n)
                           for slot, length, n in zip(slots, seq_lens, query_lens)), scale)
    return out


def _per_sequence(q: torch.Tensor, out: torch.Tensor, seqs, scale: float) -> None:
    """One SDPA call per sequence; ``seqs`` yields ``(k, v, seq_len, query_len)`` with k/v
    ``[seq_len, Hkv, D]`` (views or copies); writes ``out`` in place."""
    start = 0
    for k, v, length, n in seqs:
        kb = k.transpose(0, 1).unsqueeze(0)                            # [1, Hkv, L, D] view
        vb = v.transpose(0, 1).unsqueeze(0)
        qs = q[start:start + n].transpose(0, 1).unsqueeze(0)           # [1, Hq, n, D]
        out[start:start + n] = _sdpa(qs, kb, vb, n, length, scale)[0].transpose(0, 1)
        start += n


def _check_lists(q: torch.Tensor, seq_lens: list[int], query_lens: list[int], num_seqs: int,
                 what: str) -> None:
    if not num_seqs == len(seq_lens) == len(query_lens):
        raise ValueError(
            f"{what} ({num_seqs}), seq_lens ({len(seq_lens)}) and query_lens ({len(query_lens)}) "
            f"must have one entry per sequence"
        )
    if sum(query_lens) != q.shape[0]:
        raise ValueError(f"query_lens sum to {sum(query_lens)} but q has {q.shape[0]} tokens")


def sdpa_paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: Sequence[int],
                         query_lens: Sequence[int], scale: float,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over a paged cache with SDPA: each sequence's blocks are gathered into one
    contiguous ``[seq_len, H, D]`` copy (one ``index_select`` per K and V), then the per-sequence
    SDPA of :func:`sdpa_slot_attention` runs on it.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, sequences' new tokens concatenated.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``int [num_seqs, max_blocks]`` (on the cache's device).
        seq_lens, query_lens: host ints per sequence (context after the step, new tokens).
        scale: softmax scale.
        out: optional ``[num_tokens, num_heads, head_dim]`` output.
    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    Raises:
        ValueError: the per-sequence lists disagree in length or with ``q``.
    """
    seq_lens, query_lens = list(seq_lens), list(query_lens)
    _check_lists(q, seq_lens, query_lens, block_tables.shape[0], "block_tables rows")
    if out is None:
        out = torch.empty_like(q)
    block_size = key_cache.shape[1]
    kv_shape = key_cache.shape[2:]

    def gathered():
        for i, (length, n) in enumerate(zip(seq_lens, query_lens)):
            blocks = block_tables[i, :-(-length // block_size)].long()
            k = key_cache.index_select(0, blocks).reshape(-1, *kv_shape)[:length]
            v = value_cache.index_select(0, blocks).reshape(-1, *kv_shape)[:length]
            yield k, v, length, n

    _per_sequence(q, out, gathered(), scale)
    return out
