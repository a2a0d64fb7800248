"""Allocator peers side by side: vmem, vAttention (synchronous API) and kvcached on one sequence-length trace.

    python3 -m vmkv.compare.alloc_peers --out DIR [--allocators vmem,vattention,kvcached,...]

Every allocator gets the same seeded trace (:func:`make_trace`): ``--num-seqs`` sequences are admitted at
once with a prompt (``--prompt-len``), grow ``--decode-tokens`` positions per decode step until their final
length (``--final-len``), and are freed when they reach it; the burst ends with the last free.  Then
``--admit-reps`` admissions of one ``--admit-len``-token prompt, **warm** (right after one of that size was
freed) and **cold** (after the allocator returned its idle memory: vmem ``release_idle`` past its grace
period, vAttention ``step(..., eager_reclaim=True)``, kvcached ``trim()``).

What is timed: ``time.perf_counter_ns`` around one adapter call on the host (all three allocate
synchronously; nothing runs on the GPU meanwhile).  *grow* is the call that takes one sequence from n to
n + decode_tokens positions: vmem ``extend(seq, 1)``; vAttention ``step(seq_lens, True)`` with that one
length changed (Sarathi-Serve's synchronous mode); kvcached ``alloc(1)`` when a 16-token block boundary is
crossed (nothing otherwise).  A **page-boundary call** is a grow after which the allocator's own count of
KV bytes in use by sequences rose; its latency per 2 MiB is the call's time / (bytes newly in use / 2 MiB),
since one call brings 2 MiB (vmem megacache), 4 MiB (vAttention megacache) or 128 MiB (vAttention and vmem
per-layer: a page in each of 64 K/V tensors; kvcached: its compound page) into use.  *admission* is the call
(vAttention: ``alloc_new_batch_idx`` + ``step``) that backs a new 2048-token prompt.  vAttention's step()
walks every request slot, so calling it once per sequence change (needed to time one sequence's page
boundary) inflates its *grow total*; the time in page-boundary calls (*map total*) is the trace-level figure
to compare.  ``vmem-prealloc`` creates every page up front as vAttention does (``preallocate=True``).

Memory: ``torch.cuda.mem_get_info`` used bytes less those before the allocator was built (``device``) and
the allocator's own count (``held``: vmem ``usage().created_bytes``; vAttention its page pool, created up
front; kvcached in-use + reserved pages), at the peak, right after the burst, after ``--idle-s`` idle
seconds (vmem: plus ``release_idle`` with its clock advanced past ``kv_shrink_grace_s``) and after the
return of idle memory.  Each allocator runs in its own process (a fresh CUDA context; vAttention keeps
global state); a peer that is not installed, or needs CUDA on a CPU run, is skipped with one log line.
"""

from __future__ import annotations

import abc
import argparse
import hashlib
import importlib.util
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from vmkv.compare import report
from vmkv.compare.shapes import SHAPES, get_shape
from vmkv.engine.args import parse_size

logger = logging.getLogger(__name__)

MIB2 = 2 << 20
ADMIT, GROW, FREE = "admit", "grow", "free"
#: vAttention's page size on its CUDA backend (other sizes need its custom UVM driver)
VATTN_PAGE_BYTES = 2 << 20
#: kvcached's block size in tokens (vLLM's default)
KVCACHED_BLOCK_TOKENS = 16


class PeerUnavailableError(RuntimeError):
    """A peer allocator is not installed or cannot run here (the run records it as skipped)."""


def _int_range(text: str) -> tuple[int, int]:
    """``"A..B"`` or ``"N"`` to an inclusive ``(A, B)``; raises argparse.ArgumentTypeError."""
    try:
        lo, _, hi = text.partition("..")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or A..B (integers), got {text!r}") from None
    return lo, hi


# ---------------------------------------------------------------------------------------- trace
@dataclass(frozen=True)
class TraceConfig:
    """The seeded workload every allocator runs (module docstring)."""

    num_seqs: int = 64
    prompt_len: tuple[int, int] = (64, 256)
    final_len: tuple[int, int] = (512, 2048)
    decode_tokens: int = 1
    admit_len: int = 2048
    admit_reps: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_seqs", "decode_tokens", "admit_len", "admit_reps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TraceConfig.{name} must be an int >= 1, got {value!r}")
        (p0, p1), (f0, f1) = self.prompt_len, self.final_len
        if not 1 <= p0 <= p1:
            raise ValueError(f"TraceConfig.prompt_len must be A..B with 1 <= A <= B, got {p0}..{p1}")
        if not p1 < f0 <= f1:
            raise ValueError(f"TraceConfig.final_len must be A..B with prompt max {p1} < A <= B, got {f0}..{f1}")

    @property
    def max_len(self) -> int:
        return max(self.final_len[1], self.admit_len)


def make_trace(cfg: TraceConfig) -> list[list[tuple[str, int, int]]]:
    """Decode steps of ``(op, seq_id, num_tokens)``: step 0 admits every sequence with its prompt; each
    later step grows every live sequence by ``decode_tokens`` (``num_tokens`` = its new length) and frees
    (``num_tokens`` 0) those that reached their final length.  Same ``cfg``, same trace."""
    rng = random.Random(cfg.seed)
    lens = [rng.randint(*cfg.prompt_len) for _ in range(cfg.num_seqs)]
    finals = [rng.randint(*cfg.final_len) for _ in range(cfg.num_seqs)]
    steps = [[(ADMIT, s, n) for s, n in enumerate(lens)]]
    live = list(range(cfg.num_seqs))
    while live:
        step, still = [], []
        for s in live:
            lens[s] = min(finals[s], lens[s] + cfg.decode_tokens)
            step.append((GROW, s, lens[s]))
            if lens[s] == finals[s]:
                step.append((FREE, s, 0))
            else:
                still.append(s)
        steps.append(step)
        live = still
    return steps


def trace_digest(steps: list[list[tuple[str, int, int]]]) -> str:
    """sha256 of the trace (the runs of one comparison must show the same)."""
    return hashlib.sha256(json.dumps(steps).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------- adapters
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
    """An allocator's own counts, in bytes (module docstring)."""

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

    def between_steps(self) -> None:
        """What the allocator's engine does between decode steps (vmem: ``release_idle``)."""

    def idle(self) -> None:
        """Called after ``--idle-s`` idle seconds following the burst."""

    def drop(self) -> None:
        """Return idle memory to the device by the allocator's own means."""

    def info(self) -> dict:
        return {}

    def close(self) -> None: ...


def _device_index(spec) -> int:
    import torch

    index = spec.torch_device.index
    return index if index is not None else (torch.cuda.current_device() if spec.is_cuda else 0)


def _rand_rows(spec, n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, spec.num_kv_heads, spec.head_dim), generator=g).to(spec.torch_device, spec.dtype)


class VMemAdapter(AllocatorAdapter):
    """vmem through the public interface (``create_kv_cache("vmem", ...)``), default options but the layout."""

    def __init__(self, cfg: BenchConfig, layout: str, preallocate: bool = False) -> None:
        from vmkv.kvcache import backend_options_class, create_kv_cache

        self.name, self.spec = f"vmem ({layout}{', preallocate' if preallocate else ''})", cfg.spec()
        options = {"layout": layout, "preallocate": preallocate}
        if not self.spec.is_cuda:
            options["driver"] = "host"
        if cfg.vmem_page_size_bytes:
            options["page_size_bytes"] = cfg.vmem_page_size_bytes
        if cfg.vmem_reserve_bytes is not None:
            options["kv_reserve_bytes"] = cfg.vmem_reserve_bytes
        opts = backend_options_class("vmem")(**options)
        self.grace_s = opts.kv_shrink_grace_s
        self.cache = create_kv_cache("vmem", self.spec, max_num_seqs=cfg.max_num_seqs,
                                     max_model_len=cfg.max_model_len, memory_bytes=cfg.kv_memory_bytes,
                                     options=opts)
        self.lens: dict[int, int] = {}
        self._clock_offset_s = 0.0

    def admit(self, seq_id, num_tokens):
        self.cache.allocate(seq_id, num_tokens)
        self.lens[seq_id] = num_tokens

    def grow(self, seq_id, new_len):
        self.cache.extend(seq_id, new_len - self.lens[seq_id])
        self.lens[seq_id] = new_len

    def free(self, seq_id):
        self.cache.free(seq_id)
        del self.lens[seq_id]

    def counters(self):
        u = self.cache.usage()
        return Counters(u.allocated_bytes, u.mapped_bytes, u.created_bytes)

    def touch(self, seq_id, pos):
        ok = True
        for layer in (0, self.spec.num_layers - 1):
            k, v = _rand_rows(self.spec, 1, 17 * pos + layer), _rand_rows(self.spec, 1, 31 * pos + layer)
            self.cache.write(seq_id, layer, pos, k, v)
            gk, gv = self.cache.gather(seq_id, layer)
            ok = ok and bool((gk[pos] == k[0]).all()) and bool((gv[pos] == v[0]).all())
        return ok

    def _release(self) -> None:
        # the engine's call between steps; the clock it is given is advanced only by idle()/drop()
        self.cache.release_idle(now=time.monotonic() + self._clock_offset_s)

    def between_steps(self):
        self._release()

    def idle(self):
        """``release_idle`` as the engine calls it once ``kv_shrink_grace_s`` has passed (clock advanced)."""
        if self.spec.is_cuda:       # the fences recorded at free time (untimed)
            import torch

            torch.cuda.synchronize()
        self._release()
        self._clock_offset_s += self.grace_s + 1.0
        for _ in range(64):     # a page whose fence is pending waits for a later call
            before = self.cache.usage().created_bytes
            self._release()
            if self.cache.usage().created_bytes == before:
                break

    drop = idle

    def info(self):
        s = self.cache.backend_stats()
        keys = ("layout", "driver", "page_size_bytes", "pages_per_unit", "kv_reserve_bytes", "num_maps",
                "num_unmaps", "map_us_p50", "map_us_p99", "unmap_us_p50", "unmap_us_p99",
                "num_pages_created", "num_released_pages")
        return {"kv_shrink_grace_s": self.grace_s, **{k: s.get(k) for k in keys}}

    def close(self):
        self.cache.close()


class VAttentionAdapter(AllocatorAdapter):
    """vAttention's synchronous API as Sarathi-Serve drives it (``step(seq_lens, True)``), one call per
    sequence change; its page pool is created up front (``reserve_physical_pages``)."""

    def __init__(self, cfg: BenchConfig, megacache: bool) -> None:
        import torch     # first: the extension links against libtorch

        try:
            import vattention
        except ImportError as e:
            raise PeerUnavailableError(f"vattention is not installed ({e})") from None

        self.vattn, self.spec = vattention, cfg.spec()
        s, self.mega = self.spec, megacache
        self.name = "vattention (sync, megacache)" if megacache else "vattention (sync)"
        dev_index = _device_index(s)
        torch.empty(1, device=s.torch_device)      # vAttention needs a current CUDA context
        B, L = cfg.max_num_seqs, cfg.max_model_len
        self.kv = vattention.init_kvcache(s.num_layers, s.num_kv_heads, s.head_dim, B, L, dev_index, s.dtype,
                                          VATTN_PAGE_BYTES, megacache)
        want = ([(B, L, s.num_layers, s.num_kv_heads, s.head_dim)] * 2 if megacache
                else [(B, L, s.num_kv_heads, s.head_dim)] * (2 * s.num_layers))
        got = [tuple(t.shape) for t in self.kv]
        if got != want:
            raise RuntimeError(f"vattention.init_kvcache returned tensors of shapes {got[:2]}... "
                               f"({len(got)} tensors), expected {want[0]} x {len(want)}")
        self.pool_pages = int(vattention.reserve_physical_pages(cfg.kv_memory_bytes))
        # bytes of one token's K in one of its tensors (all layers' K in the megacache one)
        row = (s.bytes_per_token if megacache else s.bytes_per_token_per_layer) // 2
        self.tokens_per_page = VATTN_PAGE_BYTES // row
        # one "KV block" of vAttention: a page in each of its K and V tensors
        self.block_bytes = VATTN_PAGE_BYTES * (2 if megacache else 2 * s.num_layers)
        self.lens = [0] * B
        self.idx: dict[int, int] = {}
        self.mapped = [0] * B           # mirror of its per-request mapped blocks (its API exposes none)
        self._reclaim: set[int] = set()

    def _blocks(self, n: int) -> int:
        return -(-n // self.tokens_per_page)

    def _step(self, i: int) -> None:
        self.vattn.step(self.lens, True)
        for r in self._reclaim:         # eager reclamation of freed requests (step_sync)
            self.mapped[r] = 0
        self._reclaim.clear()
        self.mapped[i] = max(self.mapped[i], self._blocks(self.lens[i]))

    def admit(self, seq_id, num_tokens):
        i = self.vattn.alloc_new_batch_idx(num_tokens)
        if i < 0:
            raise RuntimeError(f"vattention has no free request slot for sequence {seq_id}")
        self.idx[seq_id], self.lens[i] = i, num_tokens
        self._step(i)

    def grow(self, seq_id, new_len):
        i = self.idx[seq_id]
        self.lens[i] = new_len
        self._step(i)

    def free(self, seq_id):
        i = self.idx.pop(seq_id)
        self.vattn.free_batch_idx(i)
        self.lens[i] = 0
        self._reclaim.add(i)

    def counters(self):
        in_use = sum(self._blocks(n) for n in self.lens if n)
        return Counters(in_use * self.block_bytes, sum(self.mapped) * self.block_bytes,
                        self.pool_pages * VATTN_PAGE_BYTES)

    def drop(self):
        self.vattn.step(self.lens, True)
        for r in self._reclaim:
            self.mapped[r] = 0
        self._reclaim.clear()

    def touch(self, seq_id, pos):
        i, s, ok = self.idx[seq_id], self.spec, True
        for n, layer in enumerate((0, s.num_layers - 1)):
            x = _rand_rows(s, 1, 17 * pos + layer)[0]
            if self.mega:
                t, where = self.kv[n], (i, pos, layer)
            else:
                t, where = self.kv[layer if n == 0 else s.num_layers + layer], (i, pos)
            t[where] = x
            ok = ok and bool((t[where] == x).all())
        return ok

    def info(self):
        assert sum(self.mapped) <= self.pool_pages * VATTN_PAGE_BYTES // self.block_bytes, "mirror overflow"
        return {"page_size_bytes": VATTN_PAGE_BYTES, "megacache": self.mega, "eager_reclaim": True,
                "tokens_per_page": self.tokens_per_page, "block_bytes": self.block_bytes,
                "pool_pages": self.pool_pages, "module": getattr(self.vattn, "__file__", None)}

    # close(): nothing; vattention.cleanup() unmaps its whole reservations and exits the process on a
    # driver error, and the process ends right after the run anyway


class KvcachedAdapter(AllocatorAdapter):
    """kvcached's ``KVCacheManager`` as its own tests build it (vLLM integration, one worker, synchronous
    scheduling): 16-token blocks handed out of 2 MiB-per-layer pages mapped on demand."""

    def __init__(self, cfg: BenchConfig) -> None:
        import torch

        try:
            import kvcached
            from kvcached.integration.vllm import interfaces as kvi
            from kvcached.kv_cache_manager import KVCacheManager
            from kvcached.vmm_ops import kv_tensors_created
        except ImportError as e:
            raise PeerUnavailableError(f"kvcached is not installed ({e})") from None

        self.spec = s = cfg.spec()
        self.kvi, self.version = kvi, getattr(kvcached, "__version__", None)
        dev_index = _device_index(s)
        if s.is_cuda:
            torch.cuda.set_device(dev_index)
        kvi.init_kvcached(tp_rank=0, world_size=1, is_worker=True, async_sched=False)
        cell = s.bytes_per_token_per_layer // 2      # kvcached's cell: one token's K (or V) in one layer
        self.num_blocks = s.max_tokens_for_bytes(cfg.kv_memory_bytes) // KVCACHED_BLOCK_TOKENS
        self.views = kvi.alloc_kv_cache(
            kvcache_shape=(2, self.num_blocks, KVCACHED_BLOCK_TOKENS, s.num_kv_heads, s.head_dim),
            block_size=KVCACHED_BLOCK_TOKENS, dtype=s.dtype, device=f"cuda:{dev_index}", num_layers=s.num_layers)
        t0 = time.monotonic()
        while not kv_tensors_created():
            if time.monotonic() - t0 > 10:
                raise RuntimeError("kvcached: KV tensors not created within 10 s")
            time.sleep(0.01)
        self.manager = KVCacheManager(num_blocks=self.num_blocks, block_size=KVCACHED_BLOCK_TOKENS,
                                      cell_size=cell, num_layers=s.num_layers, world_size=1)
        self.bundle_bytes = self.manager.page_size * s.num_layers * 2
        self.name, self.blocks = "kvcached", {}

    def _alloc(self, seq_id: int, n: int) -> list[int]:
        ids = self.manager.alloc(n)
        if ids is None:
            raise RuntimeError(f"kvcached could not allocate {n} blocks for sequence {seq_id}")
        return ids

    def admit(self, seq_id, num_tokens):
        self.blocks[seq_id] = self._alloc(seq_id, -(-num_tokens // KVCACHED_BLOCK_TOKENS))

    def grow(self, seq_id, new_len):
        have = self.blocks[seq_id]
        need = -(-new_len // KVCACHED_BLOCK_TOKENS) - len(have)
        if need > 0:
            have += self._alloc(seq_id, need)

    def free(self, seq_id):
        self.manager.free(self.blocks.pop(seq_id))

    def counters(self):
        st = self.manager.page_allocator.get_page_state()
        in_use, reserved = int(st["inuse_pages"]), int(st["reserved_pages"])
        return Counters(in_use * self.bundle_bytes, (in_use + reserved) * self.bundle_bytes,
                        (in_use + reserved) * self.bundle_bytes)

    def drop(self):
        self.manager.trim()

    def touch(self, seq_id, pos):
        b, off = self.blocks[seq_id][pos // KVCACHED_BLOCK_TOKENS], pos % KVCACHED_BLOCK_TOKENS
        ok = True
        for layer in (0, self.spec.num_layers - 1):
            for kv in (0, 1):
                x = _rand_rows(self.spec, 1, 17 * pos + 2 * layer + kv)[0]
                self.views[layer][kv, b, off] = x
                ok = ok and bool((self.views[layer][kv, b, off] == x).all())
        return ok

    def info(self):
        import kvcached.utils as ku

        return {"version": self.version, "block_tokens": KVCACHED_BLOCK_TOKENS, "num_blocks": self.num_blocks,
                "page_size_bytes": self.manager.page_size, "compound_page_bytes": self.bundle_bytes,
                "contiguous_layout": ku.CONTIGUOUS_LAYOUT, "prealloc": ku.PAGE_PREALLOC_ENABLED,
                "min_reserved_pages": ku.MIN_RESERVED_PAGES, "max_reserved_pages": ku.MAX_RESERVED_PAGES}

    def close(self):
        self.manager.shutdown()
        self.kvi.shutdown_kvcached()


@dataclass(frozen=True)
class AllocatorEntry:
    make: object                    # (BenchConfig) -> AllocatorAdapter
    module: str | None = None       # peer package whose absence skips it
    env: dict = field(default_factory=dict)   # environment of its worker process


ALLOCATORS: dict[str, AllocatorEntry] = {
    "vmem": AllocatorEntry(lambda c: VMemAdapter(c, "megacache")),
    "vmem-per_layer": AllocatorEntry(lambda c: VMemAdapter(c, "per_layer")),
    # every page created up front, as vAttention's pool (no elastic shrink)
    "vmem-prealloc": AllocatorEntry(lambda c: VMemAdapter(c, "megacache", preallocate=True)),
    "vattention": AllocatorEntry(lambda c: VAttentionAdapter(c, megacache=False), "vattention"),
    "vattention-megacache": AllocatorEntry(lambda c: VAttentionAdapter(c, megacache=True), "vattention"),
    "kvcached": AllocatorEntry(KvcachedAdapter, "kvcached"),
    "kvcached-sync": AllocatorEntry(KvcachedAdapter, "kvcached", {"KVCACHED_PAGE_PREALLOC_ENABLED": "false"}),
}
DEFAULT_ALLOCATORS = ("vmem", "vattention", "kvcached", "vmem-per_layer", "vattention-megacache", "kvcached-sync")


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


# ---------------------------------------------------------------------------------------- runner
def _pct(xs, q: float):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else None


def _summary(us: list[float]) -> dict:
    return {"num": len(us), "p50_us": _pct(us, 50), "p99_us": _pct(us, 99),
            "max_us": max(us) if us else None, "total_ms": sum(us) / 1e3}


class _Device:
    """Device bytes in use (``mem_get_info``) less a baseline; None on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.torch = None
        if cuda:
            import torch

            self.torch = torch
            torch.cuda.synchronize()
        self.base = self.used()

    def used(self) -> int | None:
        if self.torch is None:
            return None
        free, total = self.torch.cuda.mem_get_info()
        return total - free

    def delta(self) -> int | None:
        used = self.used()
        return None if used is None else used - self.base


def _snapshot(a: AllocatorAdapter, dev: _Device) -> dict:
    c = a.counters()
    return {**asdict(c), "device_bytes": dev.delta()}


def _admissions(a: AllocatorAdapter, cfg: TraceConfig, cold: bool, first_id: int) -> tuple[list, list, bool]:
    us, new_bytes, ok = [], [], True
    for rep in range(cfg.admit_reps):
        if cold:
            a.drop()
        before = a.counters().in_use_bytes
        t0 = time.perf_counter_ns()
        a.admit(first_id + rep, cfg.admit_len)
        us.append((time.perf_counter_ns() - t0) / 1e3)
        new_bytes.append(a.counters().in_use_bytes - before)
        if rep in (0, cfg.admit_reps - 1):
            ok = a.touch(first_id + rep, cfg.admit_len - 1) and ok
        a.free(first_id + rep)
    return us, new_bytes, ok


def run_allocator(name: str, bench: BenchConfig, cfg: TraceConfig) -> dict:
    """Run the trace, then the admissions, on allocator ``name`` in this process; returns its result."""
    steps = make_trace(cfg)
    dev = _Device(bench.device.startswith("cuda"))
    t0 = time.perf_counter_ns()
    a = ALLOCATORS[name].make(bench)
    init_ms = (time.perf_counter_ns() - t0) / 1e6
    try:
        out = {"allocator": name, "status": "ok", "label": a.name, "trace_digest": trace_digest(steps),
               "init_ms": init_ms, "memory": {"after_init": _snapshot(a, dev)}}
        a.admit(-1, 16)                 # warm-up (kvcached finishes its set-up on the first call)
        a.free(-1)
        time.sleep(bench.idle_s)
        grow_us, boundary_us, boundary_bytes, mapped_calls = [], [], [], 0
        other_us: dict[str, list[float]] = {ADMIT: [], FREE: [], "between_steps": []}
        touch_ok, peak_held, peak_dev = True, 0, 0
        prev = a.counters()
        for step in steps:
            for op, seq, n in step:
                t0 = time.perf_counter_ns()
                if op == GROW:
                    a.grow(seq, n)
                elif op == ADMIT:
                    a.admit(seq, n)
                else:
                    if seq == 0:
                        touch_ok = a.touch(seq, 0) and touch_ok
                        t0 = time.perf_counter_ns()
                    a.free(seq)
                dt_us = (time.perf_counter_ns() - t0) / 1e3
                c = a.counters()
                if op == GROW:
                    grow_us.append(dt_us)
                    if c.in_use_bytes > prev.in_use_bytes:
                        boundary_us.append(dt_us)
                        boundary_bytes.append(c.in_use_bytes - prev.in_use_bytes)
                        mapped_calls += c.mapped_bytes > prev.mapped_bytes
                else:
                    other_us[op].append(dt_us)
                prev = c
            t0 = time.perf_counter_ns()
            a.between_steps()
            other_us["between_steps"].append((time.perf_counter_ns() - t0) / 1e3)
            prev = a.counters()
            peak_held = max(peak_held, prev.held_bytes)
            peak_dev = max(peak_dev, dev.delta() or 0)
        mem = out["memory"]
        mem["peak"] = {"held_bytes": peak_held, "device_bytes": None if dev.torch is None else peak_dev}
        mem["after_burst"] = _snapshot(a, dev)
        time.sleep(bench.idle_s)
        a.idle()
        mem["after_idle"] = _snapshot(a, dev)
        warm_us, warm_bytes, ok_w = _admissions(a, cfg, cold=False, first_id=10_000)
        a.drop()
        mem["after_drop"] = _snapshot(a, dev)
        cold_us, cold_bytes, ok_c = _admissions(a, cfg, cold=True, first_id=20_000)
        per_2mib = [t / (b / MIB2) for t, b in zip(boundary_us, boundary_bytes)]
        out.update({
            "grow": {**_summary(grow_us), "num_boundary_calls": len(boundary_us),
                     "num_calls_that_mapped": mapped_calls, "boundary": _summary(boundary_us),
                     "per_2MiB": _summary(per_2mib)},
            "admit_in_trace": _summary(other_us[ADMIT]), "free": _summary(other_us[FREE]),
            "between_steps": _summary(other_us["between_steps"]),
            # warm: the first admission follows the idle phase, so the warm figures use the rest
            "admit_warm": {**_summary(warm_us[1:] or warm_us), "first_us": warm_us[0]},
            "admit_cold": _summary(cold_us),
            "touch_ok": touch_ok and ok_w and ok_c,
            "info": a.info(),
            "samples": {"boundary_us": [round(x, 2) for x in boundary_us], "boundary_bytes": boundary_bytes,
                        "admit_warm_us": [round(x, 2) for x in warm_us], "admit_warm_bytes": warm_bytes,
                        "admit_cold_us": [round(x, 2) for x in cold_us], "admit_cold_bytes": cold_bytes},
        })
        return out
    finally:
        try:
            a.close()
        except Exception:  # noqa: BLE001 - the results are complete; closing is best effort
            logger.exception("%s: close failed", name)


def _worker(args) -> int:
    conf = json.loads(Path(args.config).read_text())
    bench = BenchConfig(**conf["bench"])
    cfg = TraceConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in conf["trace"].items()})
    try:
        result = run_allocator(args.worker, bench, cfg)
    except PeerUnavailableError as e:
        logger.info("alloc_peers: %s skipped: %s", args.worker, e)
        result = {"allocator": args.worker, "status": "skipped", "reason": str(e)}
    report.write_json(args.result, result)
    return 0


def run_in_subprocess(name: str, config_path: Path, workdir: Path, timeout_s: float) -> dict:
    """One allocator in its own process (its ``env`` added); a crash or timeout is recorded as failed."""
    result = workdir / f"{name}.{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "vmkv.compare.alloc_peers", "--worker", name, "--config", str(config_path),
           "--result", str(result)]
    env = {**os.environ, **ALLOCATORS[name].env, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", str(e.stdout or "")[-1500:] + str(e.stderr or "")[-1500:]
    wall_s = time.monotonic() - t0
    if result.exists():
        out = json.loads(result.read_text())
        out.update(worker_rc=rc, worker_wall_s=wall_s)
        if rc != 0:
            out["worker_output_tail"] = tail
        return out
    logger.warning("alloc_peers: %s failed (exit %s):\n%s", name, rc, tail)
    return {"allocator": name, "status": "failed", "error": f"exit {rc}", "worker_output_tail": tail,
            "worker_wall_s": wall_s}


def run_all(names: list[str], bench: BenchConfig, cfg: TraceConfig, *, in_process: bool = False,
            timeout_s: float = 300.0, deadline_s: float | None = None) -> list[dict]:
    """Every allocator of ``names`` in order (repeats allowed); skipped, failed and not-run ones recorded."""
    t_end = None if deadline_s is None else time.monotonic() + deadline_s
    results = []
    with tempfile.TemporaryDirectory(prefix="alloc_peers_") as tmp:
        config_path = Path(tmp) / "config.json"
        config_path.write_text(json.dumps({"bench": asdict(bench), "trace": asdict(cfg)}))
        for name in names:
            reason = missing_reason(name, bench.device)
            if reason is not None:
                logger.info("alloc_peers: %s skipped: %s", name, reason)
                results.append({"allocator": name, "status": "skipped", "reason": reason})
            elif t_end is not None and time.monotonic() > t_end:
                results.append({"allocator": name, "status": "not_run", "reason": "--deadline-s passed"})
            elif in_process:
                try:
                    results.append(run_allocator(name, bench, cfg))
                except PeerUnavailableError as e:
                    logger.info("alloc_peers: %s skipped: %s", name, e)
                    results.append({"allocator": name, "status": "skipped", "reason": str(e)})
            else:
                results.append(run_in_subprocess(name, config_path, Path(tmp), timeout_s))
    return results


# ---------------------------------------------------------------------------------------- report
def columns(admit_len: int = TraceConfig.admit_len) -> list[str]:
    return ["allocator", "boundary calls", "map call p50/p99 us", "per 2 MiB p50/p99 us", "map / grow total ms",
            f"admit {admit_len} warm p50 ms", f"admit {admit_len} cold p50/max ms", "peak held",
            "after burst held / device", "after idle held / device", "after drop held / device"]


def _pair(d: dict | None, a: str, b: str, scale: float = 1.0, digits: int = 1) -> str:
    if not d or d.get(a) is None:
        return "-"
    second = d[b] / scale if d.get(b) is not None else None
    return f"{report.fmt_num(d[a] / scale, digits)} / {report.fmt_num(second, digits)}"


def _mem(m: dict) -> str:
    return f"{report.fmt_bytes(m.get('held_bytes'))} / {report.fmt_bytes(m.get('device_bytes'))}"


def rows(results: list[dict]) -> list[list[str]]:
    out = []
    for r in results:
        if r["status"] != "ok":
            out.append([r["allocator"], r["status"]] + ["-"] * 9)
            continue
        g, m = r["grow"], r["memory"]
        out.append([r["allocator"], str(g["num_boundary_calls"]), _pair(g["boundary"], "p50_us", "p99_us"),
                    _pair(g["per_2MiB"], "p50_us", "p99_us", digits=2),
                    f"{report.fmt_num(g['boundary']['total_ms'], 1)} / {report.fmt_num(g['total_ms'], 1)}",
                    report.fmt_num(r["admit_warm"]["p50_us"] / 1e3, 3),
                    _pair(r["admit_cold"], "p50_us", "max_us", 1e3, 3), report.fmt_bytes(m["peak"]["held_bytes"]),
                    _mem(m["after_burst"]), _mem(m["after_idle"]), _mem(m["after_drop"])])
    return out


def write_report(out: Path, payload: dict) -> None:
    report.write_json(out / "alloc_peers.json", payload)
    env, tr = payload["environment"], payload["trace"]
    title = (f"{payload['bench']['model']} KV ({report.fmt_bytes(payload['bytes_per_token'])}/token), "
             f"{tr['num_seqs']} seqs, prompt {tr['prompt_len'][0]}..{tr['prompt_len'][1]} -> final "
             f"{tr['final_len'][0]}..{tr['final_len'][1]} by {tr['decode_tokens']}, seed {tr['seed']}, "
             f"cap {report.fmt_bytes(payload['bench']['kv_memory_bytes'])}; trace {payload['trace_digest']}")
    md = [f"# Allocator peers: {payload['bench']['model']}", "", f"Command: `{env['command']}`", "",
          f"Commit {env.get('git_commit')}; GPUs {env.get('gpus')}; torch {env.get('torch')}; "
          f"peers: {payload.get('peer_sources') or '-'}", "", title, "",
          report.markdown_table(columns(tr["admit_len"]), rows(payload["results"])), ""]
    md += [f"- {r['allocator']}: {r['status']}: {r.get('reason') or r.get('error')}"
           for r in payload["results"] if r["status"] != "ok"]
    (out / "alloc_peers.md").write_text("\n".join(md) + "\n")


def _peer_sources(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--peer-source must be NAME=TEXT, got {item!r}")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m vmkv.compare.alloc_peers", description=__doc__.splitlines()[0])
    p.add_argument("--out", help="directory for alloc_peers.json and alloc_peers.md")
    p.add_argument("--allocators", default=",".join(DEFAULT_ALLOCATORS),
                   help=f"comma-separated, in run order, repeats allowed; of {', '.join(ALLOCATORS)}")
    p.add_argument("--model", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default=None, help="KV dtype (default: the shape's)")
    p.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (auto: cuda when available)")
    p.add_argument("--kv-memory", type=parse_size, default=20 << 30, help="KV memory cap of every allocator")
    p.add_argument("--num-seqs", type=int, default=TraceConfig.num_seqs)
    p.add_argument("--prompt-len", type=_int_range, default=TraceConfig.prompt_len, help="A..B tokens")
    p.add_argument("--final-len", type=_int_range, default=TraceConfig.final_len, help="A..B tokens")
    p.add_argument("--decode-tokens", type=int, default=TraceConfig.decode_tokens)
    p.add_argument("--admit-len", type=int, default=TraceConfig.admit_len)
    p.add_argument("--admit-reps", type=int, default=TraceConfig.admit_reps)
    p.add_argument("--seed", type=int, default=TraceConfig.seed)
    p.add_argument("--vmem-page-size", type=parse_size, default=None, help="vmem page size (default: driver's)")
    p.add_argument("--vmem-reserve", type=parse_size, default=None,
                   help="vmem kv_reserve_bytes (default: the option's)")
    p.add_argument("--idle-s", type=float, default=BenchConfig.idle_s, help="idle seconds after the burst")
    p.add_argument("--in-process", action="store_true", help="run every allocator in this process (tests)")
    p.add_argument("--worker-timeout-s", type=float, default=300.0)
    p.add_argument("--deadline-s", type=float, default=None, help="start no allocator after this many seconds")
    p.add_argument("--peer-source", action="append", default=[], help="NAME=TEXT recorded in the results")
    p.add_argument("--commit", default=None, help="commit to record when the tree has no .git")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.worker:
        return _worker(args)
    if not args.out:
        p.error("--out is required")
    names = [n for n in args.allocators.split(",") if n]
    unknown = sorted(set(names) - set(ALLOCATORS))
    if unknown:
        p.error(f"unknown allocator(s) {unknown}; choose from {list(ALLOCATORS)}")
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        cfg = TraceConfig(num_seqs=args.num_seqs, prompt_len=args.prompt_len, final_len=args.final_len,
                          decode_tokens=args.decode_tokens, admit_len=args.admit_len, admit_reps=args.admit_reps,
                          seed=args.seed)
    except ValueError as e:
        p.error(str(e))
    bench = BenchConfig(model=args.model, dtype=args.dtype, device=device, kv_memory_bytes=args.kv_memory,
                        max_num_seqs=cfg.num_seqs + 1, max_model_len=cfg.max_len,
                        vmem_page_size_bytes=args.vmem_page_size, vmem_reserve_bytes=args.vmem_reserve,
                        idle_s=args.idle_s)
    env = report.environment(["python3", "-m", "vmkv.compare.alloc_peers",
                              *(sys.argv[1:] if argv is None else argv)], seed=args.seed)
    if args.commit:
        env["git_commit"] = args.commit
    results = run_all(names, bench, cfg, in_process=args.in_process, timeout_s=args.worker_timeout_s,
                      deadline_s=args.deadline_s)
    payload = {"kind": "alloc_peers", "environment": env, "bench": asdict(bench), "trace": asdict(cfg),
               "trace_digest": trace_digest(make_trace(cfg)), "bytes_per_token": bench.spec().bytes_per_token,
               "peer_sources": _peer_sources(args.peer_source), "results": results}
    out = Path(args.out)
    write_report(out, payload)
    console = report.console()
    console.print(report.make_table(f"allocator peers ({device})", columns(cfg.admit_len), rows(results)))
    console.print(f"wrote {out}/alloc_peers.json, alloc_peers.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
