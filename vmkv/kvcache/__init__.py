"""The KV-cache interface and its factory.

The names load lazily (a module ``__getattr__``), so the torch-free parts of the core
(:mod:`vmkv.kvcache.seqtable`, :mod:`vmkv.kvcache.prefix`, :mod:`vmkv.kvcache.errors`) import
without torch.
"""

import importlib

_NAMES = {
    "AttentionMetadata": "vmkv.kvcache.records", "CacheUsage": "vmkv.kvcache.records",
    "StepSeq": "vmkv.kvcache.records", "KVCacheSpec": "vmkv.kvcache.spec",
    "KVCache": "vmkv.kvcache.base", "DuplicateSequenceError": "vmkv.kvcache.errors",
    "KVCacheError": "vmkv.kvcache.errors", "KVCacheFullError": "vmkv.kvcache.errors",
    "UnknownSequenceError": "vmkv.kvcache.errors", "TooManySequencesError": "vmkv.kvcache.errors",
    "BACKENDS": "vmkv.kvcache.registry", "create_kv_cache": "vmkv.kvcache.registry",
    "backend_choices": "vmkv.kvcache.registry", "backend_options_class": "vmkv.kvcache.registry",
    "BackendOptions": "vmkv.kvcache.options",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
