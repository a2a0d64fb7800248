"""Pure-torch reference implementations of the KV write and attention, for both layouts.

Both layouts are seen through a 4-D view ``[dim0, dim1, num_kv_heads, head_dim]``:
paged ``[num_blocks, block_size, H, D]`` (block id, offset) and vmem
``[max_num_seqs, max_model_len, H, D]`` (slot, position, any strides: megacache or per-layer).
These are the CPU path of both backends and the oracle for the Triton kernels.
"""

from __future__ import annotations

import torch


def write_kv_ref(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V into the cache.

    Args:
        key_cache, value_cache: ``[dim0, dim1, H, D]`` views (any strides), cache dtype.
        k, v: ``[num_tokens, H, D]``.
        slot_mapping: ``int64 [num_tokens]``, flat index ``index0 * dim1 + index1``; negative entries
            are padding rows and write nothing (as in the Triton kernel).
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    dim1 = key_cache.shape[1]
    i0 = torch.div(slot_mapping, dim1, rounding_mode="floor")
    i1 = slot_mapping - i0 * dim1
    key_cache[i0, i1] = k.to(key_cache.dtype)
    value_cache[i0, i1] = v.to(value_cache.dtype)


def attention_one_seq_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                          scale: float) -> torch.Tensor:
    """Causal attention of one sequence's new queries.

    Args:
        q: ``[n, num_heads, D]``: queries at positions ``context_len .. context_len + n - 1``.
        k, v: ``[context_len + n, num_kv_heads, D]``.
    Returns:
        ``[n, num_heads, D]`` in ``q.dtype`` (computed in float32, or float64 for float64 input).
    """
    n, num_heads, _ = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(acc).transpose(0, 1)                                   # [Hq, n, D]
    kf = k.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)   # [Hq, L, D]
    vf = v.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale                       # [Hq, n, L]
    length = k.shape[0]
    qpos = torch.arange(context_len, context_len + n, device=q.device)[:, None]
    kpos = torch.arange(length, device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf                         # [Hq, n, D]
    return out.transpose(0, 1).to(q.dtype)


def paged_attention_ref(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: list[int], query_lens: list[int],
                        scale: float) -> torch.Tensor:
    """Attention over a paged cache (block table indirection).

    Args:
        q: ``[num_tokens, num_heads, D]``, sequences' new tokens concatenated.
        key_cache, value_cache: ``[num_blocks, block_size, H, D]``.
        block_tables: ``int32 [num_seqs, max_blocks]``.
        seq_lens, query_lens: host ints per sequence (context after step, new tokens).
    Returns:
        ``[num_tokens, num_heads, D]``.
    """
    block_size = key_cache.shape[1]
    out = torch.empty_like(q)
    start = 0
    for i, (length, n) in enumerate(zip(seq_lens, query_lens)):
        nb = -(-length // block_size)
        blocks = block_tables[i, :nb].long()
        k = key_cache[blocks].reshape(-1, *key_cache.shape[2:])[:length]
        v = value_cache[blocks].reshape(-1, *value_cache.shape[2:])[:length]
        out[start:start + n] = attention_one_seq_ref(q[start:start + n], k, v, length - n, scale)
        start += n
    return out


def contiguous_attention_ref(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             slot_indices: torch.Tensor | list[int], seq_lens: list[int],
                             query_lens: list[int], scale: float) -> torch.Tensor:
    """Attention over virtually contiguous slots (vmem layouts).

    Args:
        q: ``[num_tokens, num_heads, D]``.
        key_cache, value_cache: ``[max_num_seqs, max_model_len, H, D]`` views (any strides).
        slot_indices: ``int32 [num_seqs]`` (tensor or host list): each sequence's slot.
        seq_lens, query_lens: host ints per sequence.
    Returns:
        ``[num_tokens, num_heads, D]``.
    """
    slots = slot_indices.tolist() if isinstance(slot_indices, torch.Tensor) else list(slot_indices)
    out = torch.empty_like(q)
    start = 0
    for slot, length, n in zip(slots, seq_lens, query_lens):
        k = key_cache[slot, :length]
        v = value_cache[slot, :length]
        out[start:start + n] = attention_one_seq_ref(q[start:start + n], k, v, length - n, scale)
        start += n
    return out
