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

__all__ = ["KVMemory", "kv_memory", "read_kv_memory", "created_bytes", "device_memory_used_bytes"]


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
