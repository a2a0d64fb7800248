"""The KV-cache interface and its factory."""

from vmkv.kvcache.base import (
    AttentionMetadata,
    CacheUsage,
    DuplicateSequenceError,
    KVCache,
    KVCacheError,
    KVCacheFullError,
    KVCacheSpec,
    StepSeq,
    UnknownSequenceError,
)
from vmkv.kvcache.registry import BACKENDS, create_kv_cache

__all__ = [
    "AttentionMetadata", "CacheUsage", "DuplicateSequenceError", "KVCache", "KVCacheError",
    "KVCacheFullError", "KVCacheSpec", "StepSeq", "UnknownSequenceError", "BACKENDS",
    "create_kv_cache",
]
