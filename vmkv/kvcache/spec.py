"""``KVCacheSpec``: the shape of one model's KV cache; owns all byte arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vmkv.kvcache.dtypes import DTYPE_NAMES, canonical_dtype

__all__ = ["KVCacheSpec", "TORCH_DTYPES", "torch_dtype"]

#: every accepted dtype name (:data:`vmkv.kvcache.dtypes.DTYPE_NAMES`) -> its torch dtype
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, canon) for name, canon in DTYPE_NAMES.items()}
_SUPPORTED_DTYPES = tuple(dict.fromkeys(TORCH_DTYPES.values()))


def torch_dtype(name: str, allowed: tuple[str, ...] | None = None) -> torch.dtype:
    """The torch dtype of the name ``name`` (``"bf16"`` -> ``torch.bfloat16``; case-insensitive).

    Args:
        allowed: canonical names accepted (e.g. :data:`vmkv.kvcache.dtypes.MODEL_DTYPES`); all when ``None``.
    Raises:
        ValueError: an unknown name or one outside ``allowed`` (the message lists the valid names).
    """
    return getattr(torch, canonical_dtype(name, allowed))


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the KV cache of one model; owns all byte arithmetic.

    Args:
        num_layers: decoder layers holding a KV cache (> 0).
        num_kv_heads: KV heads per layer (> 0; query heads are a multiple of it, GQA).
        head_dim: elements per head (> 0).
        dtype: element type of K and V (float32, float16, bfloat16; float64 for tests), a torch dtype
            or a name such as ``"bf16"``.
        device: torch device the KV lives on (``"cpu"`` or ``"cuda"``/``"cuda:N"``).

    Raises:
        ValueError: a field is out of range.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype | str = torch.float32
    device: str = "cpu"

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPE_NAMES:
                raise ValueError(f"KVCacheSpec.dtype must be one of {list(DTYPE_NAMES)} or a torch "
                                 f"dtype, got {self.dtype!r}")
            object.__setattr__(self, "dtype", TORCH_DTYPES[self.dtype])
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be a positive int, got {value!r}")
        if self.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(
                f"KVCacheSpec.dtype must be one of {_SUPPORTED_DTYPES}, got {self.dtype!r}"
            )
        # normalise the device to a string so the spec stays hashable and comparable
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"KVCacheSpec.device must be a torch device such as 'cpu' or 'cuda:0', "
                             f"got {self.device!r}") from e
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"KVCacheSpec.device must be a cpu or cuda device, got {self.device!r}")
        object.__setattr__(self, "device", str(device))

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of K or V."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def head_bytes(self) -> int:
        """Bytes of one token's K (or V) for one head: ``head_dim * dtype_bytes``."""
        return self.head_dim * self.dtype_bytes

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K + V bytes of one token in one layer: ``2 * num_kv_heads * head_dim * dtype_bytes``."""
        return 2 * self.num_kv_heads * self.head_bytes

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes of one token over all layers (BENCHMARKS.md: 128 KiB for Llama-3-8B bf16)."""
        return self.num_layers * self.bytes_per_token_per_layer

    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes of K + V for ``num_tokens`` tokens over all layers."""
        return int(num_tokens) * self.bytes_per_token

    def max_tokens_for_bytes(self, memory_bytes: int) -> int:
        """How many whole tokens of KV fit in ``memory_bytes``."""
        return int(memory_bytes) // self.bytes_per_token
