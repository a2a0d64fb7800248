"""Dispatch of the cache's per-step operations: Triton kernels on CUDA, torch references elsewhere.

Backends call only these functions; each takes explicit tensors (no engine types).  ``impl`` picks
the implementation:

- ``"auto"`` (default): the Triton kernel when the tensors are on CUDA, Triton imports and the kernel takes
  the inputs (fp16/bf16/fp32, q in the cache dtype, ``stride(-1) == 1``, power-of-two paged block size);
  off CUDA, ``"sdpa"`` for fp16/bf16/fp32 with q in the cache dtype (torch's CPU flash kernel: the CPU
  path of both backends); else the pure-torch reference (:mod:`vmkv.kernels.reference`).
- ``"triton"``: the Triton kernel (on CPU only under ``TRITON_INTERPRET=1``, for tests).
- ``"torch"``: the reference (float32/float64 math; the oracle in tests).
- ``"sdpa"``: ``scaled_dot_product_attention`` (:mod:`vmkv.kernels.sdpa`): unmodified on vmem slot views
  (vAttention's thesis), on each sequence's gathered blocks for the paged layout.

Attention (not ``write_kv``) accepts ``"sdpa"``.
"""

from __future__ import annotations

import torch

from vmkv.kernels import _checks
from vmkv.kernels import reference as ref

_IMPLS = ("auto", "triton", "torch")
#: dtypes ``auto`` sends to SDPA off CUDA (float64 stays on the reference)
SDPA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _kernel_fits(q: torch.Tensor | None, key_cache: torch.Tensor, paged: bool) -> bool:
    """Inputs the Triton kernels take (``auto`` falls back to the reference for anything else)."""
    if key_cache.dtype not in _checks.KERNEL_DTYPES or key_cache.stride(-1) != 1:
        return False
    if q is not None and (q.dtype != key_cache.dtype or q.stride(-1) != 1):
        return False
    block_size = key_cache.shape[1]
    return not paged or (block_size > 0 and block_size & (block_size - 1) == 0)


def _sdpa_fits(q: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Inputs ``auto`` sends to SDPA off CUDA: fp16/bf16/fp32 with q in the cache dtype."""
    return q.dtype in SDPA_DTYPES and key_cache.dtype == q.dtype


def _pick(impl: str, device: torch.device, dtype: torch.dtype, extra: tuple[str, ...] = (),
          fits: bool = True, sdpa_fits: bool = False) -> str:
    """``sdpa_fits``: ``auto`` off CUDA picks ``"sdpa"`` (callers that offer it pass
    :func:`_sdpa_fits`); otherwise the reference."""
    if impl not in _IMPLS + extra:
        raise ValueError(f"impl must be one of {_IMPLS + extra}, got {impl!r}")
    if impl == "auto":
        ok = (device.type == "cuda" and _checks.triton_available() and dtype in _checks.KERNEL_DTYPES
              and fits)
        if ok:
            return "triton"
        return "sdpa" if device.type != "cuda" and sdpa_fits and "sdpa" in extra else "torch"
    if impl == "triton" and not _checks.triton_can_run(device):
        raise ValueError(
            f"impl='triton' cannot run on {device}: Triton needs CUDA tensors (or TRITON_INTERPRET=1 "
            f"on CPU) and an importable triton; use impl='torch'"
        )
    return impl


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, *, impl: str = "auto", key_anchor: torch.Tensor | None = None,
             value_anchor: torch.Tensor | None = None) -> None:
    """Scatter ``k, v: [num_tokens, H, D]`` into ``[dim0, dim1, H, D]`` cache views at
    ``slot_mapping: int64 [num_tokens]`` (flat ``index0 * dim1 + index1``).

    ``key_anchor`` / ``value_anchor``: optional always-backed elements at or below the views that the
    Triton launch receives instead of the views' first elements (:func:`_checks.launch_base`; vmem
    passes its guard pages); the torch reference ignores them.
    See :func:`vmkv.kernels.write_kv.write_kv` (Triton) and
    :func:`vmkv.kernels.reference.write_kv_ref` (torch)."""
    if _pick(impl, key_cache.device, key_cache.dtype, fits=_kernel_fits(None, key_cache, False)) == "triton":
        from vmkv.kernels.write_kv import write_kv as write_kv_triton
        write_kv_triton(key_cache, value_cache, k, v, slot_mapping, key_anchor=key_anchor,
                        value_anchor=value_anchor)
    else:
        ref.write_kv_ref(key_cache, value_cache, k, v, slot_mapping)


def plan_decode(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                dtype: torch.dtype, head_dim: int, block_size: int | None = None) -> int:
    """The decode launch plan of a step, decided once in ``prepare()``: the split-K grid size of
    :func:`vmkv.kernels.decode_attention.decode_attention` when the Triton kernel will run on
    ``device`` (``max_seq_len``: the longest context, or ``max_model_len`` for a CUDA graph that
    must serve any context), else 0 (nothing to plan)."""
    device = torch.device(device)
    if not (device.type == "cuda" and _checks.triton_available() and dtype in _checks.KERNEL_DTYPES):
        return 0
    from vmkv.kernels.decode_attention import default_launch, plan_num_splits
    block_n, _, _, waves = default_launch(head_dim, block_size)
    return plan_num_splits(num_seqs, num_kv_heads, max(1, max_seq_len), device, block_n, waves)


def _triton_attention(q, key_cache, value_cache, query_start_loc, seq_lens, max_query_len,
                      max_seq_len, scale, block_tables=None, slot_indices=None, key_anchor=None,
                      value_anchor=None, num_splits=0, workspace=None, num_decodes=0):
    """Decode kernel for a decode step; for a mixed step, the decode kernel over its leading
    ``num_decodes`` one-token rows and the prefill kernel over the rest, both writing one output."""
    anchors = {"key_anchor": key_anchor, "value_anchor": value_anchor}
    from vmkv.kernels.decode_attention import decode_attention
    if max_query_len == 1 and q.shape[0] == seq_lens.shape[0]:
        return decode_attention(q, key_cache, value_cache, seq_lens, max_seq_len=max_seq_len,
                                scale=scale, block_tables=block_tables, slot_indices=slot_indices,
                                num_splits=num_splits or None, workspace=workspace, **anchors)
    from vmkv.kernels.prefill_attention import prefill_attention
    num_seqs = seq_lens.shape[0]
    nd = int(num_decodes)
    if not 0 < nd < num_seqs:
        return prefill_attention(q, key_cache, value_cache, query_start_loc, seq_lens,
                                 max_query_len=max_query_len, scale=scale, block_tables=block_tables,
                                 slot_indices=slot_indices, **anchors)
    # the first nd sequences own tokens 0 .. nd - 1 (one each); the prefill kernel starts at
    # sequence nd of the same tensors (sliced pointers would change their alignment with nd, and
    # Triton compiles a variant per alignment)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    head = {"block_tables": None if block_tables is None else block_tables[:nd],
            "slot_indices": None if slot_indices is None else slot_indices[:nd]}
    decode_attention(q[:nd], key_cache, value_cache, seq_lens[:nd], max_seq_len=max_seq_len,
                     scale=scale, out=out[:nd], num_splits=num_splits or None, workspace=workspace,
                     **head, **anchors)
    prefill_attention(q, key_cache, value_cache, query_start_loc, seq_lens, max_query_len=max_query_len,
                      scale=scale, out=out, block_tables=block_tables, slot_indices=slot_indices,
                      seq_start=nd, **anchors)
    return out


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, *, seq_lens_host: list[int], query_lens_host: list[int],
                    max_query_len: int, max_seq_len: int, scale: float,
                    impl: str = "auto", num_splits: int = 0,
                    workspace: dict | None = None, num_decodes: int = 0) -> torch.Tensor:
    """Causal attention over a paged cache.

    A decode batch (``max_query_len == 1``) runs the split-K decode kernel, anything else the
    varlen prefill kernel (chunked prefill and mixed batches included).

    Args:
        q: ``[num_tokens, num_heads, D]``.
        key_cache, value_cache: ``[num_blocks, block_size, H, D]``.
        block_tables: ``int32 [num_seqs, max_blocks]``.
        query_start_loc: ``int32 [num_seqs + 1]``; seq_lens: ``int32 [num_seqs]``.
        seq_lens_host, query_lens_host: host copies (used by the reference).
        max_query_len, max_seq_len: host ints; scale: softmax scale.
        impl: ``"auto" | "triton" | "torch" | "sdpa"`` (module docstring).
        num_splits, workspace: the step's decode plan (:func:`plan_decode`; 0: chosen per call) and
            its per-step scratch dict (Triton decode only).
        num_decodes: leading sequences with one new token (``AttentionMetadata.num_decodes``): in a
            mixed step the Triton path runs them through the decode kernel (planned by
            ``num_splits``), the rest through the prefill kernel; 0 runs the whole step through the
            prefill kernel.
    Returns:
        ``[num_tokens, num_heads, D]`` in ``q.dtype``.
    Raises:
        ValueError: bad ``impl`` or inputs the Triton kernels reject (dtype, device, strides, shapes).
    """
    chosen = _pick(impl, q.device, q.dtype, extra=("sdpa",), fits=_kernel_fits(q, key_cache, True),
                   sdpa_fits=_sdpa_fits(q, key_cache))
    if chosen == "triton":
        return _triton_attention(q, key_cache, value_cache, query_start_loc, seq_lens, max_query_len,
                                 max_seq_len, scale, block_tables=block_tables, num_splits=num_splits,
                                 workspace=workspace, num_decodes=num_decodes)
    if chosen == "sdpa":
        from vmkv.kernels.sdpa import sdpa_paged_attention
        return sdpa_paged_attention(q, key_cache, value_cache, block_tables, seq_lens_host,
                                    query_lens_host, scale)
    return ref.paged_attention_ref(q, key_cache, value_cache, block_tables, seq_lens_host,
                                   query_lens_host, scale)


def contiguous_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         slot_indices: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, *, seq_lens_host: list[int],
                         query_lens_host: list[int], max_query_len: int, max_seq_len: int,
                         scale: float, slot_indices_host: list[int] | None = None,
                         impl: str = "auto", key_anchor: torch.Tensor | None = None,
                         value_anchor: torch.Tensor | None = None, num_splits: int = 0,
                         workspace: dict | None = None, num_decodes: int = 0) -> torch.Tensor:
    """Causal attention over virtually contiguous slots.

    Args:
        q: ``[num_tokens, num_heads, D]``.
        key_cache, value_cache: ``[max_num_seqs, max_model_len, H, D]`` strided views (megacache or
            per-layer; ``stride(-1) == 1``, other strides arbitrary).
        slot_indices: ``int32 [num_seqs]``; slot_indices_host: optional host copy (needed by ``"sdpa"``
            without a device sync).
        query_start_loc: ``int32 [num_seqs + 1]``; seq_lens: ``int32 [num_seqs]``.
        impl: ``"auto" | "triton" | "torch" | "sdpa"`` (module docstring).
        key_anchor, value_anchor: optional always-backed elements at or below the views, passed to the
            Triton launches instead of the views' first elements (:func:`_checks.launch_base`); the
            torch and sdpa paths index the views directly (only backed slot rows).
        num_splits, workspace, num_decodes: as :func:`paged_attention`.
    Returns:
        ``[num_tokens, num_heads, D]`` in ``q.dtype``.
    Raises:
        ValueError: bad ``impl`` or inputs the Triton kernels reject.
    """
    chosen = _pick(impl, q.device, q.dtype, extra=("sdpa",), fits=_kernel_fits(q, key_cache, False),
                   sdpa_fits=_sdpa_fits(q, key_cache))
    if chosen == "triton":
        return _triton_attention(q, key_cache, value_cache, query_start_loc, seq_lens, max_query_len,
                                 max_seq_len, scale, slot_indices=slot_indices, key_anchor=key_anchor,
                                 value_anchor=value_anchor, num_splits=num_splits, workspace=workspace,
                                 num_decodes=num_decodes)
    slots = slot_indices_host if slot_indices_host is not None else slot_indices
    if chosen == "sdpa":
        from vmkv.kernels.sdpa import sdpa_slot_attention
        host = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        return sdpa_slot_attention(q, key_cache, value_cache, host, seq_lens_host, query_lens_host, scale)
    return ref.contiguous_attention_ref(q, key_cache, value_cache, slots, seq_lens_host,
                                        query_lens_host, scale)
