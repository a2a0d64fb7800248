"""Prefill attention: causal, variable-length, over cached prefix + new tokens, both layouts.

Algorithm: FlashAttention-2 forward (Dao 2023, "FlashAttention-2", algorithm 1): a program owns a
tile of ``BLOCK_M`` queries of one sequence and one query head, streams the sequence's K/V in tiles of
``BLOCK_N`` tokens with an online softmax, and skips tiles above the causal diagonal.  Queries of a
step's chunk sit at positions ``seq_len - query_len .. seq_len - 1`` (the causal mask is aligned
bottom-right), so one kernel serves full prefill, chunked prefill, prefix-cache hits and mixed
prefill/decode batches (a decode token is a chunk of length 1).  The new tokens' K/V must already be
in the cache (``write_kv`` runs first, as in vLLM).

The K/V row address comes from a compile-time switch ``PAGED`` exactly as in
:mod:`vmkv.kernels.decode_attention`: block table (paged) or slot base + position stride (vmem).
Tiles below the diagonal run without masks; only the diagonal tiles pay for the causal mask.
Reference: :func:`vmkv.kernels.reference.paged_attention_ref` / ``contiguous_attention_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vmkv.kernels import _checks
from vmkv.kernels._tl_utils import dot_flags, kv_rows, mma

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_base, v_base, table_row, n0, qpos, seq_len, qk_scale,
                 offs_d, mask_d,
                 kc_s0, kc_s1, vc_s0, vc_s1,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr,
                 SAME_STRIDES: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k_rows, v_rows = kv_rows(table_row, offs_n, n0, offs_n < seq_len, kc_s0, kc_s1, vc_s0, vc_s1,
                             BLOCK_N, BLOCK_SIZE, PAGED, SAME_STRIDES)
    if MASKED:
        kv_mask = (offs_n < seq_len)[:, None] & mask_d[None, :]
        k = tl.load(k_base + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_base + k_rows[:, None] + offs_d[None, :], mask=mask_d[None, :], other=0.0)
        v = tl.load(v_base + v_rows[:, None] + offs_d[None, :], mask=mask_d[None, :], other=0.0)
    s = mma(q, tl.trans(k), DOT_PRECISION, UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        causal = (offs_n[None, :] <= qpos[:, None]) & (offs_n < seq_len)[None, :]
        s = tl.where(causal, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
    return acc, m_new, l_i


# seq_start: a mixed step's first prompt row (its decode rows run in the decode kernel); not
# specialized, so every split of a mixed step runs the same compiled variant
@triton.jit(do_not_specialize=["seq_start"])
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, table_ptr, qsl_ptr, seq_lens_ptr, seq_start,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    kc_s0, kc_s1, kc_sh, vc_s0, vc_s1, vc_sh, kc_off, vc_off,
    stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr,
    SAME_STRIDES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # the longest query tiles (most KV tiles under the diagonal) are launched first
    mb = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64) + seq_start
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if mb * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < q_len
        mask_d = offs_d < HEAD_DIM
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head.to(tl.int64) * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        qpos = ctx + offs_m

        kvh = (head // GROUP).to(tl.int64)
        k_base = kc_ptr + kc_off + kvh * kc_sh
        v_base = vc_ptr + vc_off + kvh * vc_sh
        table_row = table_ptr
        if PAGED:
            table_row = table_ptr + seq * stride_table
        else:
            slot = tl.load(table_ptr + seq).to(tl.int64)
            k_base += slot * kc_s0
            v_base += slot * vc_s0

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # tiles entirely at or below the first query's position need no mask
        first_q = ctx + mb * BLOCK_M
        full_end = (first_q + 1) // BLOCK_N * BLOCK_N
        hi = tl.minimum(seq_len, ctx + (mb + 1) * BLOCK_M)
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, table_row, n0, qpos, seq_len,
                                         qk_scale, offs_d, mask_d, kc_s0, kc_s1, vc_s0, vc_s1,
                                         BLOCK_N, BLOCK_SIZE, PAGED, SAME_STRIDES, False, DOT_PRECISION, UPCAST)
        for n0 in range(full_end, hi, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, table_row, n0, qpos, seq_len,
                                         qk_scale, offs_d, mask_d, kc_s0, kc_s1, vc_s0, vc_s1,
                                         BLOCK_N, BLOCK_SIZE, PAGED, SAME_STRIDES, True, DOT_PRECISION, UPCAST)
        o = acc / l_i[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head.to(tl.int64) * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def default_config(head_dim: int, max_query_len: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; head_dim 128 in 16-bit was tuned on the H200 at
    8K context (docs/results/kernels/README.md), the same for both layouts; the rest are sized to
    stay within registers and shared memory."""
    block_d = _checks.head_block(head_dim)
    if dtype == torch.float32:
        return 32, 32, 4, 2
    if max_query_len <= 16:
        return 16, 64, 4, 2
    if block_d <= 64:
        return 128, 64, 4, 3
    if block_d <= 128:
        return 128, 128, 8, 3
    return 64, 32, 8, 2


def prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *,
                      max_query_len: int, scale: float,
                      block_tables: torch.Tensor | None = None,
                      slot_indices: torch.Tensor | None = None,
                      key_anchor: torch.Tensor | None = None,
                      value_anchor: torch.Tensor | None = None,
                      out: torch.Tensor | None = None,
                      config: tuple[int, int, int, int] | None = None,
                      seq_start: int = 0) -> torch.Tensor:
    """Causal varlen attention of each sequence's new tokens over its cached prefix and themselves.

    Exactly one of ``block_tables`` (paged) and ``slot_indices`` (contiguous vmem slots) is given.

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` fp16/bf16/fp32: the new tokens of all sequences,
            concatenated in batch order; sequence ``i``'s tokens sit at positions
            ``seq_lens[i] - query_len_i .. seq_lens[i] - 1``.
        key_cache, value_cache: paged ``[num_blocks, block_size, num_kv_heads, head_dim]`` or vmem
            ``[max_num_seqs, max_model_len, num_kv_heads, head_dim]`` views (any strides,
            ``stride(-1) == 1``), holding every position below ``seq_lens`` (new tokens included).
        query_start_loc: ``int32 [num_seqs + 1]`` cumulative query lengths (``cu_seqlens_q``).
        seq_lens: ``int32 [num_seqs]`` context length after the step (cached + new).
        max_query_len: host int, the largest query length (sizes the grid).
        scale: softmax scale.
        block_tables: paged: ``int32 [num_seqs, max_blocks_per_seq]``.
        slot_indices: contiguous: ``int32 [num_seqs]``.
        key_anchor, value_anchor: optional always-backed elements at or below the cache views, passed
            as the launch's pointers (:func:`vmkv.kernels._checks.launch_base`).
        out: optional ``[num_tokens, num_heads, head_dim]`` output in ``q.dtype``.
        config: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` override.
        seq_start: attend only sequences ``seq_start ..`` (a mixed step whose first ``seq_start``
            one-token rows the decode kernel handles); their tokens keep their offsets in ``q`` and
            ``out``, the rest of ``out`` is left as it was.
    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    Raises:
        ValueError: wrong dtype/device/shape/stride, or both/neither of block_tables and slot_indices.
    """
    group = _checks.check_attention_inputs(q, key_cache, value_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) and seq_lens.dim() == 1 else -1
    _checks.check_index("seq_lens", seq_lens, (max(num_seqs, 0),))
    _checks.check_index("query_start_loc", query_start_loc, (num_seqs + 1,))
    paged = block_tables is not None
    if paged == (slot_indices is not None):
        raise ValueError("pass exactly one of block_tables (paged) and slot_indices (contiguous)")
    if paged:
        if block_tables.dim() != 2:
            raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}")
        _checks.check_index("block_tables", block_tables, (num_seqs, block_tables.shape[1]))
        table, stride_table, block_size = block_tables, block_tables.stride(0), key_cache.shape[1]
        if block_size & (block_size - 1):
            raise ValueError(f"paged block_size must be a power of 2, got {block_size}")
    else:
        _checks.check_index("slot_indices", slot_indices, (num_seqs,))
        table, stride_table, block_size = slot_indices, 0, 1
    _checks.check_same_device(q.device, seq_lens=seq_lens, query_start_loc=query_start_loc, table=table)
    if max_query_len < 1 and num_tokens:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with stride(-1) == 1")
    if isinstance(seq_start, bool) or not isinstance(seq_start, int) or not 0 <= seq_start <= max(num_seqs, 0):
        raise ValueError(f"seq_start must be an int in [0, num_seqs={num_seqs}], got {seq_start!r}")
    if num_tokens == 0 or num_seqs == seq_start:
        return out
    block_d = _checks.head_block(head_dim)
    block_m, block_n, num_warps, num_stages = config or default_config(head_dim, max_query_len, q.dtype)
    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs - seq_start)
    kc_ptr, kc_off = _checks.launch_base("key_cache", key_cache, key_anchor)
    vc_ptr, vc_off = _checks.launch_base("value_cache", value_cache, value_anchor)
    _prefill_kernel[grid](
        q, kc_ptr, vc_ptr, out, table, query_start_loc, seq_lens, seq_start,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), kc_off, vc_off,
        stride_table,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, PAGED=paged, SAME_STRIDES=key_cache.stride()[:3] == value_cache.stride()[:3],
        **dot_flags(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
