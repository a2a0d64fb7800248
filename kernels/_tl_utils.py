"""Small Triton helpers shared by the attention kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vmkv.kernels import _checks


@triton.jit
def mma(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot(a, b)`` with fp32 accumulation; ``UPCAST`` computes it in fp32 instead (used only under
    the CPU interpreter, whose ``tl.dot`` multiplies bf16 operands as raw uint16 bit patterns)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


def dot_flags(dtype: torch.dtype) -> dict:
    """Constexpr arguments for :func:`mma`: exact fp32 products for fp32 inputs (no tf32)."""
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "UPCAST": bool(dtype == torch.bfloat16 and _checks.interpreter_enabled()),
    }


@triton.jit
def kv_rows(table_row, offs_n, n0, mask_n, kc_s0, kc_s1, vc_s0, vc_s1,
            BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr,
            SAME_STRIDES: tl.constexpr):
    """Element offsets (int64 ``[BLOCK_N]``) of the K and V rows of tokens ``offs_n`` (a tile starting at
    ``n0``, a multiple of ``BLOCK_N``): the only place where the two layouts differ.

    paged: ``block_tables[pos // BLOCK_SIZE] * stride0 + (pos % BLOCK_SIZE) * stride1``; when a block
    holds the whole tile (``BLOCK_SIZE >= BLOCK_N``) its id is one scalar load.
    contiguous (slot base already applied): ``pos * stride1``.
    """
    if PAGED:
        if BLOCK_SIZE >= BLOCK_N:
            block = tl.load(table_row + n0 // BLOCK_SIZE).to(tl.int64)
        else:
            block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_block = (offs_n % BLOCK_SIZE).to(tl.int64)
        k_rows = block * kc_s0 + in_block * kc_s1
        if SAME_STRIDES:
            v_rows = k_rows
        else:
            v_rows = block * vc_s0 + in_block * vc_s1
    else:
        pos = offs_n.to(tl.int64)
        k_rows = pos * kc_s1
        if SAME_STRIDES:
            v_rows = k_rows
        else:
            v_rows = pos * vc_s1
    return k_rows, v_rows
