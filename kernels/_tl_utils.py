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
