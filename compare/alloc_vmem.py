"""vmem as an allocator peer (``vmkv.compare.alloc_peers``): the public ``create_kv_cache("vmem", ...)``
interface, default options but those an allocator entry sets (the layout; ``preallocate`` for
``vmem-prealloc``, the page size for ``vmem-32MiB``): any ``VMemOptions`` field, passed through.

Between steps the adapter makes the engine's calls: ``release_idle`` (which also keeps the page reserve
created ahead of need), and, for ``vmem-prefetch``, first ``prefetch`` of every growing sequence's next
``DEFAULT_CUDA_PREFETCH_TOKENS`` positions, as the engine's runner does while the forward runs (kvcached's
prealloc thread does the same work off its allocation calls).  The prefetch calls are timed apart and
reported (``info()["prefetch"]``, and next to the map total in the table: :func:`prefetch_note`), so the
work moved off the timed grow calls stays visible.
"""

from __future__ import annotations

import time

import numpy as np

from vmkv.compare import report
from vmkv.compare.alloc_adapters import AllocatorAdapter, BenchConfig, Counters, admission_phase, rand_rows
from vmkv.engine.config import DEFAULT_CUDA_PREFETCH_TOKENS

__all__ = ["VMemAdapter", "admit_prefetch_note", "prefetch_note", "DEFAULT_CUDA_PREFETCH_TOKENS"]


def prefetch_note(result: dict) -> str:
    """`` + N prefetch`` (ms the between-steps ``prefetch`` calls took) for a result whose adapter made
    them, else ``""``: the table shows it next to the map / grow totals."""
    pf = (result.get("info") or {}).get("prefetch")
    return f" + {report.fmt_num(pf['total_ms'], 1)} prefetch" if pf and pf["num_calls"] else ""


def admit_prefetch_note(result: dict, phase: str) -> str:
    """`` + N prefetch`` (p50 ms of the ``prefetch_admission`` calls before the ``phase`` admissions,
    "warm" or "cold", over the same admissions as the figure it is shown beside: warm without the first)
    for a result whose adapter made them, else ``""``."""
    pf = ((result.get("info") or {}).get("admit_prefetch") or {}).get(phase)
    return f" + {report.fmt_num(pf['p50_us'] / 1e3, 3)} prefetch" if pf and pf["num_calls"] else ""


def _summary_us(us: list[float]) -> dict:
    a = np.asarray(us, dtype=np.float64)
    return {"num_calls": int(a.size), "total_ms": float(a.sum()) / 1e3,
            "p50_us": float(np.percentile(a, 50)) if a.size else None,
            "p99_us": float(np.percentile(a, 99)) if a.size else None}


def _name_note(options: dict, prefetch_tokens: int) -> str:
    """``", preallocate, prefetch 16, 32.00 MiB pages"``: what an adapter's name says about its options
    (layout, driver and reserve aside)."""
    out = ", preallocate" if options.get("preallocate") else ""
    out += f", prefetch {prefetch_tokens}" if prefetch_tokens else ""
    out += f", {report.fmt_bytes(options['page_size_bytes'])} pages" if options.get("page_size_bytes") else ""
    for k, v in options.items():
        if k not in ("layout", "driver", "preallocate", "page_size_bytes", "kv_reserve_bytes"):
            out += f", {k}={v}"
    return out


class VMemAdapter(AllocatorAdapter):
    """vmem through the public interface (``create_kv_cache("vmem", ...)``), default options but the layout
    and ``options``.

    Args:
        layout: the vmem layout.
        prefetch_tokens: > 0: between steps, ``prefetch`` this many positions past every live sequence's
            length before ``release_idle`` (the engine's order), and before every admission
            ``prefetch_admission`` of its prompt length, both timed apart.
        **options: further ``VMemOptions`` fields (``preallocate``, ``page_size_bytes``; a field added to
            the options class is accepted here as it is); ``page_size_bytes`` defaults to
            ``cfg.vmem_page_size_bytes``, ``kv_reserve_bytes`` to ``cfg.vmem_reserve_bytes``, ``driver``
            to ``host`` off CUDA.
    Raises:
        ValueError: an option the vmem backend does not have, or out of range.
    """

    def __init__(self, cfg: BenchConfig, layout: str, prefetch_tokens: int = 0, **options) -> None:
        from vmkv.kvcache import backend_options_class, create_kv_cache

        self.spec = cfg.spec()
        options = {"layout": layout, **{k: v for k, v in options.items() if v is not None}}
        if not self.spec.is_cuda:
            options.setdefault("driver", "host")
        if cfg.vmem_page_size_bytes:
            options.setdefault("page_size_bytes", cfg.vmem_page_size_bytes)
        if cfg.vmem_reserve_bytes is not None:
            options.setdefault("kv_reserve_bytes", cfg.vmem_reserve_bytes)
        opts = backend_options_class("vmem")(**options)
        self.name = f"vmem ({layout}{_name_note(options, prefetch_tokens)})"
        self.prefetch_tokens, self.prefetch_us = prefetch_tokens, []
        self.admit_prefetch_us: dict[str, list[float]] = {"trace": [], "warm": [], "cold": []}
        self.grace_s = opts.kv_shrink_grace_s
        self.cache = create_kv_cache("vmem", self.spec, max_num_seqs=cfg.max_num_seqs,
                                     max_model_len=cfg.max_model_len, memory_bytes=cfg.kv_memory_bytes,
                                     options=opts)
        self.lens: dict[int, int] = {}
        self._clock_offset_s = 0.0

    def admit(self, seq_id, num_tokens):
        self.cache.allocate(seq_id, num_tokens)
        self.lens[seq_id] = num_tokens

    def before_admit(self, seq_id, num_tokens):
        if self.prefetch_tokens:         # the engine maps an expected admission while the forward runs
            phase = admission_phase(seq_id)
            t0 = time.perf_counter_ns()
            self.cache.prefetch_admission([num_tokens])
            self.admit_prefetch_us[phase].append((time.perf_counter_ns() - t0) / 1e3)

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
            k, v = rand_rows(self.spec, 1, 17 * pos + layer), rand_rows(self.spec, 1, 31 * pos + layer)
            self.cache.write(seq_id, layer, pos, k, v)
            gk, gv = self.cache.gather(seq_id, layer)
            ok = ok and bool((gk[pos] == k[0]).all()) and bool((gv[pos] == v[0]).all())
        return ok

    def _release(self) -> None:
        # the engine's call between steps; the clock it is given is advanced only by idle()/drop()
        self.cache.release_idle(now=time.monotonic() + self._clock_offset_s)

    def between_steps(self):
        if self.prefetch_tokens:         # the engine prefetches while the forward runs, then releases
            t0 = time.perf_counter_ns()
            self.cache.prefetch(list(self.lens), self.prefetch_tokens)
            self.prefetch_us.append((time.perf_counter_ns() - t0) / 1e3)
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
                "num_pages_created", "num_released_pages", "num_topped_up_pages", "num_prefetched_pages",
                "max_span_pages", "num_spans_created", "num_span_pages", "num_released_span_pages",
                "num_span_copies")
        prefetch = {"tokens": self.prefetch_tokens, **_summary_us(self.prefetch_us)}
        admit_prefetch = {k: _summary_us(v) for k, v in self.admit_prefetch_us.items()}
        # as the runner's admit_warm: the first warm admission follows the idle phase, so the warm figures
        # (shown beside the warm admission's p50) are over the rest, the first kept apart
        warm = self.admit_prefetch_us["warm"]
        admit_prefetch["warm"] = {**_summary_us(warm[1:] or warm), "first_us": warm[0] if warm else None}
        return {"kv_shrink_grace_s": self.grace_s, **{k: s.get(k) for k in keys}, "prefetch": prefetch,
                "admit_prefetch": admit_prefetch}

    def close(self):
        self.cache.close()
