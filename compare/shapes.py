"""Named model shapes for GPU-free arithmetic (allocator simulation, workload vocabularies).

The single source of the shapes is ``vmkv.model.config.SHAPES`` (the public configs of Llama-3-8B,
Qwen2.5-7B, SmolLM2-135M, and a ``tiny`` test shape), the same table the engine's random-weight models
use; this module only exposes the KV-relevant fields and a default KV dtype (bf16, fp32 for ``tiny``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vmkv.kvcache import KVCacheSpec
from vmkv.kvcache.dtypes import MODEL_DTYPES
from vmkv.kvcache.spec import torch_dtype
from vmkv.model.config import SHAPES as _MODEL_SHAPES

__all__ = ["ModelShape", "SHAPES", "get_shape", "parse_dtype"]


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"fp16"``/``"fp32"`` (and long names) to a torch dtype: a name of the dtypes a model
    runs in (:data:`vmkv.kvcache.dtypes.MODEL_DTYPES`).  Raises ValueError."""
    if isinstance(name, torch.dtype):
        return name
    return torch_dtype(name, MODEL_DTYPES)


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


def _from_model_config(name: str, cfg) -> ModelShape:
    return ModelShape(name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings,
                      cfg.vocab_size, dtype="fp32" if name == "tiny" else "bf16")


SHAPES: dict[str, ModelShape] = {name: _from_model_config(name, cfg) for name, cfg in _MODEL_SHAPES.items()}


def get_shape(name: str) -> ModelShape:
    """Look up a named shape.  Raises ValueError listing the names."""
    try:
        return SHAPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; choose one of {sorted(SHAPES)}") from None
