"""Paged KV-cache backend (PagedAttention blocks, block tables, copy-on-write, prefix caching).

Names load lazily, so the torch-free bookkeeping (:mod:`vmkv.paged.block_manager`,
:mod:`vmkv.paged.block_pool`) and the options (:mod:`vmkv.paged.options`) import without torch.
"""

import importlib

_NAMES = {
    "BlockPool": "vmkv.paged.block_pool", "BlockPoolError": "vmkv.paged.block_pool",
    "BlockRefCountError": "vmkv.paged.block_pool", "InvalidBlockError": "vmkv.paged.block_pool",
    "NoFreeBlocksError": "vmkv.paged.block_pool", "BlockManager": "vmkv.paged.block_manager",
    "PagedKVCache": "vmkv.paged.cache", "TooManySequencesError": "vmkv.kvcache.errors",
    "PagedOptions": "vmkv.paged.options",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
