"""Prometheus metrics of the server, in a :class:`CollectorRegistry` of its own (one per app).

Two kinds:

* engine state, read at scrape time from a fresh ``engine.get_stats()`` snapshot and a fresh
  :class:`~vmkv.engine.kv_memory.KVMemory` reading (both taken in the engine core process, between two
  steps, for the ``/metrics`` handler: :func:`read_engine_state` through ``AsyncEngine.call``): KV used tokens, allocated / mapped / reserved / waste / capacity
  bytes, the physical KV bytes held (created, in use, idle) and their breakdown (token states, reserved
  but unused, block or page tails, idle; they add up to created) next to the device memory in use, running
  and waiting requests, preemptions, prefix-cache hit rate, steps;
* per-request observations made when a request finishes (in the front, on the event loop, from the
  timestamps the front took as the core's messages arrived): time to first token, inter-token latency, end-to-end latency, token counters and
  requests by finish reason.

Names follow the Prometheus conventions: base units (seconds, bytes), ``_total`` for counters.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from vmkv.engine.kv_memory import KVMemory, kv_breakdown, read_kv_memory

__all__ = ["ServerMetrics", "CONTENT_TYPE", "read_engine_state"]

logger = logging.getLogger(__name__)

#: the Content-Type of the Prometheus text exposition format 0.0.4
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                  0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


def read_engine_state(engine: Any) -> tuple[Any, KVMemory]:
    """``(engine.get_stats(), KVMemory of its cache)`` read now; run it in the engine core
    (``AsyncEngine.call``), between two steps."""
    return engine.get_stats(), read_kv_memory(engine.kv_cache, engine.device)


class _EngineCollector(Collector):
    """Turns the last ``EngineStats`` snapshot into metric families at scrape time."""

    def __init__(self, backend: str, model: str) -> None:
        self.backend = backend
        self.model = model
        self.stats: Any = None
        self.kv_memory: KVMemory | None = None

    def collect(self) -> Iterable[Any]:
        info = InfoMetricFamily("vmkv_server", "Served model and KV backend")
        info.add_metric([], {"model": self.model, "backend": self.backend})
        yield info
        s = self.stats
        if s is None:
            return
        u = s.kv_usage

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=float(value))

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=float(value))

        yield gauge("vmkv_kv_used_tokens", "Tokens held in the KV cache by live sequences", u.used_tokens)
        yield gauge("vmkv_kv_num_seqs", "Live sequences in the KV cache", u.num_seqs)
        yield gauge("vmkv_kv_allocated_bytes", "KV bytes backing live sequences", u.allocated_bytes)
        yield gauge("vmkv_kv_waste_bytes", "Allocated KV bytes holding no token (block/page tails)",
                    u.waste_bytes)
        yield gauge("vmkv_kv_mapped_bytes", "Physical KV bytes held by the backend, incl. free-but-kept",
                    u.mapped_bytes)
        yield gauge("vmkv_kv_reserved_bytes", "Virtual address space reserved (vmem)", u.reserved_bytes)
        yield gauge("vmkv_kv_capacity_bytes", "KV memory budget", u.capacity_bytes)
        yield gauge("vmkv_kv_free_tokens", "Tokens a new sequence could still get", u.free_tokens)
        yield gauge("vmkv_kv_usage_ratio", "allocated_bytes / capacity_bytes",
                    u.allocated_bytes / u.capacity_bytes if u.capacity_bytes else 0.0)
        yield gauge("vmkv_num_requests_running", "Requests scheduled in the running batch", s.num_running)
        yield gauge("vmkv_num_requests_waiting", "Requests queued for admission", s.num_waiting)
        yield counter("vmkv_num_preemptions", "Recompute preemptions since start", s.num_preempted_total)
        yield gauge("vmkv_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up",
                    s.prefix_hit_rate)
        yield counter("vmkv_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      u.prefix_query_tokens)
        yield counter("vmkv_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                      u.prefix_hit_tokens)
        yield counter("vmkv_engine_steps", "Engine steps run", s.num_steps)
        yield counter("vmkv_engine_step_time_seconds", "Wall time spent in engine steps",
                      s.step_time_s_total)
        yield counter("vmkv_kv_alloc_time_seconds", "Wall time spent allocating KV", s.alloc_time_s_total)
        yield gauge("vmkv_max_concurrent_seqs", "Most sequences ever running at once",
                    s.max_concurrent_seqs)
        m = self.kv_memory
        if m is None:
            return
        yield gauge("vmkv_kv_created_bytes", "Physical KV bytes that exist now (vmem: pages created and "
                    "not released; paged: the static pool)", m.created_bytes)
        yield gauge("vmkv_kv_in_use_bytes", "Physical KV bytes claimed by live sequences", m.in_use_bytes)
        yield gauge("vmkv_kv_idle_bytes", "Physical KV bytes held but backing no live sequence "
                    "(created - in use: the reserve)", m.idle_bytes)
        yield gauge("vmkv_device_memory_used_bytes", "Device memory in use (CUDA: total - free, every "
                    "process; CPU: this process's resident set)", m.device_used_bytes)
        # the memory breakdown (the PagedAttention paper's Fig. 2): token + reserved unused + tail + idle
        # = created (vmkv.engine.kv_memory.kv_breakdown)
        b = kv_breakdown(u.allocated_bytes, u.waste_bytes, getattr(s, "reserved_unused_bytes", 0), m.created_bytes)
        yield gauge("vmkv_kv_token_bytes", "Physical KV bytes holding token states written for live sequences",
                    b.token_bytes)
        yield gauge("vmkv_kv_reserved_unused_bytes", "Physical KV bytes backed for live sequences at "
                    "positions not written yet (a static reservation's unused part)", b.reserved_unused_bytes)
        yield gauge("vmkv_kv_tail_bytes", "Physical KV bytes of in-use units past the backed positions "
                    "(internal fragmentation: block or page tails)", b.tail_bytes)


class ServerMetrics:
    """All metrics of one app.

    Args:
        backend: KV backend name (``paged`` / ``vmem``), exported in ``vmkv_server_info``.
        model: served model name.
    """

    def __init__(self, backend: str, model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = _EngineCollector(backend, model)
        self.registry.register(self._engine)
        r = self.registry
        self.ttft = Histogram("vmkv_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("vmkv_inter_token_latency_seconds", "Time between two tokens of a request",
                             buckets=_ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("vmkv_e2e_request_latency_seconds", "Arrival to finish of a request",
                             buckets=_E2E_BUCKETS_S, registry=r)
        self.requests = Counter("vmkv_requests_finished", "Finished engine requests by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("vmkv_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("vmkv_generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.http_requests = Counter("vmkv_http_requests", "HTTP requests by endpoint and status",
                                     ["endpoint", "status"], registry=r)

    def set_engine_stats(self, stats: Any, kv_memory: KVMemory | None = None) -> None:
        """Remember the ``EngineStats`` snapshot and the :class:`KVMemory` reading exported at the
        next scrape (``None``: export neither)."""
        self._engine.stats = stats
        self._engine.kv_memory = kv_memory if stats is not None else None

    def observe_finished(self, out: Any) -> None:
        """Record one finished ``RequestOutput`` (called on the front's event loop)."""
        m = out.metrics
        arrival = m.arrival_time
        if m.first_token_time is not None and arrival is not None:
            self.ttft.observe(max(0.0, m.first_token_time - arrival))
        times = list(m.token_times or ())
        for a, b in zip(times, times[1:]):
            self.itl.observe(max(0.0, b - a))
        if m.finished_time is not None and arrival is not None:
            self.e2e.observe(max(0.0, m.finished_time - arrival))
        reasons = {c.finish_reason or "abort" for c in out.outputs} or {"abort"}
        reason = "abort" if "abort" in reasons else ("length" if "length" in reasons else "stop")
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids or ()))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
