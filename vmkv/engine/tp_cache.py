"""``ReplicatedKVCache``: rank 0's view of the KV caches of a tensor-parallel engine.

Each rank holds a KV cache of ``num_kv_heads / N`` heads, built with the same limits, budget share and
options, so the bookkeeping of every rank (which blocks, pages, slots; what is cached, copied, freed)
is the same function of the same calls.  The scheduler runs once, on rank 0, against this proxy: every
state-changing call (:data:`REPLICATED`) runs on rank 0's cache at once and is recorded; the records go
to the other ranks with the next step (:meth:`take_ops`, one message per step), which replay them in
order before that step's forward, so all ranks' caches stay identical in layout.  A call that raises
on rank 0 changed nothing (the interface's contract) and is not recorded.  Reads go to rank 0's cache.

To the engine it is one cache of the whole model: ``spec`` is the full model's (all KV heads), and
``usage()`` counts the bytes of all ranks (rank 0's times ``N``: the ranks hold the same), while the
token counts are everyone's.  ``backend_stats()`` and ``gather()`` are rank 0's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Hashable, Sequence

import torch

from vmkv.kvcache.base import AttentionMetadata, CacheUsage, KVCache, KVCacheSpec, StepSeq

__all__ = ["ReplicatedKVCache", "REPLICATED", "READ_ONLY", "MAX_PENDING_OPS"]

#: the calls every rank replays (what changes a cache's state)
REPLICATED = ("allocate", "extend", "fork", "free", "prepare", "prefetch", "prefetch_admission",
              "release_idle")
#: the calls answered by rank 0's cache alone
READ_ONLY = ("can_allocate", "seq_len", "has_seq", "gather", "usage", "backend_stats", "backend_samples",
             "check_integrity", "write_kv", "attention", "graph_buffer_bytes", "capture_metadata")
#: recorded calls kept for the next step at most; more are sent at once (a long idle spell)
MAX_PENDING_OPS = 256

#: one recorded call: (method name, args, kwargs, rank 0's result to check, or None)
Op = tuple[str, tuple, dict, Any]


class ReplicatedKVCache(KVCache):
    """Rank 0's cache plus the record of the calls the other ranks replay.

    Args:
        inner: rank 0's cache (``num_kv_heads / size`` heads, ``memory_bytes / size`` bytes).
        spec: the whole model's :class:`KVCacheSpec` (what the engine sees).
        size: ranks.
        flush: ``flush(ops)`` sends recorded calls to the other ranks now (no forward).
        shutdown: stops the other ranks (called by :meth:`close`).
        max_num_seqs, max_model_len, memory_bytes: the whole cache's (``memory_bytes``: all ranks).
    """

    def __init__(self, inner: KVCache, spec: KVCacheSpec, size: int, *, flush, shutdown,
                 max_num_seqs: int, max_model_len: int, memory_bytes: int) -> None:
        super().__init__(spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         memory_bytes=memory_bytes)
        self.inner = inner
        self.size = size
        self.backend = inner.backend
        self._flush = flush
        self._shutdown = shutdown
        self._ops: list[Op] = []
        self._closed = False

    def __getattr__(self, name: str):
        # backend attributes (``lookahead_tokens``, ``attention_impl`` ...) are rank 0's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ------------------------------------------------------------------ the record
    def _record(self, name: str, args: tuple, kwargs: dict | None = None, expected: Any = None) -> None:
        self._ops.append((name, args, kwargs or {}, expected))
        if len(self._ops) >= MAX_PENDING_OPS:
            self._flush(self.take_ops())

    def take_ops(self) -> list[Op]:
        """The calls recorded since the last take, oldest first (the record is emptied)."""
        ops, self._ops = self._ops, []
        return ops

    # ------------------------------------------------------------------ replicated calls
    def allocate(self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None = None,
                 extra_key: Hashable = None) -> int:
        num_cached = self.inner.allocate(seq_id, num_tokens, token_ids, extra_key)
        ids = None if token_ids is None else list(token_ids)
        self._record("allocate", (seq_id, num_tokens, ids, extra_key), None, num_cached)
        return num_cached

    def extend(self, seq_id: int, num_tokens: int) -> None:
        self.inner.extend(seq_id, num_tokens)
        self._record("extend", (seq_id, num_tokens))

    def fork(self, parent_id: int, child_id: int) -> None:
        self.inner.fork(parent_id, child_id)
        self._record("fork", (parent_id, child_id))

    def free(self, seq_id: int, *, written: bool = True) -> None:
        self.inner.free(seq_id, written=written)
        self._record("free", (seq_id,), {"written": written})

    def prepare(self, batch: Sequence[StepSeq], *, pad_to: int | None = None,
                out: torch.Tensor | None = None) -> AttentionMetadata:
        """Rank 0's ``prepare(batch)``, recorded: the other ranks prepare the same batch before the
        step's forward.  No CUDA graphs under tensor parallelism (``pad_to``/``out`` refused)."""
        if pad_to is not None or out is not None:
            raise ValueError("prepare(pad_to=, out=) is for CUDA graphs, which tensor parallelism does not "
                             "capture (steps run eagerly)")
        batch = list(batch)
        meta = self.inner.prepare(batch)
        self._record("prepare", (batch,))
        return meta

    def prefetch(self, seq_ids: Sequence[int], num_tokens: int) -> None:
        seq_ids = list(seq_ids)
        self.inner.prefetch(seq_ids, num_tokens)
        self._record("prefetch", (seq_ids, num_tokens))

    def prefetch_admission(self, num_tokens: Sequence[int], token_ids: Sequence | None = None,
                           extra_keys: Sequence | None = None) -> None:
        ids = None if token_ids is None else [None if t is None else list(t) for t in token_ids]
        args = (list(num_tokens), ids, None if extra_keys is None else list(extra_keys))
        self.inner.prefetch_admission(*args)
        self._record("prefetch_admission", args)

    def release_idle(self, now: float | None = None, num_waiting: int = 0) -> int:
        """Rank 0's ``release_idle`` at ``now`` (resolved here, so every rank decides at the same
        time); bytes released over all ranks.  A release is sent to the other ranks at once, so they
        give their memory back when rank 0 does, also while no step runs."""
        now = time.monotonic() if now is None else float(now)
        released = self.inner.release_idle(now, num_waiting)
        self._record("release_idle", (), {"now": now, "num_waiting": num_waiting})
        if released:
            self._flush(self.take_ops())
        return released * self.size

    # ------------------------------------------------------------------ rank 0's answers
    def can_allocate(self, num_tokens: int) -> bool:
        return self.inner.can_allocate(num_tokens)

    def seq_len(self, seq_id: int) -> int:
        return self.inner.seq_len(seq_id)

    def has_seq(self, seq_id: int) -> bool:
        return self.inner.has_seq(seq_id)

    def write(self, seq_id: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError("write() is not replicated across tensor-parallel ranks; K/V are written "
                                  "by each rank's forward (write_kv)")

    def gather(self, seq_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0's K and V of ``seq_id``: ``[seq_len, num_kv_heads / size, head_dim]`` each."""
        return self.inner.gather(seq_id, layer)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        self.inner.write_kv(layer, k, v, meta)

    def attention(self, layer: int, q: torch.Tensor, meta: AttentionMetadata,
                  scale: float | None = None) -> torch.Tensor:
        return self.inner.attention(layer, q, meta, scale=scale)

    def usage(self) -> CacheUsage:
        """Rank 0's usage with every ``*_bytes`` field times ``size`` (the ranks hold the same)."""
        u = self.inner.usage()
        return dataclasses.replace(u, **{f.name: getattr(u, f.name) * self.size
                                         for f in dataclasses.fields(u) if f.name.endswith("_bytes")})

    def backend_stats(self) -> dict:
        return dict(self.inner.backend_stats(), tensor_parallel_size=self.size)

    def backend_samples(self) -> dict[str, list[float]]:
        return self.inner.backend_samples()

    def check_integrity(self) -> None:
        self.inner.check_integrity()

    @property
    def supports_cuda_graphs(self) -> bool:
        return False

    @property
    def wants_admission_hints(self) -> bool:
        return self.inner.wants_admission_hints

    def close(self) -> None:
        """Close rank 0's cache and stop the other ranks (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.inner.close()
        finally:
            self._shutdown()
