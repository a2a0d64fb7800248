"""vmkv: a KV-cache manager and serving engine comparing PagedAttention blocks with
virtual-memory (vAttention-style) contiguous slots behind one interface."""

__version__ = "0.1.0"

__all__ = [
    "AttentionMetadata", "CacheUsage", "KVCache", "KVCacheFullError", "KVCacheSpec", "StepSeq",
    "create_kv_cache", "LLM", "SamplingParams", "__version__",
]


_KVCACHE_NAMES = ("AttentionMetadata", "CacheUsage", "KVCache", "KVCacheFullError", "KVCacheSpec", "StepSeq",
                  "create_kv_cache")


def __getattr__(name: str):
    # torch and the engine load on first use, so `import vmkv.cli` (and `vmkv --help`) stays instant
    if name in _KVCACHE_NAMES:
        import vmkv.kvcache as _kvcache  # noqa: PLC0415

        return getattr(_kvcache, name)
    if name in ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput"):
        from vmkv.engine import llm as _llm  # noqa: PLC0415

        return getattr(_llm, name)
    raise AttributeError(f"module 'vmkv' has no attribute {name!r}")
