"""The KV backends by name: the one place that names a backend, imported lazily.

    create_kv_cache("vmem", spec, max_num_seqs=8, max_model_len=4096, memory_bytes=1 << 30,
                    options=VMemOptions(layout="per_layer", attention_impl="sdpa"))
    create_kv_cache("vmem", spec, ..., layout="per_layer")          # the same, as keywords

Each backend registers two strings: its cache class and its options class (a
:class:`~vmkv.kvcache.options.BackendOptions`, torch-free, beside the implementation).  The engine
config and the CLIs get the options classes from here (:func:`backend_options_class`,
:func:`option_backends`), so the backends' defaults and name lists are read, never copied.  Importing
this module imports neither torch nor a backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from vmkv.kvcache.base import KVCache, KVCacheSpec
    from vmkv.kvcache.options import BackendOptions

__all__ = ["BACKENDS", "backend_choices", "backend_class", "backend_options_class", "option_backends",
           "option_names", "option_owner", "create_kv_cache", "vmm_driver"]

# backend name -> ("module:CacheClass", "module:OptionsClass"); imported only when asked for
_BACKENDS = {
    "paged": ("vmkv.paged.cache:PagedKVCache", "vmkv.paged.options:PagedOptions"),
    "vmem": ("vmkv.vmem.cache:VMemKVCache", "vmkv.vmem.options:VMemOptions"),
}

#: the backend names, in registration order
BACKENDS = tuple(_BACKENDS)


def backend_choices() -> tuple[str, ...]:
    """The registered backend names (``--backend`` choices)."""
    return BACKENDS


def _entry(backend: str) -> tuple[str, str]:
    try:
        return _BACKENDS[backend]
    except (KeyError, TypeError):
        raise ValueError(f"unknown KV backend {backend!r}; choose one of {list(_BACKENDS)}") from None


def _load(target: str):
    module_name, name = target.split(":")
    return getattr(importlib.import_module(module_name), name)


def backend_class(backend: str) -> type[KVCache]:
    """The cache class of ``backend`` (imports the backend, and with it torch).  ValueError if unknown."""
    return _load(_entry(backend)[0])


def backend_options_class(backend: str) -> type[BackendOptions]:
    """The options dataclass of ``backend`` (torch-free).  ValueError if unknown."""
    return _load(_entry(backend)[1])


def vmm_driver(kind: str, device, page_size_bytes: int | None = None):
    """A virtual-memory page driver of the vmem backend (``"cuda"``, ``"host"`` or ``"auto"``; its
    ``get_driver``), for benchmarks of the driver calls themselves (``vmkv.compare.driver_bench``).
    Raises ValueError: an unknown kind."""
    return _load("vmkv.vmem.backing:get_driver")(kind, device, page_size_bytes)


def option_backends(name: str) -> tuple[str, ...]:
    """The backends whose options have a field ``name``, in registration order (``()`` if none)."""
    return tuple(b for b in BACKENDS if name in backend_options_class(b).field_names())


def option_names() -> tuple[str, ...]:
    """Every backend option once: the union of the options classes' fields, in registration order
    (the engine config's backend fields and the CLI flags are derived from these)."""
    seen: dict[str, None] = {}
    for b in BACKENDS:
        seen.update(dict.fromkeys(backend_options_class(b).field_names()))
    return tuple(seen)


def option_owner(name: str) -> type[BackendOptions]:
    """The options class that declares option ``name`` for the CLI and the engine config (the first
    backend's that has it; its default, help and flag).  ValueError if no backend has it."""
    owners = option_backends(name)
    if not owners:
        raise ValueError(f"no KV backend has an option {name!r}; the options are {list(option_names())}")
    return backend_options_class(owners[0])


def create_kv_cache(backend: str, spec: KVCacheSpec, *, max_num_seqs: int, max_model_len: int,
                    memory_bytes: int, options: BackendOptions | None = None, **kwargs: Any) -> KVCache:
    """Build a KV cache.

    Args:
        backend: ``"paged"`` (block pool, block tables) or ``"vmem"`` (virtual reservation per slot).
        spec: model KV shape, dtype and device.
        max_num_seqs: live sequences at most (vmem: number of slots).
        max_model_len: positions per sequence at most.
        memory_bytes: physical KV memory budget in bytes.
        options: the backend's options object (:func:`backend_options_class`: ``PagedOptions``,
            ``VMemOptions``); ``None``: built from ``kwargs``.
        **kwargs: the same options as keywords (the options class's fields), when ``options`` is
            ``None``; omitted ones take the class's defaults.
    Raises:
        ValueError: unknown backend or option, an option out of range, options of another backend,
            or both ``options`` and keywords.
    """
    cls_options = backend_options_class(backend)
    if options is None:
        known = cls_options.field_names()
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for the {backend!r} KV backend; "
                             f"its options are {list(known)}")
        options = cls_options(**kwargs)
    elif kwargs:
        raise ValueError(f"give the {backend!r} backend's options either as options= or as keywords, not both "
                         f"(got options= and {sorted(kwargs)})")
    elif not isinstance(options, cls_options):
        raise ValueError(f"the {backend!r} KV backend takes {cls_options.__name__}, "
                         f"got {type(options).__name__}")
    return backend_class(backend)(spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                  memory_bytes=memory_bytes, **options.as_kwargs())
