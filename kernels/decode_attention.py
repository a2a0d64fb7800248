"""Decode attention (one query token per sequence) for the paged and the contiguous layout.

Algorithm: flash-decoding (Dao et al., "Flash-Decoding for long-context inference", 2023; the split-K
of FlashAttention-2, Dao 2023, section 3.1): the context of each sequence is cut into ``num_splits``
chunks processed by separate programs with an online softmax (Milakov & Gimelshein 2018), each writing
a normalised partial output and its log-sum-exp; a second kernel merges the chunks.  With one split
the first kernel writes the output directly and the merge is skipped.

GQA: a program owns one KV head and all ``num_heads // num_kv_heads`` query heads that read it, so K and
V are loaded once per step (the query rows are padded to 16 for ``tl.dot``).

Layouts are one kernel body with a compile-time switch ``PAGED`` (DESIGN.md, "Kernels"), so that the
only difference between the two is how a token's row address is found:
- paged: ``block_tables[seq, pos // BLOCK_SIZE] * stride0 + (pos % BLOCK_SIZE) * stride1``;
- contiguous (vmem slot): ``slot_indices[seq] * stride0 + pos * stride1``.
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
def _decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, table_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    kc_s0, kc_s1, kc_sh, vc_s0, vc_s1, vc_sh, kc_off, vc_off,
    stride_table,
    stride_ps, stride_ph, stride_pk, stride_ls, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, SPLIT: tl.constexpr,
    SAME_STRIDES: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # each sequence cuts its own context into the grid's splits (tiles of BLOCK_N), so a grid sized
    # for the longest possible context (a captured CUDA graph) still spreads a short one; a padding
    # row (seq_len 0) reads nothing
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = (kvh * GROUP + offs_g).to(tl.int64)
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)

    k_base = kc_ptr + kc_off + kvh.to(tl.int64) * kc_sh
    v_base = vc_ptr + vc_off + kvh.to(tl.int64) * vc_sh
    table_row = table_ptr
    if PAGED:
        table_row = table_ptr + seq * stride_table
    else:
        slot = tl.load(table_ptr + seq).to(tl.int64)
        k_base += slot * kc_s0
        v_base += slot * vc_s0

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        k_rows, v_rows = kv_rows(table_row, offs_n, n0, mask_n, kc_s0, kc_s1, vc_s0, vc_s1,
                                 BLOCK_N, BLOCK_SIZE, PAGED, SAME_STRIDES)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_base + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k), DOT_PRECISION, UPCAST) * qk_scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m_i = m_new

    if SPLIT:
        # normalised partial output and its log2-sum-exp; an empty split writes lse = -inf, out = 0
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        po = part_out_ptr + seq * stride_ps + heads[:, None] * stride_ph + split * stride_pk + offs_d[None, :]
        tl.store(po, acc / safe_l[:, None], mask=mask_g[:, None] & mask_d[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=mask_g)
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]       # padding row: 0
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_ps, stride_ph, stride_pk, stride_ls, stride_lh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    # merge the splits of one (sequence, query head): out = sum_i w_i o_i / sum_i w_i, w_i = 2^(lse_i - max)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    lse_row = part_lse_ptr + seq * stride_ls + head * stride_lh
    offs_all = tl.arange(0, SPLITS_PAD)
    m = tl.max(tl.load(lse_row + offs_all, mask=offs_all < num_splits, other=float("-inf")), 0)
    m = tl.where(m == float("-inf"), 0.0, m)                # padding row (seq_len 0): every split empty
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], tl.float32)
    denom = tl.zeros([CHUNK], tl.float32)
    po_row = part_out_ptr + seq * stride_ps + head * stride_ph
    for k0 in range(0, num_splits, CHUNK):
        offs_k = k0 + tl.arange(0, CHUNK)
        mask_k = offs_k < num_splits
        w = tl.exp2(tl.load(lse_row + offs_k, mask=mask_k, other=float("-inf")) - m)  # empty split: 0
        po = tl.load(po_row + offs_k[:, None] * stride_pk + offs_d[None, :],
                     mask=mask_k[:, None] & mask_d[None, :], other=0.0)
        acc += tl.sum(po * w[:, None], 0)
        denom += w
    total = tl.sum(denom, 0)  # >= 1 unless the row is padding (seq_len 0: output 0)
    o = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=mask_d)


def default_launch(head_dim: int, block_size: int | None = None) -> tuple[int, int, int, float]:
    """``(block_n, num_warps, num_stages, waves)`` used when not given; tuned on the H200 at batch 64 x
    4096, GQA 4, head_dim 128, bf16 (docs/results/kernels/README.md).

    ``block_size``: paged blocks (``None`` for contiguous slots).  When a tile spans several blocks, the
    block-table load and the K/V load that depends on it form a chain that a 2-stage pipeline does not
    hide at large batches (paged block 16 was 1.19x contiguous at 256 x 4096 with 2 stages, equal with
    4: ``kernel_bench_probe.json``), so such paged launches use 4 stages."""
    block_n = 64 if _checks.head_block(head_dim) <= 128 else 32
    stages = 4 if block_size is not None and block_size < block_n else 2
    return block_n, 4, stages, 2.0


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                      block_n: int, min_tokens_per_split: int = 256, waves: float = 2.0) -> int:
    """Splits of the context so that ``num_seqs * num_kv_heads * splits`` fills about ``waves`` waves
    of programs on the device's SMs, with at least ``min_tokens_per_split`` tokens per split."""
    programs = num_seqs * num_kv_heads
    target = int(waves * _checks.num_sms(device))
    by_fill = -(-target // programs)
    by_length = max(1, max_seq_len // max(min_tokens_per_split, block_n))
    return max(1, min(by_fill, by_length, 256))


def plan_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                    block_n: int, waves: float = 2.0) -> int:
    """The split-K grid of a decode launch: :func:`choose_num_splits`, then trimmed to the number of
    ``block_n``-token tiles that ``max_seq_len`` fills when cut evenly (no split of the longest
    sequence is empty)."""
    num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, device, block_n, waves=waves)
    tokens_per_split = -(-max_seq_len // num_splits)
    tokens_per_split = -(-tokens_per_split // block_n) * block_n
    return -(-max_seq_len // tokens_per_split)


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     seq_lens: torch.Tensor, *, max_seq_len: int, scale: float,
                     block_tables: torch.Tensor | None = None,
                     slot_indices: torch.Tensor | None = None,
                     key_anchor: torch.Tensor | None = None, value_anchor: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, num_splits: int | None = None,
                     block_n: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, workspace: dict | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its cached K/V (paged or contiguous layout).

    Exactly one of ``block_tables`` (paged) and ``slot_indices`` (contiguous vmem slots) is given.

    Args:
        q: ``[num_seqs, num_heads, head_dim]`` fp16/bf16/fp32, the token at position ``seq_len - 1``
            of each sequence (its K/V already written).
        key_cache, value_cache: paged ``[num_blocks, block_size, num_kv_heads, head_dim]`` or vmem
            ``[max_num_seqs, max_model_len, num_kv_heads, head_dim]`` views, any strides with
            ``stride(-1) == 1``, same dtype as ``q``.
        seq_lens: ``int32 [num_seqs]``: context length of each sequence including the new token;
            0 marks a padding row (nothing read, output 0).
        max_seq_len: host int, ``max(seq_lens)`` or an upper bound (sizes the split-K grid without a
            device sync when ``num_splits`` is not given).
        scale: softmax scale (usually ``head_dim ** -0.5``).
        block_tables: paged: ``int32 [num_seqs, max_blocks_per_seq]`` physical block ids.
        slot_indices: contiguous: ``int32 [num_seqs]`` slot of each sequence.
        key_anchor, value_anchor: optional always-backed elements at or below the cache views, passed
            as the launch's pointers (:func:`vmkv.kernels._checks.launch_base`).
        out: optional ``[num_seqs, num_heads, head_dim]`` output in ``q.dtype`` (written fully).
        num_splits: split-K grid size (default: :func:`plan_num_splits` for ``max_seq_len``); each
            sequence divides its own context over it, so the launch depends on no device value
            (CUDA-graph capturable).
        workspace: a dict kept for one step: the split-K partials are allocated on the first call
            and reused by later calls of the same shape (every layer of a step).
        block_n, num_warps, num_stages: tile size in tokens and launch configuration (default:
            :func:`default_launch`).
    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``.
    Raises:
        ValueError: wrong dtype/device/shape/stride, or both/neither of block_tables and slot_indices.
    """
    group = _checks.check_attention_inputs(q, key_cache, value_cache)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
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
        if block_tables.shape[1] * block_size < max_seq_len:
            raise ValueError(
                f"block_tables has {block_tables.shape[1]} blocks of {block_size} tokens, fewer than "
                f"max_seq_len {max_seq_len}"
            )
    else:
        _checks.check_index("slot_indices", slot_indices, (num_seqs,))
        table, stride_table, block_size = slot_indices, 0, 1
        if max_seq_len > key_cache.shape[1]:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the slot length {key_cache.shape[1]}")
    _checks.check_index("seq_lens", seq_lens, (num_seqs,))
    _checks.check_same_device(q.device, seq_lens=seq_lens, table=table)
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1 (the new token is in the cache), got {max_seq_len}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with stride(-1) == 1")
    if num_seqs == 0:
        return out

    block_d = _checks.head_block(head_dim)
    d_block_n, d_warps, d_stages, waves = default_launch(
        head_dim, None if block_tables is None else key_cache.shape[1])
    block_n = block_n or d_block_n
    num_warps = num_warps or d_warps
    num_stages = num_stages or d_stages
    if num_splits is None:
        num_splits = plan_num_splits(num_seqs, num_kv_heads, max_seq_len, q.device, block_n, waves)
    split = num_splits > 1
    if split:
        key = ("decode_partials", num_seqs, num_heads, num_splits, head_dim, q.device)
        bufs = None if workspace is None else workspace.get(key)
        if bufs is None:
            bufs = (torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                                device=q.device),
                    torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device))
            if workspace is not None:
                workspace[key] = bufs
        part_out, part_lse = bufs
    else:
        part_out = part_lse = out  # unused
    kc_ptr, kc_off = _checks.launch_base("key_cache", key_cache, key_anchor)
    vc_ptr, vc_off = _checks.launch_base("value_cache", value_cache, value_anchor)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kc_ptr, vc_ptr, table, seq_lens, out, part_out, part_lse,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), kc_off, vc_off,
        stride_table,
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if split else 0,
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, GROUP_PAD=max(16, _checks.next_pow2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=block_n, BLOCK_SIZE=block_size, PAGED=paged, SPLIT=split,
        SAME_STRIDES=key_cache.stride()[:3] == value_cache.stride()[:3], **dot_flags(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS_PAD=max(2, _checks.next_pow2(num_splits)),
            CHUNK=min(16, max(2, _checks.next_pow2(num_splits))), num_warps=4 if block_d >= 128 else 2,
        )
    return out
