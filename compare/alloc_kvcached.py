"""kvcached as an allocator peer (``vmkv.compare.alloc_peers``): its ``KVCacheManager`` through the vLLM
integration; skipped when ``kvcached`` is not installed."""

from __future__ import annotations

import time

from vmkv.compare.alloc_adapters import (AllocatorAdapter, BenchConfig, Counters, PeerUnavailableError,
                                         device_index, rand_rows)

#: kvcached's block size in tokens (vLLM's default)
KVCACHED_BLOCK_TOKENS = 16


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
        dev_index = device_index(s)
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
                x = rand_rows(self.spec, 1, 17 * pos + 2 * layer + kv)[0]
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
