"""Paged KV-cache backend (PagedAttention blocks, block tables, copy-on-write, prefix caching)."""

from vmkv.paged.block_pool import (
    BlockPool,
    BlockPoolError,
    BlockRefCountError,
    InvalidBlockError,
    NoFreeBlocksError,
)
from vmkv.paged.cache import PagedKVCache, TooManySequencesError

__all__ = ["BlockPool", "BlockPoolError", "BlockRefCountError", "InvalidBlockError",
           "NoFreeBlocksError", "PagedKVCache", "TooManySequencesError"]
