"""The KV memory breakdown (the PagedAttention paper's Fig. 2): token states, reserved but unused, block or
page tails, idle; every part >= 0 and all four add up to the created bytes, on ``/metrics`` too."""

from types import SimpleNamespace

import pytest

from vmkv.engine.kv_memory import KVMemory, kv_breakdown
from vmkv.kvcache.records import CacheUsage
from vmkv.server.metrics import ServerMetrics


@pytest.mark.parametrize("allocated, waste, unused, created", [
    (1000, 100, 300, 4000),      # the ordinary case: 600 token, 300 reserved, 100 tail, 3000 idle
    (0, 0, 0, 4000),             # nothing live
    (1000, 100, 5000, 4000),     # reserved unused larger than what it can be: clamped to in use - tail
    (5000, 100, 0, 4000),        # allocated above created (never, but clamped): no negative idle
    (100, 500, 0, 100),          # waste above allocated: clamped
])
def test_breakdown_parts_are_nonnegative_and_add_up(allocated, waste, unused, created):
    b = kv_breakdown(allocated, waste, unused, created)
    parts = (b.token_bytes, b.reserved_unused_bytes, b.tail_bytes, b.idle_bytes)
    assert all(p >= 0 for p in parts) and sum(parts) == b.created_bytes == created


def test_breakdown_known_answer():
    assert kv_breakdown(1000, 100, 300, 4000).as_dict() == {
        "token_bytes": 600, "reserved_unused_bytes": 300, "tail_bytes": 100, "idle_bytes": 3000,
        "created_bytes": 4000}


def _parse(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_export_the_breakdown():
    usage = CacheUsage(num_seqs=2, used_tokens=40, allocated_bytes=1000, waste_bytes=100, capacity_bytes=8000,
                       mapped_bytes=4000, created_bytes=4000)
    stats = SimpleNamespace(kv_usage=usage, num_running=2, num_waiting=0, num_preempted_total=0,
                            prefix_hit_rate=0.0, num_steps=3, step_time_s_total=0.1, alloc_time_s_total=0.01,
                            max_concurrent_seqs=2, reserved_unused_bytes=300)
    mem = KVMemory(created_bytes=4000, mapped_bytes=4000, in_use_bytes=1000, idle_bytes=3000, capacity_bytes=8000,
                   device_used_bytes=123)
    metrics = ServerMetrics("paged", "m")
    metrics.set_engine_stats(stats, mem)
    m = _parse(metrics.render().decode())
    assert m["vmkv_kv_token_bytes"] == 600 and m["vmkv_kv_reserved_unused_bytes"] == 300
    assert m["vmkv_kv_tail_bytes"] == 100 == m["vmkv_kv_waste_bytes"] and m["vmkv_kv_idle_bytes"] == 3000
    assert (m["vmkv_kv_token_bytes"] + m["vmkv_kv_reserved_unused_bytes"] + m["vmkv_kv_tail_bytes"]
            + m["vmkv_kv_idle_bytes"]) == m["vmkv_kv_created_bytes"]
