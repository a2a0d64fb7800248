"""``PagedOptions``: the paged backend's options (torch-free; the registry maps ``"paged"`` here).

The keywords are :class:`vmkv.paged.cache.PagedKVCache`'s; defaults and ranges live here once (the
engine config and the CLIs read them from this class through the registry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vmkv.kvcache.options import BackendOptions, boolean, option, power_of_two

__all__ = ["PagedOptions", "MAX_BLOCK_SIZE"]

#: largest ``block_size`` (tokens per block)
MAX_BLOCK_SIZE = 1024


@dataclass(frozen=True)
class PagedOptions(BackendOptions):
    """Options of the paged KV backend.

    Args:
        block_size: tokens per block, a power of two in ``[1, MAX_BLOCK_SIZE]``.
        enable_prefix_caching: share full blocks of identical prompt prefixes.
    Raises:
        ValueError: a field is out of range (the message names field, value and range).
    """

    backend: ClassVar[str] = "paged"

    block_size: int = option(16, power_of_two(1, MAX_BLOCK_SIZE), "paged: tokens per block")
    enable_prefix_caching: bool = option(True, boolean(), "share KV of identical prompt prefixes")
