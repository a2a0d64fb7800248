"""Unmodified ``torch.nn.functional.scaled_dot_product_attention`` on vmem slot views.

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
    if not len(slots) == len(seq_lens) == len(query_lens):
        raise ValueError(
            f"slots ({len(slots)}), seq_lens ({len(seq_lens)}) and query_lens ({len(query_lens)}) "
            f"must have one entry per sequence"
        )
    if sum(query_lens) != q.shape[0]:
        raise ValueError(f"query_lens sum to {sum(query_lens)} but q has {q.shape[0]} tokens")
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
    start = 0
    for slot, length, n in zip(slots, seq_lens, query_lens):
        k = key_cache[slot, :length].transpose(0, 1).unsqueeze(0)      # [1, Hkv, L, D] view
        v = value_cache[slot, :length].transpose(0, 1).unsqueeze(0)
        qs = q[start:start + n].transpose(0, 1).unsqueeze(0)           # [1, Hq, n, D]
        out[start:start + n] = _sdpa(qs, k, v, n, length, scale)[0].transpose(0, 1)
        start += n
    return out
