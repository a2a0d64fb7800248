"""The dtype names every part of vmkv accepts, once (torch-free).

``DTYPE_NAMES`` maps each accepted name (``"bf16"``, ``"half"``, ...) to its canonical name, which is
the attribute name in torch (``"bfloat16"`` -> ``torch.bfloat16``; the torch-side mapping is
:data:`vmkv.kvcache.spec.TORCH_DTYPES`, built from this table).  The engine, the model loader, the
CLIs and the benchmarks read their name lists from here (subsets through :func:`dtype_names`).
"""

from __future__ import annotations

__all__ = ["DTYPE_NAMES", "MODEL_DTYPES", "AUTO_DTYPE", "canonical_dtype", "dtype_names"]

#: accepted name -> canonical name (a torch dtype attribute)
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64",
}
#: canonical dtypes a model (weights and KV) runs in; ``float64`` is for KV-cache tests only
MODEL_DTYPES = ("float32", "float16", "bfloat16")
#: the engine's "pick for the device" value (bf16 on CUDA, fp32 on CPU)
AUTO_DTYPE = "auto"


def dtype_names(canonical: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The accepted names (in table order) whose canonical name is in ``canonical`` (all when
    ``None``), e.g. ``dtype_names(MODEL_DTYPES)`` for the engine's ``--dtype`` choices."""
    return tuple(n for n, c in DTYPE_NAMES.items() if canonical is None or c in canonical)


def canonical_dtype(name: str, allowed: tuple[str, ...] | None = None) -> str:
    """The canonical name of dtype ``name`` (case-insensitive, a ``torch.`` prefix ignored).

    Args:
        allowed: canonical names accepted (all when ``None``).
    Raises:
        ValueError: an unknown name or one outside ``allowed``; the message lists the valid names.
    """
    key = str(name).lower().removeprefix("torch.")
    canon = DTYPE_NAMES.get(key)
    if canon is None or (allowed is not None and canon not in allowed):
        raise ValueError(f"unknown dtype {name!r}; use one of {list(dtype_names(allowed))}")
    return canon
