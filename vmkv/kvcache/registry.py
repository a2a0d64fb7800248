"""``create_kv_cache``: the one place that imports a backend (lazily)."""

from __future__ import annotations

import importlib
import inspect

from vmkv.kvcache.base import KVCache, KVCacheSpec

# backend name -> "module:Class"; imported only when asked for
_BACKENDS = {
    "paged": "vmkv.paged.cache:PagedKVCache",
    "vmem": "vmkv.vmem.cache:VMemKVCache",
}

BACKENDS = tuple(_BACKENDS)


def create_kv_cache(backend: str, spec: KVCacheSpec, *, max_num_seqs: int, max_model_len: int,
                    memory_bytes: int, **options) -> KVCache:
    """Build a KV cache.

    Args:
        backend: ``"paged"`` (block pool, block tables) or ``"vmem"`` (virtual reservation per slot).
        spec: model KV shape, dtype and device.
        max_num_seqs: live sequences at most (vmem: number of slots).
        max_model_len: positions per sequence at most.
        memory_bytes: physical KV memory budget in bytes.
        **options: backend options: paged ``block_size=16, enable_prefix_caching=True``;
            vmem ``driver="auto"|"cuda"|"host", layout="megacache"|"per_layer",
            page_size_bytes=None, enable_prefix_caching=True``.
    Raises:
        ValueError: unknown backend or option.
    """
    try:
        target = _BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown KV backend {backend!r}; choose one of {list(_BACKENDS)}") from None
    module_name, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    params = inspect.signature(cls.__init__).parameters
    known = [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY
             and n not in ("max_num_seqs", "max_model_len", "memory_bytes")]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for the {backend!r} KV backend; "
                         f"its options are {known}")
    return cls(spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
               memory_bytes=memory_bytes, **options)
