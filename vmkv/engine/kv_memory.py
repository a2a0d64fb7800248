"""Physical KV memory held by a cache, next to the device memory in use: the numbers ``/metrics`` and
``vmkv compare engine`` plot over time to show memory following the load (issue 12, "Visible").

Read fresh at every scrape / sampled step, through the KV-cache interface only (``usage()``, O(1)), so memory that a backend gives back (vmem's shrink) shows as a fall:

- created: physical KV memory that exists now (``CacheUsage.created_bytes``; vmem: pages created and
  not released; paged: its static pool);
- mapped: created memory mapped into the cache's address space (``CacheUsage.mapped_bytes``);
- in use: claimed by live sequences (``CacheUsage.allocated_bytes``);
- idle: created but not in use (the reserve: free-but-kept pages, free blocks).

Device memory in use is ``total - free`` of ``torch.cuda.mem_get_info`` on CUDA (every process on the
device, weights and activations included) and the process's resident set on CPU (``/proc/self/statm``;
the host driver's pages are shared file memory and count in it).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["KVMemory", "kv_memory", "read_kv_memory", "created_bytes", "device_memory_used_bytes", "KVBreakdown",
           "kv_breakdown"]


@dataclass(frozen=True)
class KVMemory:
    """One reading of a cache's physical KV memory (K and V of all layers) and the device's memory.

    Attributes:
        created_bytes: physical KV memory that exists (>= mapped_bytes).
        mapped_bytes: physical KV memory mapped (vmem; paged: its pool).
        in_use_bytes: KV memory claimed by live sequences (``<= created_bytes``).
        idle_bytes: ``created_bytes - in_use_bytes``: held but backing no live sequence.
        capacity_bytes: the cache's budget (the most it may create).
        device_used_bytes: device memory in use (CUDA: total - free; CPU: process RSS); 0 if unknown.
    """

    created_bytes: int
    mapped_bytes: int
    in_use_bytes: int
    idle_bytes: int
    capacity_bytes: int
    device_used_bytes: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def created_bytes(usage: Any, stats: dict | None = None) -> int:
    """Physical KV bytes that exist: ``CacheUsage.created_bytes`` (O(1), every backend fills it), else
    from ``backend_stats()`` (a ``created_bytes`` key or ``num_pages_created x page_size_bytes``), else
    the mapped bytes.  Never below the mapped bytes."""
    stats = stats or {}
    if getattr(usage, "created_bytes", 0):
        created = int(usage.created_bytes)
    elif "created_bytes" in stats:
        created = int(stats["created_bytes"])
    elif "num_pages_created" in stats and "page_size_bytes" in stats:
        created = int(stats["num_pages_created"]) * int(stats["page_size_bytes"])
    else:
        created = int(usage.mapped_bytes)
    return max(created, int(usage.mapped_bytes))


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def device_memory_used_bytes(device: Any = None) -> int:
    """Device memory in use: ``total - free`` from ``torch.cuda.mem_get_info(device)`` on a CUDA
    device, else this process's resident set size (bytes); 0 when neither can be read."""
    if device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return int(total - free)
    return _rss_bytes()


def kv_memory(usage: Any, stats: dict | None, device_used: int) -> KVMemory:
    """A :class:`KVMemory` from a cache's ``usage()`` (and optionally its ``backend_stats()``) and the
    device memory in use (:func:`device_memory_used_bytes`)."""
    created = created_bytes(usage, stats)
    in_use = int(usage.allocated_bytes)
    return KVMemory(created_bytes=created, mapped_bytes=int(usage.mapped_bytes), in_use_bytes=in_use,
                    idle_bytes=max(0, created - in_use), capacity_bytes=int(usage.capacity_bytes),
                    device_used_bytes=int(device_used))


def read_kv_memory(kv_cache: Any, device: Any = None) -> KVMemory:
    """:func:`kv_memory` of ``kv_cache`` now (call it on the thread that owns the cache)."""
    # usage() only: O(1) (backend_stats() summarises latency samples; too slow to read every step)
    return kv_memory(kv_cache.usage(), None, device_memory_used_bytes(device))


@dataclass(frozen=True)
class KVBreakdown:
    """Where the physical KV memory goes (the PagedAttention paper's Fig. 2), four parts that add up to
    the created bytes:

    Attributes:
        token_bytes: holding token states (K and V) that a step has written for a live sequence.
        reserved_unused_bytes: backed for a live sequence at positions no step has written yet (a static
            reservation's unused part; without one, the positions backed a step ahead).
        tail_bytes: internal fragmentation: the part of the in-use units past the backed positions
            (block or page tails: ``CacheUsage.waste_bytes``).
        idle_bytes: created but backing no live sequence (paged: the static pool's free blocks; vmem:
            pages mapped or kept but idle).
        created_bytes: physical KV memory that exists (the sum of the four).
    """

    token_bytes: int
    reserved_unused_bytes: int
    tail_bytes: int
    idle_bytes: int
    created_bytes: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def kv_breakdown(allocated_bytes: int, waste_bytes: int, reserved_unused_bytes: int, created: int) -> KVBreakdown:
    """Split ``created`` bytes into :class:`KVBreakdown`'s parts from a cache's ``allocated_bytes`` and
    ``waste_bytes`` (``CacheUsage``) and the engine's ``reserved_unused_bytes`` (``EngineStats``), each
    clamped so that every part is >= 0 and they add up to ``created``: in use = min(allocated, created),
    tail = min(waste, in use), reserved unused = min(reserved_unused, in use - tail), tokens the rest of
    in use, idle = created - in use."""
    created = max(0, int(created))
    in_use = min(max(0, int(allocated_bytes)), created)
    tail = min(max(0, int(waste_bytes)), in_use)
    unused = min(max(0, int(reserved_unused_bytes)), in_use - tail)
    return KVBreakdown(token_bytes=in_use - tail - unused, reserved_unused_bytes=unused, tail_bytes=tail,
                       idle_bytes=created - in_use, created_bytes=created)
