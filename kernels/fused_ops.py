"""Fused small ops of a Llama layer: residual add + RMSNorm, RoPE in place, SiLU-and-mul (Triton).

A decoder layer spends many small torch ops outside its matmuls: RMSNorm alone is an upcast, pow, mean,
rsqrt, two muls and a cast, RoPE a cat and four muls and adds per tensor plus per-step cos/sin tensors,
SwiGLU a silu and a mul, each a launch and a trip through memory.  Here each is one kernel (the fusions
of vLLM's ``fused_add_rms_norm``, ``rotary_embedding`` and ``silu_and_mul``):

- :func:`fused_add_rms_norm`: ``residual += x`` (in place, rounded to the model dtype as the eager
  ``x = x + attn_out`` does), then RMSNorm of the new residual; :func:`rms_norm` without the add.
  One program per token row, statistics in float32.
- :func:`rotary_embedding`: rotate-half RoPE of q and k in place, one program per token; cos and sin
  are computed in float32 inside the kernel from ``position * inv_freq`` (no per-step cos/sin tensors).
- :func:`silu_and_mul`: ``silu(gate) * up`` of the fused gate_up projection in float32.

``impl`` picks the implementation (as :mod:`vmkv.kernels.ops`): ``"auto"`` the Triton kernel on CUDA
(fp16/bf16/fp32 inputs the kernel takes), else the torch reference (:mod:`vmkv.kernels.fused_reference`,
the CPU path); ``"triton"`` the kernel (on CPU only under ``TRITON_INTERPRET=1``); ``"torch"`` the
reference.  The kernels are CUDA-graph capturable: the wrappers check shapes, dtypes, devices and
strides on the host, never device values, and never synchronise.
"""

from __future__ import annotations

import torch

from vmkv.kernels import _checks, ops
from vmkv.kernels import fused_reference as ref

__all__ = ["IMPLS", "fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"]

#: values of ``impl``
IMPLS = ("auto", "triton", "torch")
#: widest row tile of the norm kernel; wider rows loop over tiles (two passes over the row)
NORM_MAX_BLOCK = 8192
#: columns of the SiLU-and-mul tile (a row of the intermediate is split over programs)
SILU_BLOCK = 1024

if _checks.triton_available():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    _jit = triton.jit
else:  # pragma: no cover - depends on the installation; the torch references remain
    def _jit(fn):
        return fn


# ------------------------------------------------------------------------------------------ kernels
@_jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    stride_x, stride_r, stride_o, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
):
    # one program per token row.  Without a residual the wrapper passes x as res_ptr, so the second
    # pass always re-reads res_ptr (the new residual, or x itself).
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = res_ptr + row * stride_r
    o_row = out_ptr + row * stride_o
    if SINGLE:
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            # the sum rounded to the model dtype (what the eager add stores), and normalised as such
            v = v + tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
            v = v.to(res_ptr.dtype.element_ty)
            tl.store(r_row + offs, v, mask=mask)
            v = v.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(v * v, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (v * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(o_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        sum_sq = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            mask = offs < n_cols
            v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                v = v + tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
                v = v.to(res_ptr.dtype.element_ty)
                tl.store(r_row + offs, v, mask=mask)
                v = v.to(tl.float32)
            sum_sq += v * v
        inv_rms = tl.rsqrt(tl.sum(sum_sq, axis=0) / n_cols + eps)
        tl.debug_barrier()  # the row's new residual is stored before the second pass reads it
        for c0 in range(0, n_cols, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            mask = offs < n_cols
            v = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y = (v * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32) * w
            tl.store(o_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _rotate_heads(row_ptr, stride_h, cos, sin, offs_d, mask_d,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate one token's ``[NUM_HEADS, 2 * HALF]`` rows at ``row_ptr`` in place (float32 math)."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < NUM_HEADS)[:, None] & mask_d[None, :]
    p1 = row_ptr + offs_h.to(tl.int64)[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(p1, out1.to(row_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, out2.to(row_ptr.dtype.element_ty), mask=mask)


@_jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, inv_freq_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    LIBDEVICE_TRIG: tl.constexpr,
):
    # one program per token: its angles once, then every q head and every k head
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    angle = pos * tl.load(inv_freq_ptr + offs_d, mask=mask_d, other=0.0)
    if LIBDEVICE_TRIG:
        # precise cosf/sinf (full range reduction: angles reach position * 1 rad); tl.cos would
        # lower to the approximate hardware instruction, inaccurate far outside [-pi, pi]
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    else:  # the CPU interpreter (numpy) has no libdevice
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, offs_d, mask_d, NUM_Q_HEADS, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, offs_d, mask_d, NUM_KV_HEADS, HALF, BLOCK_HK)


@_jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, stride_g, stride_o, n_cols, BLOCK: tl.constexpr):
    # program (row, column tile): out[row, c] = silu(gate_up[row, c]) * gate_up[row, n_cols + c]
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g_row = gu_ptr + row * stride_g
    gate = tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(g_row + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------ launches
def _num_warps(num_elements: int) -> int:
    """Warps for a tile of ``num_elements``: about 512 elements per warp, 1 to 8."""
    return min(max(num_elements // 512, 1), 8)


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    _checks.check_float("x", x, 2)
    _checks.check_float("weight", weight, 1)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight has {weight.shape[0]} elements but x rows have {x.shape[1]} "
                         f"(hidden size); pass the norm weight of this hidden size")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight is {weight.dtype} but x is {x.dtype}; cast the weight to the model "
                         f"dtype (or use impl='torch', which promotes)")
    _checks.check_same_device(x.device, weight=weight)


def _launch_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    _check_norm(x, weight)
    if residual is not None:
        _checks.check_float("residual", residual, 2)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual is {tuple(residual.shape)} {residual.dtype} but x is "
                             f"{tuple(x.shape)} {x.dtype}; both are [num_tokens, hidden] in the model dtype")
        _checks.check_same_device(x.device, residual=residual)
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(_checks.next_pow2(hidden), NORM_MAX_BLOCK)
    res = x if residual is None else residual
    _rms_norm_kernel[(num_tokens,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), hidden, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, SINGLE=block >= hidden,
        num_warps=_num_warps(block),
    )
    return out


def _launch_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   inv_freq: torch.Tensor) -> None:
    _checks.check_float("q", q, 3)
    _checks.check_float("k", k, 3)
    num_tokens, num_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or k.dtype != q.dtype:
        raise ValueError(f"k is {tuple(k.shape)} {k.dtype} but q is {tuple(q.shape)} {q.dtype}; k must be "
                         f"[num_tokens, num_kv_heads, head_dim] in q's dtype")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {head_dim}")
    _checks.check_index("positions", positions, (num_tokens,))
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dtype != torch.float32 \
            or tuple(inv_freq.shape) != (head_dim // 2,) or inv_freq.stride(0) != 1:
        got = (f"{tuple(inv_freq.shape)} {inv_freq.dtype} stride {inv_freq.stride()}"
               if isinstance(inv_freq, torch.Tensor) else type(inv_freq).__name__)
        raise ValueError(f"inv_freq must be a contiguous float32 [{head_dim // 2}] (head_dim / 2), got "
                         f"{got}; pass vmkv.model.llama.rope_inv_freq(config)")
    _checks.check_same_device(q.device, k=k, positions=positions, inv_freq=inv_freq)
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_half = _checks.next_pow2(half)
    block_hq, block_hk = _checks.next_pow2(num_heads), _checks.next_pow2(k.shape[1])
    _rotary_kernel[(num_tokens,)](
        positions, q, k, inv_freq, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=k.shape[1], HALF=half,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
        LIBDEVICE_TRIG=not _checks.interpreter_enabled(),
        num_warps=_num_warps(2 * block_hq * block_half),
    )


def _launch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    _checks.check_float("gate_up", gate_up, 2)
    num_tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must be [num_tokens, 2 * intermediate], got an odd width {width}")
    inter = width // 2
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0 or inter == 0:
        return out
    block = min(_checks.next_pow2(inter), SILU_BLOCK)
    _silu_and_mul_kernel[(num_tokens, -(-inter // block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block,
        num_warps=_num_warps(block),
    )
    return out


# ------------------------------------------------------------------------------------------ dispatch
def _triton(impl: str, x: torch.Tensor, fits: bool) -> bool:
    """Does ``impl`` pick the Triton kernel for inputs like ``x``? (Raises on a bad ``impl``.)"""
    return ops._pick(impl, x.device, x.dtype, fits=fits) == "triton"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, impl: str = "auto") -> torch.Tensor:
    """RMSNorm of each token row (Hugging Face Llama's numerics).

    Args:
        x: ``[num_tokens, hidden]``, fp16/bf16/fp32 for the kernel (rows may be strided,
            ``stride(-1) == 1``); the reference takes any float dtype and leading dimensions.
        weight: ``[hidden]`` in ``x.dtype``.
        eps: added to the mean square.
        impl: ``"auto" | "triton" | "torch"`` (module docstring).
    Returns:
        ``[num_tokens, hidden]`` in ``x.dtype``: ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``
        with the statistics in float32.
    Raises:
        ValueError: bad ``impl``, or inputs the kernel rejects (dtype, device, shape, strides).
    """
    fits = x.dim() == 2 and x.stride(-1) == 1 and weight.dtype == x.dtype
    if _triton(impl, x, fits):
        return _launch_norm(x, None, weight, eps)
    return ref.rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       impl: str = "auto") -> torch.Tensor:
    """``residual += x`` in place, then :func:`rms_norm` of the new residual, in one pass.

    The sum is rounded to the model dtype before it is stored and normalised, exactly what the eager
    ``residual = residual + x; rms_norm(residual)`` computes.

    Args:
        x: ``[num_tokens, hidden]``: the sublayer's output (attention or MLP), model dtype.
        residual: ``[num_tokens, hidden]`` in ``x.dtype``: the residual stream, updated in place.
        weight: ``[hidden]`` in ``x.dtype``; eps, impl: as :func:`rms_norm`.
    Returns:
        ``[num_tokens, hidden]`` in ``x.dtype``: the normalised new residual (a new tensor).
    Raises:
        ValueError: bad ``impl``, or inputs the kernel rejects.
    """
    fits = (x.dim() == 2 and x.stride(-1) == 1 and residual.stride(-1) == 1
            and weight.dtype == x.dtype == residual.dtype)
    if _triton(impl, x, fits):
        return _launch_norm(x, residual, weight, eps)
    return ref.fused_add_rms_norm_ref(x, residual, weight, eps)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor,
                     *, impl: str = "auto") -> None:
    """Rotate ``q`` and ``k`` in place by rotate-half RoPE (GPT-NeoX / Hugging Face form).

    Args:
        positions: ``int64`` (or int32) ``[num_tokens]``: each token's position in its sequence.
        q: ``[num_tokens, num_heads, head_dim]``; may be a strided view (a slice of the fused qkv
            projection), ``stride(-1) == 1``; rotated in place.
        k: ``[num_tokens, num_kv_heads, head_dim]`` in ``q.dtype``, likewise.
        inv_freq: ``float32 [head_dim // 2]`` (:func:`vmkv.model.llama.rope_inv_freq`).
        impl: ``"auto" | "triton" | "torch"`` (module docstring).
    The angle is ``float32(position) * inv_freq`` in float32; cos, sin and the rotation run in float32
    inside the kernel (no cos/sin tensors), the result is rounded once to ``q.dtype``.
    Raises:
        ValueError: bad ``impl``, or inputs the kernel rejects (shapes, dtypes, devices, odd head_dim).
    """
    fits = q.stride(-1) == 1 and k.stride(-1) == 1 and k.dtype == q.dtype
    if _triton(impl, q, fits):
        _launch_rotary(positions, q, k, inv_freq)
    else:
        ref.rotary_embedding_ref(positions, q, k, inv_freq)


def silu_and_mul(gate_up: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """SwiGLU's activation: ``silu(gate_up[:, :I]) * gate_up[:, I:]``.

    Args:
        gate_up: ``[num_tokens, 2 * I]``: the fused gate and up projections (gate first), rows may be
            strided, ``stride(-1) == 1``.
        impl: ``"auto" | "triton" | "torch"`` (module docstring).
    Returns:
        ``[num_tokens, I]`` in ``gate_up.dtype``, computed in float32.
    Raises:
        ValueError: bad ``impl``, or inputs the kernel rejects.
    """
    fits = gate_up.dim() == 2 and gate_up.stride(-1) == 1
    if _triton(impl, gate_up, fits):
        return _launch_silu_and_mul(gate_up)
    return ref.silu_and_mul_ref(gate_up)
