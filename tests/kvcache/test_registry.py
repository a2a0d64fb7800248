"""The backend registry and the typed backend options (vmkv/kvcache/registry.py, paged/options.py,
vmkv/vmem/options.py): validation, the options/keyword round trip, and the name lists' one home."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest
import torch

from vmkv.engine.config import CacheConfig
from vmkv.kvcache import KVCacheSpec
from vmkv.kvcache.registry import (BACKENDS, backend_choices, backend_class, backend_options_class,
                                   create_kv_cache, option_backends)
from vmkv.paged.options import PagedOptions
from vmkv.vmem import options as vmem_options
from vmkv.vmem.options import VMemOptions

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
LIMITS = dict(max_num_seqs=3, max_model_len=64, memory_bytes=1 << 20)


# ------------------------------------------------------------------ options validation
@pytest.mark.parametrize("cls, field, bad, allowed", [
    (PagedOptions, "block_size", 0, "a power of two in [1, 1024]"),
    (PagedOptions, "block_size", 24, "a power of two in [1, 1024]"),
    (PagedOptions, "block_size", 2048, "a power of two in [1, 1024]"),
    (PagedOptions, "block_size", True, "a power of two in [1, 1024]"),
    (PagedOptions, "enable_prefix_caching", 1, "a bool"),
    (VMemOptions, "driver", "rocm", "one of ['auto', 'cuda', 'host'] or a VMMDriver"),
    (VMemOptions, "driver", None, "one of ['auto', 'cuda', 'host'] or a VMMDriver"),
    (VMemOptions, "layout", "flat", "one of ['megacache', 'per_layer']"),
    (VMemOptions, "page_size_bytes", 0, "a positive int or None"),
    (VMemOptions, "page_size_bytes", 4096.0, "a positive int or None"),
    (VMemOptions, "enable_prefix_caching", "yes", "a bool"),
    (VMemOptions, "lookahead_tokens", -1, "an int >= 0"),
    (VMemOptions, "lookahead_tokens", 1.5, "an int >= 0"),
    (VMemOptions, "preallocate", 0, "a bool"),
    (VMemOptions, "attention_impl", "flash", "one of ['auto', 'triton', 'torch', 'sdpa']"),
    (VMemOptions, "kv_reserve_bytes", -1, "an int >= 0"),
    (VMemOptions, "kv_shrink_grace_s", "5", "a number of seconds (0: at once; negative or inf: never)"),
    (VMemOptions, "kv_shrink_grace_s", float("nan"), "a number of seconds (0: at once; negative or inf: never)"),
])
def test_options_reject_a_bad_value_naming_field_value_and_range(cls, field, bad, allowed):
    with pytest.raises(ValueError) as e:
        cls(**{field: bad})
    assert str(e.value) == f"{cls.__name__}.{field} must be {allowed}, got {bad!r}"


def test_every_option_field_has_a_rejection_case():
    tested = {("PagedOptions", "block_size"), ("PagedOptions", "enable_prefix_caching")} | {
        ("VMemOptions", f) for f in ("driver", "layout", "page_size_bytes", "enable_prefix_caching",
                                     "lookahead_tokens", "preallocate", "attention_impl", "kv_reserve_bytes",
                                     "kv_shrink_grace_s")}
    assert tested == {(c.__name__, f) for c in (PagedOptions, VMemOptions) for f in c.field_names()}


def test_options_are_frozen_and_default_to_the_documented_values():
    assert PagedOptions() == PagedOptions(block_size=16, enable_prefix_caching=True)
    assert VMemOptions() == VMemOptions(driver="auto", layout="megacache", page_size_bytes=None,
                                        enable_prefix_caching=True, lookahead_tokens=0, preallocate=False,
                                        attention_impl="auto", kv_reserve_bytes=64 << 20,
                                        kv_shrink_grace_s=10.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        VMemOptions().layout = "per_layer"  # type: ignore[misc]
    # every value of a name list is accepted
    for impl in vmem_options.ATTENTION_IMPLS:
        assert VMemOptions(attention_impl=impl).attention_impl == impl
    for layout in vmem_options.LAYOUTS:
        assert VMemOptions(layout=layout).layout == layout


@pytest.mark.parametrize("backend", BACKENDS)
def test_options_fields_are_the_constructor_keywords_with_the_same_defaults(backend):
    """The options class and the backend's constructor cannot drift apart."""
    params = inspect.signature(backend_class(backend).__init__).parameters
    keywords = {n: p.default for n, p in params.items() if p.kind == p.KEYWORD_ONLY
                and n not in ("max_num_seqs", "max_model_len", "memory_bytes")}
    cls = backend_options_class(backend)
    assert {n: cls.field_default(n) for n in cls.field_names()} == keywords
    assert cls.backend == backend


def test_options_modules_import_without_torch():
    code = ("import sys; import vmkv.paged.options, vmkv.vmem.options, vmkv.kvcache.registry as r; "
            "[r.backend_options_class(b) for b in r.BACKENDS]; import vmkv.engine.config; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ------------------------------------------------------------------ registry
def test_registry_lookups():
    assert backend_choices() == BACKENDS == ("paged", "vmem")
    assert backend_options_class("paged") is PagedOptions and backend_options_class("vmem") is VMemOptions
    assert option_backends("attention_impl") == ("vmem",)
    assert option_backends("enable_prefix_caching") == ("paged", "vmem")
    assert option_backends("no_such_option") == ()
    for bad in ("blocks", None):
        with pytest.raises(ValueError, match="unknown KV backend"):
            backend_options_class(bad)


def _state(cache) -> tuple:
    """What a cache was built with, as far as the interface and its options show."""
    u = cache.usage()
    stats = cache.backend_stats()
    return type(cache).__name__, u.capacity_bytes, u.unit_tokens, u.free_tokens, sorted(stats.items())


@pytest.mark.parametrize("backend, kwargs", [
    ("paged", {}),
    ("paged", {"block_size": 8, "enable_prefix_caching": False}),
    ("vmem", {"driver": "host", "page_size_bytes": 4096}),
    ("vmem", {"driver": "host", "layout": "per_layer", "page_size_bytes": 4096, "lookahead_tokens": 4,
              "attention_impl": "sdpa", "enable_prefix_caching": False}),
])
def test_create_with_an_options_object_equals_the_keyword_form(backend, kwargs):
    options = backend_options_class(backend)(**kwargs)
    with create_kv_cache(backend, SPEC, **LIMITS, options=options) as a, \
            create_kv_cache(backend, SPEC, **LIMITS, **kwargs) as b:
        assert _state(a) == _state(b)
        # the options reached the cache
        if backend == "paged":
            assert a.block_size == options.block_size
        else:
            stats = a.backend_stats()
            assert (stats["layout"], stats["driver"], stats["page_size_bytes"]) == \
                (options.layout, options.driver, options.page_size_bytes)
            assert (a.attention_impl, a.lookahead_tokens) == (options.attention_impl, options.lookahead_tokens)


def test_create_rejects_mixed_foreign_and_unknown_options():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['layout'\] for the 'paged' KV backend"):
        create_kv_cache("paged", SPEC, **LIMITS, layout="per_layer")
    with pytest.raises(ValueError, match="the 'paged' KV backend takes PagedOptions, got VMemOptions"):
        create_kv_cache("paged", SPEC, **LIMITS, options=VMemOptions())
    with pytest.raises(ValueError, match="either as options= or as keywords"):
        create_kv_cache("paged", SPEC, **LIMITS, options=PagedOptions(), block_size=8)
    with pytest.raises(ValueError, match=r"VMemOptions.attention_impl must be one of"):
        create_kv_cache("vmem", SPEC, **LIMITS, driver="host", attention_impl="flash")


# ------------------------------------------------------------------ the engine config reads the options
def test_cache_config_defaults_and_ranges_come_from_the_options_classes():
    cc = CacheConfig()
    v, p = VMemOptions(), PagedOptions()
    assert (cc.block_size, cc.layout, cc.driver, cc.page_size_bytes, cc.attention_impl) == \
        (p.block_size, v.layout, v.driver, v.page_size_bytes, v.attention_impl)
    with pytest.raises(ValueError, match=r"^CacheConfig.attention_impl must be one of \['auto', 'triton', "
                                         r"'torch', 'sdpa'\], got 'flash'$"):
        CacheConfig(backend="vmem", attention_impl="flash")
    assert CacheConfig(backend="vmem", layout="per_layer", attention_impl="sdpa").backend_options() == \
        VMemOptions(layout="per_layer", attention_impl="sdpa")
    # the other backend's layout options are ignored (one set of knobs drives both backends) ...
    assert CacheConfig(backend="paged", layout="per_layer", block_size=32).backend_options() == \
        PagedOptions(block_size=32)
    # ... but an attention implementation the backend does not have is refused
    with pytest.raises(ValueError, match="the paged backend has no attention_impl; choose --backend vmem"):
        CacheConfig(backend="paged", attention_impl="torch")


def test_cache_config_has_every_backend_option():
    """Every field of every backend's options class is a CacheConfig field (BACKEND_OPTION_FIELDS) with
    the options class's default, so ``backend_options()`` can set each of them."""
    from vmkv.engine.config import BACKEND_OPTION_FIELDS

    cc = CacheConfig()
    for backend in BACKENDS:
        cls = backend_options_class(backend)
        assert set(cls.field_names()) <= set(BACKEND_OPTION_FIELDS), backend
        for name in cls.field_names():
            assert getattr(cc, name) == cls.field_default(name), name


def test_cache_config_lookahead_and_preallocate():
    v = VMemOptions()
    assert (CacheConfig().lookahead_tokens, CacheConfig().preallocate) == (v.lookahead_tokens, v.preallocate)
    assert CacheConfig(backend="vmem", lookahead_tokens=8, preallocate=True).backend_options() == \
        VMemOptions(lookahead_tokens=8, preallocate=True)
    # ranges are the options class's, checked on either backend; the paged backend ignores the values
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=r"^CacheConfig.lookahead_tokens must be an int >= 0, got -1$"):
            CacheConfig(backend=backend, lookahead_tokens=-1)
        with pytest.raises(ValueError, match=r"^CacheConfig.preallocate must be a bool, got 1$"):
            CacheConfig(backend=backend, preallocate=1)
    assert CacheConfig(backend="paged", lookahead_tokens=8, preallocate=True).backend_options() == PagedOptions()
    # and they reach the cache the registry builds
    cache = create_kv_cache("vmem", SPEC, **LIMITS, options=CacheConfig(
        backend="vmem", driver="host", lookahead_tokens=8, preallocate=True).backend_options())
    try:
        assert cache.lookahead_tokens == 8 and cache.backend_stats()["num_pages_created"] > 0
    finally:
        cache.close()
