"""The allocator-peer interface of ``vmkv.compare.alloc_peers``: the config every adapter gets, its counters,
the abstract adapter and the registry of named allocators.

One file per implementation: ``alloc_vmem`` (vmem through ``create_kv_cache``), ``alloc_vattention``
(vAttention's synchronous API) and ``alloc_kvcached`` (kvcached's ``KVCacheManager``); the registry's
factories import them lazily.  Peer packages are imported only when their adapter is built.
"""

from __future__ import annotations

import abc
import importlib.util
from dataclasses import dataclass, field

from vmkv.compare.shapes import get_shape


#: sequence ids of the admissions after the trace: warm ones from WARM_FIRST_ID, cold ones from
#: COLD_FIRST_ID (the trace's own ids are below both)
WARM_FIRST_ID, COLD_FIRST_ID = 10_000, 20_000


def admission_phase(seq_id: int) -> str:
    """"trace", "warm" or "cold": which part of the benchmark admits ``seq_id``."""
    return "trace" if seq_id < WARM_FIRST_ID else ("warm" if seq_id < COLD_FIRST_ID else "cold")


class PeerUnavailableError(RuntimeError):
    """A peer allocator is not installed or cannot run here (the run records it as skipped)."""


@dataclass(frozen=True)
class BenchConfig:
    """Shape, device and budget every allocator gets."""

    model: str = "llama3-8b"
    dtype: str | None = None
    device: str = "cuda"
    kv_memory_bytes: int = 20 << 30
    max_num_seqs: int = 65
    max_model_len: int = 2048
    vmem_page_size_bytes: int | None = None
    vmem_reserve_bytes: int | None = None
    idle_s: float = 0.5

    def spec(self):
        return get_shape(self.model).spec(self.dtype, self.device)


@dataclass(frozen=True)
class Counters:
    """An allocator's own counts, in bytes (``vmkv.compare.alloc_peers`` docstring)."""

    in_use_bytes: int
    mapped_bytes: int
    held_bytes: int


class AllocatorAdapter(abc.ABC):
    """One allocator behind the trace's three operations (ids are the trace's sequence ids)."""

    name = ""

    @abc.abstractmethod
    def admit(self, seq_id: int, num_tokens: int) -> None: ...

    @abc.abstractmethod
    def grow(self, seq_id: int, new_len: int) -> None: ...

    @abc.abstractmethod
    def free(self, seq_id: int) -> None: ...

    @abc.abstractmethod
    def counters(self) -> Counters: ...

    @abc.abstractmethod
    def touch(self, seq_id: int, pos: int) -> bool:
        """Write seeded values at position ``pos`` of ``seq_id`` in the first and last layer and read them
        back through the allocator's tensors: True when they match (the memory is really mapped)."""

    def before_admit(self, seq_id: int, num_tokens: int) -> None:
        """What the allocator's engine does for an admission it expects, before making it, while the
        previous step's forward runs (vmem-prefetch: ``prefetch_admission``); not timed with the
        admission: an adapter that does work here reports its time in :meth:`info`."""

    def between_steps(self) -> None:
        """What the allocator's engine does between decode steps (vmem: ``release_idle``)."""

    def idle(self) -> None:
        """Called after ``--idle-s`` idle seconds following the burst."""

    def drop(self) -> None:
        """Return idle memory to the device by the allocator's own means."""

    def info(self) -> dict:
        return {}

    def close(self) -> None: ...


def device_index(spec) -> int:
    """CUDA device index of ``spec``'s device (the current one when it names none; 0 on CPU)."""
    import torch

    index = spec.torch_device.index
    return index if index is not None else (torch.cuda.current_device() if spec.is_cuda else 0)


def rand_rows(spec, n: int, seed: int):
    """Seeded rows ``[n, num_kv_heads, head_dim]`` in ``spec``'s dtype on its device (same seed, same rows)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, spec.num_kv_heads, spec.head_dim), generator=g).to(spec.torch_device, spec.dtype)


@dataclass(frozen=True)
class AllocatorEntry:
    """A named allocator of the registry: how to build its adapter, and what it needs to run."""

    make: object                    # (BenchConfig) -> AllocatorAdapter
    module: str | None = None       # peer package whose absence skips it
    env: dict = field(default_factory=dict)   # environment of its worker process


# the factories import their adapter module on first use (one file per peer)
def _vmem(layout: str, prefetch: bool = False, **options):
    """An entry's factory: vmem in ``layout`` with ``options`` (``VMemOptions`` fields, passed through)."""
    def make(cfg: BenchConfig) -> AllocatorAdapter:
        from vmkv.compare.alloc_vmem import DEFAULT_CUDA_PREFETCH_TOKENS, VMemAdapter

        return VMemAdapter(cfg, layout, prefetch_tokens=DEFAULT_CUDA_PREFETCH_TOKENS if prefetch else 0, **options)
    return make


def _vattention(megacache: bool):
    def make(cfg: BenchConfig) -> AllocatorAdapter:
        from vmkv.compare.alloc_vattention import VAttentionAdapter

        return VAttentionAdapter(cfg, megacache=megacache)
    return make


def _kvcached(cfg: BenchConfig) -> AllocatorAdapter:
    from vmkv.compare.alloc_kvcached import KvcachedAdapter

    return KvcachedAdapter(cfg)


ALLOCATORS: dict[str, AllocatorEntry] = {
    "vmem": AllocatorEntry(_vmem("megacache")),
    "vmem-per_layer": AllocatorEntry(_vmem("per_layer")),
    # every page created up front, as vAttention's pool (no elastic shrink)
    "vmem-prealloc": AllocatorEntry(_vmem("megacache", preallocate=True)),
    # the engine's prefetch between steps (timed apart and reported), as kvcached's prealloc thread
    "vmem-prefetch": AllocatorEntry(_vmem("megacache", prefetch=True)),
    # 32 MiB pages (16 x the 2 MiB granularity): fewer, larger physical allocations, as kvcached's
    # compound pages, at the cost of a 32 MiB (256-token) unit per slot
    "vmem-32MiB": AllocatorEntry(_vmem("megacache", page_size_bytes=32 << 20)),
    "vmem-32MiB-prefetch": AllocatorEntry(_vmem("megacache", prefetch=True, page_size_bytes=32 << 20)),
    "vattention": AllocatorEntry(_vattention(megacache=False), "vattention"),
    "vattention-megacache": AllocatorEntry(_vattention(megacache=True), "vattention"),
    "kvcached": AllocatorEntry(_kvcached, "kvcached"),
    "kvcached-sync": AllocatorEntry(_kvcached, "kvcached", {"KVCACHED_PAGE_PREALLOC_ENABLED": "false"}),
}
DEFAULT_ALLOCATORS = ("vmem", "vattention", "kvcached", "vmem-prefetch", "vmem-per_layer",
                      "vattention-megacache", "kvcached-sync")


def missing_reason(name: str, device: str) -> str | None:
    """Why allocator ``name`` cannot run here (not installed, no CUDA), or None."""
    entry = ALLOCATORS[name]
    if entry.module is None:
        return None
    if importlib.util.find_spec(entry.module) is None:
        return f"not installed (no module named {entry.module!r})"
    if not device.startswith("cuda"):
        return f"needs a CUDA device (--device {device})"
    return None
