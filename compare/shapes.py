"""Named model shapes for GPU-free arithmetic (allocator simulation, workload vocabularies).

The numbers are the public configs of the checkpoints (``config.json`` on the Hugging Face hub):
Llama-3-8B (32 layers, 8 KV heads, head_dim 128, 8192 positions, vocab 128256), Qwen2.5-7B (28 layers,
4 KV heads, head_dim 128, 32768 positions, vocab 152064), SmolLM2-135M (30 layers, 3 KV heads,
head_dim 64, 8192 positions, vocab 49152).  ``tiny`` is a test shape.  The engine builds random-weight
models of the same names through ``vmkv.model.random_model``; when that module is importable its own
table wins for the engine, and this one serves only the byte arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vmkv.kvcache import KVCacheSpec

__all__ = ["ModelShape", "SHAPES", "get_shape", "parse_dtype"]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "half": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"fp16"``/``"fp32"`` (and long names) to a torch dtype.  Raises ValueError."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class ModelShape:
    """The KV-relevant shape of a model.

    Attributes:
        name: short name (``llama3-8b``).
        num_layers, num_kv_heads, head_dim: as in :class:`vmkv.kvcache.KVCacheSpec`.
        max_model_len: context length of the checkpoint (positions).
        vocab_size: vocabulary size.
        dtype: default KV dtype name (``bf16``).
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    vocab_size: int
    dtype: str = "bf16"

    def spec(self, dtype: str | torch.dtype | None = None, device: str = "cpu") -> KVCacheSpec:
        """The :class:`KVCacheSpec` (all byte arithmetic lives there)."""
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_dim,
                           dtype=parse_dtype(dtype or self.dtype), device=device)


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("llama3-8b", 32, 8, 128, 8192, 128256),
        ModelShape("qwen2.5-7b", 28, 4, 128, 32768, 152064),
        ModelShape("smollm2-135m", 30, 3, 64, 8192, 49152),
        ModelShape("tiny", 2, 2, 16, 1024, 512, dtype="fp32"),
    )
}


def get_shape(name: str) -> ModelShape:
    """Look up a named shape.  Raises ValueError listing the names."""
    try:
        return SHAPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; choose one of {sorted(SHAPES)}") from None
