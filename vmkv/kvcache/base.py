"""The KV-cache interface every backend implements (see DESIGN.md, "The KV-cache interface").

Vocabulary: a *sequence* (``seq_id``, any hashable int) owns ``seq_len`` logical token positions
``0..seq_len-1``.  ``allocate``/``extend`` grow that capacity (raising :class:`KVCacheFullError`
when memory is short, changing nothing); ``write``/``write_kv`` store K/V at positions below
``seq_len``.  The paged backend backs positions with **blocks** (``block_size`` tokens); the vmem
backend backs them with **pages** mapped into a per-sequence **slot** of a virtual reservation.

Per engine step (the plan/run split of FlashInfer, the metadata of vLLM v1):

    meta = cache.prepare([StepSeq(seq_id, num_computed_tokens, num_new_tokens), ...])
    for layer in range(num_layers):
        cache.write_kv(layer, k, v, meta)        # k, v: [num_tokens, num_kv_heads, head_dim]
        out = cache.attention(layer, q, meta)    # q: [num_tokens, num_heads, head_dim]
"""

from __future__ import annotations

import abc
from typing import Hashable, Sequence

import torch

from vmkv.kvcache.errors import (
    DuplicateSequenceError,
    KVCacheError,
    KVCacheFullError,
    SlotsExhaustedError,
    TooManySequencesError,
    UnknownSequenceError,
)
from vmkv.kvcache.records import AttentionMetadata, CacheUsage, StepSeq
from vmkv.kvcache.dtypes import AUTO_DTYPE, DTYPE_NAMES, MODEL_DTYPES
from vmkv.kvcache.spec import TORCH_DTYPES, KVCacheSpec, torch_dtype

__all__ = [
    "KVCacheSpec",
    "CacheUsage",
    "StepSeq",
    "AttentionMetadata",
    "KVCache",
    "KVCacheError",
    "KVCacheFullError",
    "UnknownSequenceError",
    "DuplicateSequenceError",
    "TooManySequencesError",
    "SlotsExhaustedError",
    # the dtype names (vmkv.kvcache.dtypes), re-exported for the model layer, which imports only this module
    "DTYPE_NAMES",
    "MODEL_DTYPES",
    "AUTO_DTYPE",
    "TORCH_DTYPES",
    "torch_dtype",
]


class KVCache(abc.ABC):
    """One interface, two backends (``paged`` and ``vmem``).

    Construction goes through :func:`vmkv.kvcache.create_kv_cache`.  Every method raises
    :class:`UnknownSequenceError` for a ``seq_id`` that is not live and ``ValueError`` for
    out-of-range arguments; a method that raises leaves the cache unchanged.
    """

    #: backend name, ``"paged"`` or ``"vmem"``
    backend: str = ""

    def __init__(self, spec: KVCacheSpec, *, max_num_seqs: int, max_model_len: int,
                 memory_bytes: int) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                            ("memory_bytes", memory_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.spec = spec
        self.max_num_seqs = int(max_num_seqs)
        self.max_model_len = int(max_model_len)
        self.memory_bytes = int(memory_bytes)

    # ------------------------------------------------------------------ lifecycle
    @abc.abstractmethod
    def allocate(self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None = None,
                 extra_key: Hashable = None) -> int:
        """Create sequence ``seq_id`` with ``num_tokens`` logical positions backed.

        Args:
            num_tokens: 1..max_model_len.
            token_ids: the prompt's token ids (``len == num_tokens``) to look up and later
                register full units in the prefix cache; ``None`` disables prefix caching.
            extra_key: salt mixed into every unit hash (e.g. a tenant or LoRA id): prefixes with
                different keys never share KV.
        Returns:
            Leading positions whose K/V is already present (prefix-cache hit), a multiple of the
            unit size and always ``< num_tokens`` (the last prompt token is always computed).
        Raises:
            KVCacheFullError, DuplicateSequenceError, ValueError (num_tokens out of range,
            too many sequences).
        """

    @abc.abstractmethod
    def extend(self, seq_id: int, num_tokens: int) -> None:
        """Back ``num_tokens`` more positions of ``seq_id`` (``seq_len += num_tokens``).

        Also copies (copy-on-write) any shared unit that positions ``old seq_len ..`` will be
        written into, so later writes below ``seq_len`` never need memory.

        Raises:
            KVCacheFullError (nothing changed), UnknownSequenceError, ValueError (past max_model_len).
        """

    @abc.abstractmethod
    def fork(self, parent_id: int, child_id: int) -> None:
        """Make ``child_id`` share every position of ``parent_id`` (same ``seq_len``).

        Units are shared by reference count; the first write by either side into a shared unit
        copies it (copy-on-write).  Raises KVCacheFullError if a slot (vmem) is not available.
        """

    @abc.abstractmethod
    def free(self, seq_id: int, *, written: bool = True) -> None:
        """Release ``seq_id``; its memory becomes available to others.

        Args:
            written: ``False`` when the K/V that ``prepare()`` marked written may not have been
                written (the step's forward failed): the prompt units this sequence registered in
                the prefix cache are dropped, so no later request is served them.  Units it found
                there at allocate stay cached.
        Raises:
            UnknownSequenceError.
        """

    @abc.abstractmethod
    def can_allocate(self, num_tokens: int) -> bool:
        """Would ``allocate(new_id, num_tokens)`` succeed now (ignoring prefix hits)?"""

    @abc.abstractmethod
    def seq_len(self, seq_id: int) -> int:
        """Positions backed for ``seq_id``."""

    def prefetch(self, seq_ids: Sequence[int], num_tokens: int) -> None:
        """Hint: positions up to ``seq_len + num_tokens`` of these sequences will be needed soon;
        a backend may back them now (best effort, never raises KVCacheFullError, never changes
        ``seq_len``).  Called by the engine after a step's GPU work is enqueued, so host-side work
        overlaps the GPU.  The default does nothing.

        Args:
            seq_ids: live sequences (unknown ids are ignored).
            num_tokens: look-ahead in positions, >= 0.
        """

    @property
    def wants_admission_hints(self) -> bool:
        """Does :meth:`prefetch_admission` do anything here?  (The engine then skips building its
        arguments, token ids included, on every step; the default and paged: no.)"""
        return False

    def prefetch_admission(self, num_tokens: Sequence[int], token_ids: Sequence | None = None,
                           extra_keys: Sequence | None = None) -> None:
        """Hint: sequences of these prompt lengths (in order) are about to be admitted; a backend may
        prepare their KV memory now (best effort, never raises KVCacheFullError, changes no
        sequence and no prefix-cache statistic).  Called by the engine while a step's forward runs
        on the device, with the waiting requests the next step would admit first.  The default does
        nothing (paged: its static pool needs no preparation).

        Args:
            num_tokens: prompt lengths, each >= 1.
            token_ids: optional, each prompt's token ids (or None), for prefix-cache lookups.
            extra_keys: optional, each prompt's prefix-cache extra key (``allocate``'s ``extra_key``).
        """

    def release_idle(self, now: float | None = None, num_waiting: int = 0) -> int:
        """Give idle KV memory back to the device (elastic shrink), off the critical path: the engine
        calls it between steps and while it idles, never inside allocate/extend.  vmem releases the
        pages beyond its reserve and the high-water mark of demand over its grace period, never while
        requests wait (``kv_reserve_bytes``, ``kv_shrink_grace_s``; vmem's elastic policy); the
        default (paged: a static pool) releases nothing.

        Args:
            now: ``time.monotonic()`` seconds (default: now); tests pass a fake clock.
            num_waiting: requests waiting for admission (the scheduler's queue; 0 when unknown).
        Returns:
            Bytes released (0 by default).
        """
        return 0

    def has_seq(self, seq_id: int) -> bool:
        try:
            self.seq_len(seq_id)
        except UnknownSequenceError:
            return False
        return True

    # ------------------------------------------------------------------ data
    @abc.abstractmethod
    def write(self, seq_id: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of one sequence at positions ``start..start+n-1`` (copying shared units first).

        Args:
            k, v: ``[n, num_kv_heads, head_dim]``, ``spec.dtype`` (cast if another float dtype).
        Raises:
            ValueError: shape mismatch or ``start + n > seq_len``.
        """

    @abc.abstractmethod
    def gather(self, seq_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V of ``seq_id`` in ``layer``: ``[seq_len, num_kv_heads, head_dim]`` each."""

    # ------------------------------------------------------------------ per-step path
    @abc.abstractmethod
    def prepare(self, batch: Sequence[StepSeq], *, pad_to: int | None = None,
                out: torch.Tensor | None = None) -> AttentionMetadata:
        """Build the step's :class:`AttentionMetadata` once on the host (one packed buffer, one
        copy to the device) together with its launch plan.

        Requires ``num_computed_tokens + num_new_tokens <= seq_len`` for every entry.  Marks the
        positions written this step so full units can be registered in the prefix cache.

        Args:
            pad_to: a decode step replayed by a CUDA graph: pad to this many one-token rows.
            out: the graph's static uint8 buffer (:meth:`graph_buffer_bytes`) the metadata is
                copied into, at the addresses the graph was captured with.
        """

    @property
    def supports_cuda_graphs(self) -> bool:
        """Can decode steps be captured in CUDA graphs (CUDA device, Triton attention)?"""
        return False

    def graph_buffer_bytes(self, num_seqs: int) -> int:
        """Bytes of the static metadata buffer of a captured decode step of ``num_seqs`` rows."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def capture_metadata(self, num_seqs: int, out: torch.Tensor) -> AttentionMetadata:
        """Metadata of a decode step of ``num_seqs`` padding rows (no sequence; nothing is read or
        written), laid out in ``out`` exactly as ``prepare(batch, pad_to=num_seqs, out=out)`` will
        lay out a real step: what a CUDA graph is captured with."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    @abc.abstractmethod
    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Scatter the step's new K/V into ``layer``.

        Args:
            k, v: ``[num_tokens, num_kv_heads, head_dim]`` in ``spec.dtype``, token order of ``meta``.
        """

    @abc.abstractmethod
    def attention(self, layer: int, q: torch.Tensor, meta: AttentionMetadata,
                  scale: float | None = None) -> torch.Tensor:
        """Causal attention of the step's queries over each sequence's cached + new K/V.

        Args:
            q: ``[num_tokens, num_heads, head_dim]``, ``num_heads`` a multiple of ``num_kv_heads``.
            scale: softmax scale, default ``head_dim ** -0.5``.
        Returns:
            ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
        """

    # ------------------------------------------------------------------ introspection
    @abc.abstractmethod
    def usage(self) -> CacheUsage:
        """Current :class:`CacheUsage`."""

    def backend_stats(self) -> dict:
        """Backend-specific counters for benchmarks and metrics (JSON-serialisable values): vmem
        reports its map/unmap counts and latencies, paged its block-pool counts.  Default ``{}``."""
        return {}

    def backend_samples(self) -> dict[str, list[float]]:
        """Raw per-event samples behind :meth:`backend_stats`' summaries, oldest first, by name with a
        unit suffix (vmem: ``map_us``, per page, and ``unmap_us``: the most recent of each map and
        unmap).  The ``num_*`` counter of :meth:`backend_stats` counts the events of each list (a list
        may keep only the most recent ones).  Default ``{}`` (a backend that keeps no samples)."""
        return {}

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the numbers if internal counts disagree."""

    def close(self) -> None:
        """Release all memory (idempotent).  The cache is unusable afterwards."""

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ shared helpers
    def _check_kv(self, name: str, t: torch.Tensor, num_tokens: int | None = None) -> None:
        s = self.spec
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [num_tokens, {s.num_kv_heads}, "
                            f"{s.head_dim}], got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor (the cache holds {s.dtype}), "
                             f"got {t.dtype}")
        if t.dim() != 3 or t.shape[1] != s.num_kv_heads or t.shape[2] != s.head_dim:
            raise ValueError(
                f"{name} must be [num_tokens, {s.num_kv_heads}, {s.head_dim}], got {tuple(t.shape)}"
            )
        if num_tokens is not None and t.shape[0] != num_tokens:
            raise ValueError(f"{name} has {t.shape[0]} tokens, metadata has {num_tokens}")

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer must be in [0, {self.spec.num_layers}), got {layer}")
