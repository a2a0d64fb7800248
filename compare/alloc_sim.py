"""Allocator simulation without a GPU: how much KV memory each scheme allocates for given lengths.

For sequences of final lengths ``T`` (prompt + output tokens) and a model shape, every scheme is exact
integer arithmetic over :class:`vmkv.kvcache.KVCacheSpec` (BENCHMARKS.md, "The accounting identities"):

- **paged** (PagedAttention, Kwon et al. SOSP 2023, section 4.2): blocks of ``B`` tokens of all layers;
  a sequence holds ``ceil(T / B)`` blocks and wastes ``B * ceil(T / B) - T`` tokens (in [0, B - 1];
  mean (B - 1) / 2 for T uniform on 1..B*k).
- **vmem megacache**: one contiguous slot ``[max_model_len][layers][2][H][D]``; pages of ``P`` bytes back
  its first ``ceil(T * bytes_per_token / P)`` pages.  When ``P`` is a multiple of bytes_per_token this is
  the paged formula with ``B = P / bytes_per_token`` (Llama-3-8B bf16, 2 MiB: 16 tokens per page).
- **vmem per_layer** (vAttention, Prabhu et al. ASPLOS 2025, section 5): ``2 * layers`` reservations
  ``[slots, max_model_len, H, D]``, each backed separately: ``ceil(T * H * D * dtype_bytes / P)`` pages per
  reservation (Llama-3-8B bf16, 2 MiB: 1024 tokens per page, 64 pages per growth step).
- **reservation** (the static baseline of Orca / FasterTransformer): every sequence reserves the maximum
  length ``M`` and wastes ``M - T`` tokens.

Waste % is waste / allocated (as :attr:`vmkv.kvcache.CacheUsage.waste_pct`).  ``seqs_in_budget`` is how
many sequences of the sample's mean allocation fit a memory budget: ``floor(budget / mean allocated)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from vmkv.kvcache import KVCacheSpec
from vmkv.kvcache.registry import backend_options_class

__all__ = [
    "SchemeResult",
    "tail_waste_tokens",
    "units_needed",
    "simulate_paged",
    "simulate_vmem",
    "simulate_reservation",
    "sweep",
    "DEFAULT_BLOCK_SIZES",
    "DEFAULT_PAGE_SIZES",
]

DEFAULT_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: 4 KiB (host pages), 64/128/256 KiB (vAttention's patched driver), 2 MiB (the CUDA VMM granularity)
DEFAULT_PAGE_SIZES = (4 << 10, 64 << 10, 128 << 10, 256 << 10, 2 << 20)
#: the vmem backend's layouts (its options module owns the list)
LAYOUTS = backend_options_class("vmem").field_choices("layout")


def units_needed(num_tokens: int | np.ndarray, unit_tokens: int) -> int | np.ndarray:
    """``ceil(num_tokens / unit_tokens)``: blocks (or pages) holding ``num_tokens`` tokens."""
    if unit_tokens <= 0:
        raise ValueError(f"unit_tokens must be > 0, got {unit_tokens}")
    return -(-num_tokens // unit_tokens)


def tail_waste_tokens(num_tokens: int | np.ndarray, unit_tokens: int) -> int | np.ndarray:
    """``unit * ceil(T / unit) - T``: unused token positions of the last unit, in [0, unit - 1]."""
    return unit_tokens * units_needed(num_tokens, unit_tokens) - num_tokens


@dataclass(frozen=True)
class SchemeResult:
    """One scheme at one unit size over a sample of sequence lengths.

    Attributes:
        scheme: ``paged``, ``vmem-megacache``, ``vmem-per_layer`` or ``reservation``.
        unit_bytes: bytes of one allocation unit (a block of all layers, a page, or a max-length slot).
        tokens_per_unit: tokens one unit holds (fractional when a page holds part of a token).
        block_size: paged block size in tokens (0 otherwise); page_size_bytes: vmem page (0 otherwise).
        num_seqs: sequences simulated.
        used_bytes: ``sum(T) * bytes_per_token``.
        allocated_bytes: bytes of all units held.
        waste_bytes: ``allocated - used``.
        units_total: blocks / pages / reservations held.
        units_per_seq_mean: mean units per sequence (map calls per sequence for vmem).
        mean_tail_waste_tokens: mean waste per sequence in token-equivalents (``waste / bytes_per_token``).
        max_tail_waste_tokens: the largest per-sequence waste in token-equivalents.
        seqs_in_budget: ``floor(memory_bytes / mean allocated bytes per sequence)`` (0 without budget).
        bytes_per_token: KV bytes of one token over all layers (from the spec).
    """

    scheme: str
    unit_bytes: int
    tokens_per_unit: float
    block_size: int
    page_size_bytes: int
    num_seqs: int
    used_bytes: int
    allocated_bytes: int
    waste_bytes: int
    units_total: int
    units_per_seq_mean: float
    mean_tail_waste_tokens: float
    max_tail_waste_tokens: float
    seqs_in_budget: int
    bytes_per_token: int

    @property
    def waste_pct(self) -> float:
        return 100.0 * self.waste_bytes / self.allocated_bytes if self.allocated_bytes else 0.0

    @property
    def used_tokens(self) -> int:
        return self.used_bytes // self.bytes_per_token

    @property
    def bytes_per_used_token(self) -> float:
        """Allocated bytes per token stored (``bytes_per_token`` when nothing is wasted)."""
        return self.allocated_bytes / self.used_tokens

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(waste_pct=self.waste_pct, used_tokens=self.used_tokens,
                 bytes_per_used_token=self.bytes_per_used_token)
        return d


def _lengths(lengths: Sequence[int]) -> np.ndarray:
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("lengths must be a non-empty 1-D sequence of token counts")
    if int(arr.min()) < 1:
        raise ValueError(f"every length must be >= 1 token, got {int(arr.min())}")
    return arr


def _result(scheme: str, spec: KVCacheSpec, lengths: np.ndarray, alloc_per_seq: np.ndarray,
            units_per_seq: np.ndarray, unit_bytes: int, memory_bytes: int, *, block_size: int = 0,
            page_size_bytes: int = 0) -> SchemeResult:
    bpt = spec.bytes_per_token
    used = int(lengths.sum()) * bpt
    allocated = int(alloc_per_seq.sum())
    waste_tok = (alloc_per_seq - lengths * bpt) / bpt
    mean_alloc = allocated / lengths.size
    # a per_layer page holds tokens of one layer's K or V only
    token_bytes = spec.bytes_per_token_per_layer // 2 if scheme == "vmem-per_layer" else bpt
    return SchemeResult(
        scheme=scheme, unit_bytes=int(unit_bytes), tokens_per_unit=unit_bytes / token_bytes,
        block_size=block_size, page_size_bytes=page_size_bytes, num_seqs=int(lengths.size),
        used_bytes=used, allocated_bytes=allocated, waste_bytes=allocated - used,
        units_total=int(units_per_seq.sum()), units_per_seq_mean=float(units_per_seq.mean()),
        mean_tail_waste_tokens=float(waste_tok.mean()), max_tail_waste_tokens=float(waste_tok.max()),
        seqs_in_budget=int(memory_bytes // mean_alloc) if memory_bytes else 0, bytes_per_token=bpt,
    )


def simulate_paged(lengths: Sequence[int], spec: KVCacheSpec, block_size: int,
                   memory_bytes: int = 0) -> SchemeResult:
    """Blocks of ``block_size`` tokens (each of all layers, ``block_size * bytes_per_token`` bytes).

    Raises:
        ValueError: ``block_size <= 0`` or a length < 1.
    """
    arr = _lengths(lengths)
    blocks = units_needed(arr, block_size)
    unit_bytes = spec.kv_bytes(block_size)
    return _result("paged", spec, arr, blocks * unit_bytes, blocks, unit_bytes, memory_bytes,
                   block_size=block_size)


def simulate_vmem(lengths: Sequence[int], spec: KVCacheSpec, page_size_bytes: int,
                  layout: str = "megacache", memory_bytes: int = 0) -> SchemeResult:
    """Pages of ``page_size_bytes`` mapped on demand into a contiguous slot (see module docstring).

    Raises:
        ValueError: unknown layout (allowed: megacache, per_layer), non-positive page size, length < 1.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    if page_size_bytes <= 0:
        raise ValueError(f"page_size_bytes must be > 0, got {page_size_bytes}")
    arr = _lengths(lengths)
    if layout == "megacache":
        pages = units_needed(arr * spec.bytes_per_token, page_size_bytes)
    elif layout != "per_layer":
        raise ValueError(f"no allocation model for the vmem layout {layout!r}; add one to simulate_vmem")
    else:
        per_reservation = units_needed(arr * (spec.bytes_per_token_per_layer // 2), page_size_bytes)
        pages = 2 * spec.num_layers * per_reservation
    return _result(f"vmem-{layout}", spec, arr, pages * page_size_bytes, pages, page_size_bytes,
                   memory_bytes, page_size_bytes=page_size_bytes)


def simulate_reservation(lengths: Sequence[int], spec: KVCacheSpec, max_model_len: int,
                         memory_bytes: int = 0) -> SchemeResult:
    """Each sequence reserves ``max_model_len`` tokens up front; waste ``M - T``.

    Raises:
        ValueError: a length exceeds ``max_model_len``.
    """
    arr = _lengths(lengths)
    if int(arr.max()) > max_model_len:
        raise ValueError(f"a length of {int(arr.max())} exceeds max_model_len={max_model_len}; "
                         "raise --max-model-len or clip the distribution")
    unit_bytes = spec.kv_bytes(max_model_len)
    return _result("reservation", spec, arr, np.full(arr.size, unit_bytes, dtype=np.int64),
                   np.ones(arr.size, dtype=np.int64), unit_bytes, memory_bytes)


def sweep(lengths: Sequence[int], spec: KVCacheSpec, *, block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
          page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES, layouts: Sequence[str] = LAYOUTS,
          max_model_len: int | None = None, memory_bytes: int = 0) -> list[SchemeResult]:
    """Every paged block size, every (layout, page size), and the reservation baseline (if ``max_model_len``)."""
    out = [simulate_paged(lengths, spec, b, memory_bytes) for b in block_sizes]
    out += [simulate_vmem(lengths, spec, p, layout, memory_bytes) for layout in layouts for p in page_sizes]
    if max_model_len:
        out.append(simulate_reservation(lengths, spec, max_model_len, memory_bytes))
    return out
