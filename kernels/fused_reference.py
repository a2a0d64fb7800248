"""Pure-torch references of the fused small ops of a Llama layer (:mod:`vmkv.kernels.fused_ops`).

Semantics are Hugging Face Llama's: RMSNorm statistics in float32, the normalised value cast back to the
input dtype, then multiplied by the weight; the residual add in the model dtype; rotate-half RoPE whose
angle is ``float32(position) * inv_freq`` in float32; SwiGLU's ``silu(gate) * up``.  Math runs in float32
(float64 when given float64, which makes these the oracle in tests).  They are the CPU path of the model
(``impl="auto"`` off CUDA) and give the same numbers as the eager code they replaced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) as Hugging Face Llama computes it.

    Args:
        x: ``[num_tokens, hidden]`` (any leading dimensions) in the model dtype.
        weight: ``[hidden]``.
        eps: added to the mean square.
    Returns:
        ``weight * (x / rms(x)).to(x.dtype)``, statistics in float32 (float64 for float64 ``x``).
    """
    xf = x.to(_acc(x.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> torch.Tensor:
    """``residual += x`` in place (in the model dtype), then :func:`rms_norm_ref` of ``residual``.

    Args:
        x: ``[num_tokens, hidden]``: the sublayer's output.
        residual: ``[num_tokens, hidden]``, the residual stream; updated in place.
        weight: ``[hidden]``; eps: as :func:`rms_norm_ref`.
    Returns:
        ``[num_tokens, hidden]``: the normalised new residual.
    """
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``float32 [num_tokens, head_dim // 2]``: ``float32(position) * inv_freq``, the RoPE angle as the
    model (and Hugging Face) defines it, rounded to float32 whatever dtype the rotation runs in."""
    return positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         inv_freq: torch.Tensor) -> None:
    """Rotate ``q`` and ``k`` in place by rotate-half RoPE (GPT-NeoX / Hugging Face form: dims ``i``
    and ``i + head_dim / 2`` form a pair).

    Args:
        positions: ``int64`` (or int32) ``[num_tokens]``: each token's position in its sequence.
        q: ``[num_tokens, num_heads, head_dim]``, any strides; rotated in place.
        k: ``[num_tokens, num_kv_heads, head_dim]``, any strides; rotated in place.
        inv_freq: ``float32 [head_dim // 2]``: RoPE inverse frequencies.
    The angle is :func:`rope_angles`; cos, sin and the rotation run in float32 (float64 for float64
    ``q``), the result is cast back to each tensor's dtype.
    """
    acc = _acc(q.dtype)
    angles = rope_angles(positions, inv_freq).to(acc)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    for x in (q, k):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].to(acc), x[..., half:].to(acc)
        out1, out2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin  # both before either is written
        x[..., :half] = out1
        x[..., half:] = out2


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation (Shazeer 2020): ``silu(gate) * up``.

    Args:
        gate_up: ``[num_tokens, 2 * intermediate]``: the fused gate and up projections, gate first.
    Returns:
        ``[num_tokens, intermediate]`` in ``gate_up.dtype``, computed in float32 (float64 for float64).
    """
    acc = _acc(gate_up.dtype)
    i = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :i].to(acc), gate_up[..., i:].to(acc)
    return (F.silu(gate) * up).to(gate_up.dtype)
