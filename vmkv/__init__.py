"""vmkv: a KV-cache manager and serving engine comparing PagedAttention blocks with
virtual-memory (vAttention-style) contiguous slots behind one interface."""

from vmkv.kvcache import (
    AttentionMetadata,
    CacheUsage,
    KVCache,
    KVCacheFullError,
    KVCacheSpec,
    StepSeq,
    create_kv_cache,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionMetadata", "CacheUsage", "KVCache", "KVCacheFullError", "KVCacheSpec", "StepSeq",
    "create_kv_cache", "LLM", "SamplingParams", "__version__",
]


def __getattr__(name: str):
    # the engine pulls in the model stack; import it only when asked for
    if name in ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput"):
        from vmkv.engine import llm as _llm  # noqa: PLC0415

        return getattr(_llm, name)
    raise AttributeError(f"module 'vmkv' has no attribute {name!r}")
