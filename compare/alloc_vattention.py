"""vAttention as an allocator peer (``vmkv.compare.alloc_peers``): its synchronous API as Sarathi-Serve
drives it, on its CUDA backend (2 MiB pages); skipped when ``vattention`` is not installed."""

from __future__ import annotations

from vmkv.compare.alloc_adapters import (AllocatorAdapter, BenchConfig, Counters, PeerUnavailableError,
                                         device_index, rand_rows)

#: vAttention's page size on its CUDA backend (other sizes need its custom UVM driver)
VATTN_PAGE_BYTES = 2 << 20


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
        dev_index = device_index(s)
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
            x = rand_rows(s, 1, 17 * pos + layer)[0]
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
