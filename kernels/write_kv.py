"""KV write: scatter the step's new K/V into either cache layout with one Triton kernel.

Both layouts are a 4-D view ``[dim0, dim1, H, D]`` with explicit strides (DESIGN.md, "Kernels"):
paged ``[num_blocks, block_size, H, D]`` (index0 = block id, index1 = offset in the block) and vmem
``[max_num_seqs, max_model_len, H, D]`` (index0 = slot, index1 = position; megacache views have large
token strides, per-layer views are contiguous).  ``slot_mapping`` holds the flat index
``index0 * dim1 + index1`` of every new token, as in vLLM's ``reshape_and_cache``.
Reference: :func:`vmkv.kernels.reference.write_kv_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vmkv.kernels import _checks


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    kc_s0, kc_s1, kc_sh, vc_s0, vc_s1, vc_sh,
    kc_off, vc_off, dim1,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per new token: copy its [H, D] K and V rows
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # negative entries are padding tokens: nothing is written
        i0 = slot // dim1
        i1 = slot - i0 * dim1
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        h64 = offs_h.to(tl.int64)
        k = tl.load(k_ptr + t * stride_kt + h64[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h64[:, None] * stride_vh + offs_d[None, :], mask=mask)
        kdst = kc_ptr + kc_off + i0 * kc_s0 + i1 * kc_s1 + h64[:, None] * kc_sh + offs_d[None, :]
        vdst = vc_ptr + vc_off + i0 * vc_s0 + i1 * vc_s1 + h64[:, None] * vc_sh + offs_d[None, :]
        tl.store(kdst, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vdst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, *, key_anchor: torch.Tensor | None = None,
             value_anchor: torch.Tensor | None = None) -> None:
    """Scatter new K/V into a ``[dim0, dim1, H, D]`` cache view (paged or vmem) in one launch.

    Args:
        key_cache, value_cache: ``[dim0, dim1, num_kv_heads, head_dim]`` views, fp16/bf16/fp32, any
            strides with ``stride(-1) == 1`` (megacache, per-layer and paged views alike).
        k, v: ``[num_tokens, num_kv_heads, head_dim]``, fp16/bf16/fp32 (cast to the cache dtype),
            ``stride(-1) == 1``.
        slot_mapping: ``int64`` (or ``int32``) ``[num_tokens]``: flat index ``index0 * dim1 + index1``
            of each token; negative entries are skipped (padding).  Not range-checked on the host
            (that would need a device sync): indices must be ``< dim0 * dim1``.
        key_anchor, value_anchor: optional always-backed elements at or below the cache views, passed
            as the launch's pointers instead of the views' first elements
            (:func:`vmkv.kernels._checks.launch_base`; the vmem cache's guard pages).
    Raises:
        ValueError: wrong dtype, device, shape or a head_dim that is not contiguous.
    """
    _checks.check_caches(key_cache, value_cache)
    _checks.check_float("k", k, 3)
    _checks.check_float("v", v, 3)
    num_tokens, num_heads, head_dim = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if (num_heads, head_dim) != tuple(key_cache.shape[2:]):
        raise ValueError(
            f"k is [num_tokens, {num_heads}, {head_dim}] but the cache holds "
            f"[.., {key_cache.shape[2]}, {key_cache.shape[3]}] (num_kv_heads, head_dim)"
        )
    _checks.check_index("slot_mapping", slot_mapping, (num_tokens,))
    _checks.check_same_device(key_cache.device, k=k, v=v, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    kc_ptr, kc_off = _checks.launch_base("key_cache", key_cache, key_anchor)
    vc_ptr, vc_off = _checks.launch_base("value_cache", value_cache, value_anchor)
    _write_kv_kernel[(num_tokens,)](
        k, v, kc_ptr, vc_ptr, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        kc_off, vc_off, key_cache.shape[1],
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=_checks.next_pow2(num_heads), BLOCK_D=_checks.next_pow2(head_dim),
        num_warps=4 if num_heads * head_dim >= 1024 else 1,
    )
