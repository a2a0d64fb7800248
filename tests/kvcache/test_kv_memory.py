"""Physical KV memory held (created / mapped / in use / idle) next to device memory, read through the
KV-cache interface on both backends (vmkv.engine.kv_memory), and its plot."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from vmkv.compare import report
from vmkv.engine.kv_memory import created_bytes, device_memory_used_bytes, kv_memory, read_kv_memory
from vmkv.kvcache import KVCacheSpec
from vmkv.kvcache.registry import create_kv_cache

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
LIMITS = dict(max_num_seqs=3, max_model_len=64, memory_bytes=1 << 20)
PAGE = 4096
KWARGS = {"paged": {}, "vmem": {"driver": "host", "page_size_bytes": PAGE}}


@pytest.mark.parametrize("backend", ["paged", "vmem"])
def test_kv_memory_follows_allocate_and_free(backend):
    with create_kv_cache(backend, SPEC, **LIMITS, **KWARGS[backend]) as cache:
        empty = read_kv_memory(cache)
        cache.allocate(1, 40)
        cache.allocate(2, 7)
        busy = read_kv_memory(cache)
        u = cache.usage()
        assert busy.in_use_bytes == u.allocated_bytes > 0 and busy.mapped_bytes == u.mapped_bytes
        assert busy.capacity_bytes == u.capacity_bytes
        for m in (empty, busy):
            assert m.capacity_bytes >= m.created_bytes >= m.mapped_bytes >= 0
            assert m.created_bytes >= m.in_use_bytes and m.idle_bytes == m.created_bytes - m.in_use_bytes
            assert m.device_used_bytes > 0     # CPU: this process's RSS
        if backend == "paged":                 # a static pool: everything exists from the start
            assert empty.created_bytes == busy.created_bytes == u.capacity_bytes
        else:                                  # pages are created on demand
            stats = cache.backend_stats()
            assert busy.created_bytes == stats["num_pages_created"] * PAGE > empty.created_bytes
        cache.free(1)
        cache.free(2)
        after = read_kv_memory(cache)
        assert after.in_use_bytes == 0 and after.idle_bytes == after.created_bytes


def test_created_bytes_sources():
    usage = SimpleNamespace(mapped_bytes=8192, allocated_bytes=4096, capacity_bytes=1 << 20)
    # a backend's own figure first, then vmem's page count, then the mapped bytes; never below mapped
    assert created_bytes(usage, {"created_bytes": 12288}) == 12288
    assert created_bytes(usage, {"num_pages_created": 5, "page_size_bytes": 4096}) == 20480
    assert created_bytes(usage, {"num_blocks": 3}) == 8192
    assert created_bytes(usage, {"num_pages_created": 1, "page_size_bytes": 4096}) == 8192
    # released pages make the figure fall (vmem's shrink): read fresh, nothing kept
    m1 = kv_memory(usage, {"num_pages_created": 9, "page_size_bytes": 4096}, 1)
    m2 = kv_memory(usage, {"num_pages_created": 2, "page_size_bytes": 4096}, 1)
    assert (m1.created_bytes, m1.idle_bytes) == (36864, 32768) and (m2.created_bytes, m2.idle_bytes) == (8192, 4096)


def test_device_memory_on_cpu_is_the_process_rss():
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    got = device_memory_used_bytes(torch.device("cpu"))
    assert abs(got - rss) < 64 << 20 and device_memory_used_bytes(None) > 0


def test_memory_timeline_plot_has_every_quantity(tmp_path, monkeypatch):
    steps = {"t_s": [0.0, 0.5, 1.0], "created_bytes": [4096, 8192, 4096], "mapped_bytes": [4096, 8192, 4096],
             "in_use_bytes": [0, 8192, 0], "idle_bytes": [4096, 0, 4096], "device_used_bytes": [1 << 30] * 3}
    labels = []
    plt = report._pyplot()
    real_finish = report._finish

    def spy(fig, axes, path, title, fontsize, **kw):
        labels.extend(line.get_label() for ax in axes for line in ax.get_lines())
        return real_finish(fig, axes, path, title, fontsize, **kw)

    monkeypatch.setattr(report, "_finish", spy)
    old = {"t_s": [0.0, 1.0], "allocated_bytes": [1, 2], "mapped_bytes": [2, 2]}   # results before the columns
    path = report.plot_memory_timeline({"paged": steps, "vmem": steps, "old": old}, tmp_path / "kv.png", "t")
    assert path.stat().st_size > 0 and plt is not None
    for b in ("paged", "vmem"):
        assert {f"{b} created", f"{b} mapped", f"{b} in use", f"{b} idle", f"{b} device used"} <= set(labels)
    assert {"old mapped", "old in use"} <= set(labels) and "old created" not in labels


def test_memory_series_merges_idle_samples_in_time_order():
    from vmkv.compare.engine_report import memory_series

    steps = {"t_s": [0.1, 0.9], "step_s": [0.01, 0.01], "created_bytes": [8, 8], "mapped_bytes": [8, 8],
             "in_use_bytes": [8, 4], "idle_bytes": [0, 4], "device_used_bytes": [5, 5]}
    idle = {"t_s": [0.3, 0.5], "created_bytes": [8, 4], "mapped_bytes": [8, 4], "in_use_bytes": [0, 0],
            "idle_bytes": [8, 4], "device_used_bytes": [5, 4]}
    merged = memory_series({"steps": steps, "idle_memory": idle})
    assert merged["t_s"] == [0.1, 0.3, 0.5, 0.9] and merged["created_bytes"] == [8, 8, 4, 8]
    assert merged["device_used_bytes"] == [5, 5, 4, 5] and "step_s" not in merged
    assert memory_series({"steps": steps}) is steps and memory_series({"steps": steps, "idle_memory": {}}) is steps


@pytest.mark.parametrize("backend", ["paged", "vmem"])
def test_created_bytes_is_an_o1_usage_field_and_reading_memory_skips_backend_stats(backend, monkeypatch):
    """Sampling memory every step must not perturb the run: ``usage().created_bytes`` carries it, and
    neither /metrics' reader nor the benchmark's sampler calls ``backend_stats()`` (vmem's summarises
    up to 100k latency samples: reading it every 50 ms cost vmem ~15% of its offline throughput on the
    H200)."""
    with create_kv_cache(backend, SPEC, **LIMITS, **KWARGS[backend]) as cache:
        cache.allocate(1, 40)
        u = cache.usage()
        assert u.created_bytes >= u.mapped_bytes and u.created_bytes > 0
        if backend == "vmem":
            assert u.created_bytes == cache.backend_stats()["created_bytes"]
        else:
            assert u.created_bytes == u.capacity_bytes
        monkeypatch.setattr(cache, "backend_stats", lambda: pytest.fail("backend_stats() read per sample"))
        assert read_kv_memory(cache).created_bytes == u.created_bytes
        assert created_bytes(u) == u.created_bytes
