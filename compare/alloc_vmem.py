"""vmem as an allocator peer (``vmkv.compare.alloc_peers``): the public ``create_kv_cache("vmem", ...)``
interface, default options but the layout (and ``preallocate`` for ``vmem-prealloc``)."""

from __future__ import annotations

import time

from vmkv.compare.alloc_adapters import AllocatorAdapter, BenchConfig, Counters, rand_rows


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
            k, v = rand_rows(self.spec, 1, 17 * pos + layer), rand_rows(self.spec, 1, 31 * pos + layer)
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
