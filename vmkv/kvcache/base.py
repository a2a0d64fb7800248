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
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch

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
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
                "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float64": torch.float64}


class KVCacheError(RuntimeError):
    """Base class of the KV-cache errors."""


class KVCacheFullError(KVCacheError):
    """Not enough KV memory for a request.  The cache is left exactly as it was.

    Attributes:
        needed_tokens: token positions the operation needed backed.
        available_tokens: token positions that could still be backed (0 if unknown).
    """

    def __init__(self, needed_tokens: int, available_tokens: int, detail: str = "") -> None:
        self.needed_tokens = int(needed_tokens)
        self.available_tokens = int(available_tokens)
        msg = (
            f"KV cache full: needed {self.needed_tokens} tokens, "
            f"{self.available_tokens} available"
        )
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class UnknownSequenceError(KVCacheError, KeyError):
    """The ``seq_id`` was never allocated or was already freed."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown sequence"


class DuplicateSequenceError(KVCacheError, ValueError):
    """``allocate``/``fork`` was given a ``seq_id`` that is already live."""


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the KV cache of one model; owns all byte arithmetic.

    Args:
        num_layers: decoder layers holding a KV cache (> 0).
        num_kv_heads: KV heads per layer (> 0; query heads are a multiple of it, GQA).
        head_dim: elements per head (> 0).
        dtype: element type of K and V (float32, float16, bfloat16; float64 for tests), a torch dtype
            or a name such as ``"bf16"``.
        device: torch device the KV lives on (``"cpu"`` or ``"cuda"``/``"cuda:N"``).

    Raises:
        ValueError: a field is out of range.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype | str = torch.float32
    device: str = "cpu"

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            if self.dtype not in _DTYPE_NAMES:
                raise ValueError(f"KVCacheSpec.dtype must be one of {sorted(_DTYPE_NAMES)} or a torch "
                                 f"dtype, got {self.dtype!r}")
            object.__setattr__(self, "dtype", _DTYPE_NAMES[self.dtype])
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be a positive int, got {value!r}")
        if self.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(
                f"KVCacheSpec.dtype must be one of {_SUPPORTED_DTYPES}, got {self.dtype!r}"
            )
        # normalise the device to a string so the spec stays hashable and comparable
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"KVCacheSpec.device must be a torch device such as 'cpu' or 'cuda:0', "
                             f"got {self.device!r}") from e
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"KVCacheSpec.device must be a cpu or cuda device, got {self.device!r}")
        object.__setattr__(self, "device", str(device))

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of K or V."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def head_bytes(self) -> int:
        """Bytes of one token's K (or V) for one head: ``head_dim * dtype_bytes``."""
        return self.head_dim * self.dtype_bytes

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K + V bytes of one token in one layer: ``2 * num_kv_heads * head_dim * dtype_bytes``."""
        return 2 * self.num_kv_heads * self.head_bytes

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes of one token over all layers (BENCHMARKS.md: 128 KiB for Llama-3-8B bf16)."""
        return self.num_layers * self.bytes_per_token_per_layer

    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes of K + V for ``num_tokens`` tokens over all layers."""
        return int(num_tokens) * self.bytes_per_token

    def max_tokens_for_bytes(self, memory_bytes: int) -> int:
        """How many whole tokens of KV fit in ``memory_bytes``."""
        return int(memory_bytes) // self.bytes_per_token


@dataclass(frozen=True)
class CacheUsage:
    """A snapshot of a cache's memory.  All ``*_bytes`` count K and V of all layers.

    Attributes:
        num_seqs: live sequences.
        used_tokens: sum of ``seq_len`` over live sequences (logical tokens, shared ones counted
            once per sequence that uses them).
        allocated_bytes: KV memory physically backing sequences now (blocks in use by a live
            sequence; pages mapped into a live slot).  Shared units count once.
        waste_bytes: part of ``allocated_bytes`` that holds no token of any live sequence
            (block or page tails, over-mapped pages).
        capacity_bytes: KV memory the cache may back in total (its budget).
        mapped_bytes: physical memory held by the backend now, including free-but-kept units
            (cached free blocks, pages kept mapped by deferred reclamation).
        reserved_bytes: virtual address space reserved (vmem; equals capacity for paged).
        free_tokens: token positions the free KV memory can still back, pool-wide (free blocks x
            block size; obtainable pages x tokens per page), not capped at ``max_model_len``.  While
            fewer than ``max_num_seqs`` sequences are live, ``can_allocate(n)`` holds for
            ``n <= min(free_tokens, max_model_len)`` (vmem: up to a page tail less when a page
            holds a fractional number of tokens).
        prefix_query_tokens / prefix_hit_tokens: prompt tokens looked up / found in the prefix cache.
        num_cow_copies: copy-on-write copies made so far.
        unit_tokens: tokens per allocation unit (block size, or tokens per page; 0 if fractional).
    """

    num_seqs: int
    used_tokens: int
    allocated_bytes: int
    waste_bytes: int
    capacity_bytes: int
    mapped_bytes: int = 0
    reserved_bytes: int = 0
    free_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_cow_copies: int = 0
    unit_tokens: int = 0

    @property
    def waste_pct(self) -> float:
        return 100.0 * self.waste_bytes / self.allocated_bytes if self.allocated_bytes else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass(frozen=True)
class StepSeq:
    """One sequence scheduled in a step.

    Args:
        seq_id: a live sequence.
        num_computed_tokens: positions ``0..num_computed_tokens-1`` already hold K/V.
        num_new_tokens: this step writes positions ``num_computed_tokens ..
            num_computed_tokens + num_new_tokens - 1`` (the query length; 1 for decode).
    """

    seq_id: int
    num_computed_tokens: int
    num_new_tokens: int


@dataclass
class AttentionMetadata:
    """Built once per step by :meth:`KVCache.prepare`, passed to every layer.

    Common fields (on the cache's device):
        seq_ids: the step's sequences, in batch order (host list).
        query_start_loc: ``int32 [num_seqs + 1]``, cumulative new-token counts (cu_seqlens_q).
        seq_lens: ``int32 [num_seqs]``, context length after this step (computed + new).
        context_lens: ``int32 [num_seqs]``, tokens already cached before this step.
        positions: ``int64 [num_tokens]``, position of every new token.
        slot_mapping: ``int64 [num_tokens]``, flat write index of every new token into the
            ``[dim0, dim1, H, D]`` cache view: ``index0 * dim1 + index1`` (paged: block id and
            offset in block; vmem: slot and position).
        max_query_len, max_seq_len: host ints.
        is_decode: every sequence has exactly one new token.
    Backend fields:
        block_tables: paged: ``int32 [num_seqs, max_blocks_per_seq]`` (padded with 0).
        slot_indices: vmem: ``int32 [num_seqs]``, each sequence's slot.
        last_token_indices: ``int64 [num_seqs]``, index in the step's tokens of each sequence's
            last new token (where logits are read).
    """

    seq_ids: list
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    is_decode: bool
    last_token_indices: torch.Tensor
    block_tables: torch.Tensor | None = None
    slot_indices: torch.Tensor | None = None
    # host copies for reference paths (avoid device syncs)
    seq_lens_host: list = field(default_factory=list)
    query_lens_host: list = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


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
    def prepare(self, batch: Sequence[StepSeq]) -> AttentionMetadata:
        """Build the step's :class:`AttentionMetadata` once on the host (then copy to device).

        Requires ``num_computed_tokens + num_new_tokens <= seq_len`` for every entry.  Marks the
        positions written this step so full units can be registered in the prefix cache.
        """

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
