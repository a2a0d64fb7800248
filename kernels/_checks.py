"""Input checks shared by the Triton kernel wrappers, and whether Triton can run here.

Every wrapper validates dtypes, devices, ``stride(-1) == 1`` and shapes on the host before launching,
and raises ``ValueError`` naming the argument, the value and the fix (STYLE.md, error messages).
"""

from __future__ import annotations

import functools
import os

import torch

#: element types the kernels accept for queries, K/V and outputs
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: element types accepted for block tables, slot indices, sequence lengths and slot mappings
INDEX_DTYPES = (torch.int32, torch.int64)


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when ``triton`` imports (it is absent on some platforms; the torch references remain)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the installation
        return False
    return True


def interpreter_enabled() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_can_run(device: torch.device) -> bool:
    """Can a Triton kernel run on tensors of ``device``? (CUDA natively, CPU under the interpreter.)"""
    if not triton_available():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreter_enabled()


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 under the CPU interpreter, so split-K is exercised)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def head_block(head_dim: int) -> int:
    """Power-of-two tile width covering ``head_dim`` (at least 16, the smallest ``tl.dot`` K)."""
    return max(16, next_pow2(head_dim))


def check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"{name} has dtype {t.dtype}; the Triton kernels take one of {KERNEL_DTYPES} "
            f"(use the torch reference in vmkv.kernels.reference for others)"
        )
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last (head_dim) dimension: stride(-1) is "
            f"{t.stride(-1)}, expected 1 (call .contiguous() or pass a view of a contiguous tensor)"
        )


def check_index(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dim() >= 1 and t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, stride(-1) is {t.stride(-1)}")


def check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the query/cache are on {device}; move it there")


def check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """K/V cache views ``[dim0, dim1, H, D]``, same shape and dtype, any strides with stride(-1) == 1."""
    check_float("key_cache", key_cache, 4)
    check_float("value_cache", value_cache, 4)
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must have the "
            f"same shape [dim0, dim1, num_kv_heads, head_dim]"
        )
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache is {key_cache.dtype} but value_cache is {value_cache.dtype}")
    if key_cache.device != value_cache.device:
        raise ValueError(f"key_cache is on {key_cache.device} but value_cache on {value_cache.device}")


def check_attention_inputs(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    """Check ``q: [num_tokens, num_heads, D]`` against the caches; returns the GQA group size."""
    check_float("q", q, 3)
    check_caches(key_cache, value_cache)
    if q.dtype != key_cache.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {key_cache.dtype}; cast q to the cache dtype")
    check_same_device(q.device, key_cache=key_cache, value_cache=value_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[2]
    if head_dim != key_cache.shape[3]:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {key_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads} (GQA)"
        )
    return num_heads // num_kv_heads


def launch_base(name: str, cache: torch.Tensor, anchor: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The pointer argument a launch passes for the cache view ``cache``, and the element offset the
    kernel adds to it to reach ``cache``'s first element.

    Triton's launcher asks the driver about every pointer argument and rejects an address inside a
    reserved but unmapped virtual range ("Pointer argument ... cannot be accessed from Triton").  A
    vmem view's first element (slot 0, position 0) is such an address whenever slot 0 holds no page,
    so the vmem cache passes an ``anchor``: an element of a page that stays mapped (the guard page at
    the start of the view's reservation).  Without an anchor this is ``(cache, 0)``.

    Args:
        name: ``"key_cache"`` or ``"value_cache"`` (error messages).
        cache: the ``[dim0, dim1, H, D]`` view.
        anchor: ``None`` or a tensor of ``cache.dtype`` on its device whose ``data_ptr`` is at or below
            ``cache.data_ptr()`` in the same virtual range, a whole number of elements away.
    Raises:
        ValueError: an anchor of another dtype/device, above the view or misaligned with it.
    """
    if anchor is None:
        return cache, 0
    if not isinstance(anchor, torch.Tensor):
        raise ValueError(f"{name} anchor must be a torch.Tensor or None, got {type(anchor).__name__}")
    if anchor.dtype != cache.dtype or anchor.device != cache.device:
        raise ValueError(f"{name} anchor is {anchor.dtype} on {anchor.device}; it must match the cache "
                         f"({cache.dtype} on {cache.device})")
    delta = cache.data_ptr() - anchor.data_ptr()
    if delta < 0 or delta % cache.element_size():
        raise ValueError(f"{name} starts {delta} bytes from its anchor; the anchor must lie at or below "
                         f"the view, a multiple of {cache.element_size()} bytes away")
    return anchor, delta // cache.element_size()
