"""Where K/V of each (slot, position, layer) lives in the virtual reservations, and which pages back it.

Two layouts (DESIGN.md, "vmem backend / Layouts"):

* :class:`MegacacheLayout` (default): one reservation ``[max_num_seqs][slot_stride]``; a slot row is
  ``[max_model_len][num_layers][2][H][D]``, so one page covers all layers of a token range and a
  token-range boundary costs one map.  Per-layer K and V are strided views.
* :class:`PerLayerLayout` (vAttention's original, Prabhu et al., ASPLOS'25, section 5.1):
  ``2 * num_layers`` reservations ``[max_num_seqs, padded_len, H, D]``, each slot row truly
  contiguous per layer; a token-range boundary costs ``2 * num_layers`` maps.

In both, a slot row is rounded up to a whole number of pages (``slot_stride_bytes``) so pages never
straddle slots.  A **unit** is the group of pages at one page index of a slot row, one per
reservation (``pages_per_unit`` = 1 or ``2 * num_layers``): units are what grows a sequence.

Every reservation starts with one **guard page** (``guard_bytes``) before slot 0: the cache maps it
once (``VMMDriver.map_guard``) and never unmaps it, and every kernel launch receives its address
(:meth:`VMemLayout.kv_anchors`) plus the element offset of the per-layer view from it.  A view's own
first element (slot 0, position 0) is unmapped whenever slot 0 holds no page, and Triton's launcher
rejects such a pointer argument ("cannot be accessed from Triton"); the anchor is always backed.

The arithmetic is torch-free (the page bookkeeping uses it without tensors); the view methods take
the tensors the cache made over the reservations.
"""

from __future__ import annotations

import abc
from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from vmkv.kvcache.spec import KVCacheSpec

__all__ = ["VMemLayout", "MegacacheLayout", "PerLayerLayout", "LAYOUTS", "make_layout"]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class VMemLayout(abc.ABC):
    """Byte arithmetic of one vmem layout.

    Args:
        spec: KV shape and dtype.
        max_num_seqs: slots.
        max_model_len: positions per slot.
        page_size_bytes: physical page size (a multiple of the element size).
    """

    name = ""

    def __init__(self, spec: KVCacheSpec, max_num_seqs: int, max_model_len: int,
                 page_size_bytes: int) -> None:
        if page_size_bytes <= 0 or page_size_bytes % spec.dtype_bytes:
            raise ValueError(f"page_size_bytes must be a positive multiple of the element size "
                             f"{spec.dtype_bytes}, got {page_size_bytes}")
        self.spec = spec
        self.max_num_seqs = int(max_num_seqs)
        self.max_model_len = int(max_model_len)
        self.page_size_bytes = int(page_size_bytes)
        self.row_token_bytes = self.token_bytes_in_row(spec)
        self.slot_stride_bytes = _round_up(self.max_model_len * self.row_token_bytes, self.page_size_bytes)
        self.pages_per_slot = self.slot_stride_bytes // self.page_size_bytes
        #: the guard page at the start of every reservation, before slot 0 (module docstring)
        self.guard_bytes = self.page_size_bytes
        self.reservation_bytes = self.guard_bytes + self.max_num_seqs * self.slot_stride_bytes

    # ------------------------------------------------------------------ per layout
    num_reservations: int = 1

    @staticmethod
    @abc.abstractmethod
    def token_bytes_in_row(spec: KVCacheSpec) -> int:
        """Bytes one token occupies in one reservation's slot row."""

    @abc.abstractmethod
    def reservations_for_layer(self, layer: int) -> tuple[int, ...]:
        """Reservations holding ``layer``'s K and V."""

    @abc.abstractmethod
    def kv_views(self, bases: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V views ``[max_num_seqs, max_model_len, H, D]`` of ``spec.dtype``.

        Args:
            bases: one uint8 ``[reservation_bytes]`` tensor per reservation.
        """

    def guard_offsets(self) -> list[int]:
        """Byte offsets, inside every reservation, of the pages to map with ``VMMDriver.map_guard``."""
        return list(range(0, self.guard_bytes, self.page_size_bytes))

    def map_guards(self, driver, base_vas: list[int]) -> None:
        """Map the guard page(s) of every reservation (``VMMDriver.map_guard``), once, at construction;
        they stay mapped until the reservation is freed.

        Args:
            driver: the ``VMMDriver`` that made the reservations.
            base_vas: start address of each reservation.
        """
        for va in base_vas:
            for offset in self.guard_offsets():
                driver.map_guard(va + offset)

    def unbacked_anchors(self, driver, bases: list[torch.Tensor]) -> list[int]:
        """Addresses among :meth:`anchors` that ``driver`` does not back (empty when the invariant
        "every address a kernel launch receives is backed" holds)."""
        return [a.data_ptr() for a in self.anchors(bases) if not driver.is_backed(a.data_ptr())]

    def anchors(self, bases: list[torch.Tensor]) -> list[torch.Tensor]:
        """One element of ``spec.dtype`` at the start of each reservation's guard page: the pointer a
        kernel launch receives for any view of that reservation (1-element tensors)."""
        n = self.spec.dtype_bytes
        return [b[:n].view(self.spec.dtype) for b in bases]

    def kv_anchors(self, bases: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer anchors of the K and V views of :meth:`kv_views` (the guard of the reservation
        each view lies in); pass them to ``vmkv.kernels.ops`` as ``key_anchor`` / ``value_anchor``."""
        anchors = self.anchors(bases)
        num_layers = self.spec.num_layers
        keys = [anchors[self.reservations_for_layer(layer)[0]] for layer in range(num_layers)]
        values = [anchors[self.reservations_for_layer(layer)[-1]] for layer in range(num_layers)]
        return keys, values

    def key_view(self, bases: list[torch.Tensor], layer: int) -> torch.Tensor:
        """K of ``layer``: ``[max_num_seqs, max_model_len, H, D]`` view of ``spec.dtype`` over ``bases``."""
        return self.kv_views(bases)[0][layer]

    def value_view(self, bases: list[torch.Tensor], layer: int) -> torch.Tensor:
        """V of ``layer``: ``[max_num_seqs, max_model_len, H, D]`` view of ``spec.dtype`` over ``bases``."""
        return self.kv_views(bases)[1][layer]

    # ------------------------------------------------------------------ shared arithmetic
    @property
    def pages_per_unit(self) -> int:
        """Physical pages mapped per token-range boundary (one per reservation)."""
        return self.num_reservations

    @property
    def tokens_per_page(self) -> Fraction:
        """Tokens (of every layer) one unit holds; may be fractional."""
        return Fraction(self.page_size_bytes, self.row_token_bytes)

    @property
    def unit_tokens(self) -> int:
        """Tokens per unit if integral, else 0 (prefix caching needs whole tokens per page)."""
        tpp = self.tokens_per_page
        return int(tpp) if tpp.denominator == 1 else 0

    @property
    def bytes_per_unit(self) -> int:
        return self.page_size_bytes * self.pages_per_unit

    def num_units(self, num_tokens: int) -> int:
        """Units that must be mapped to back positions ``[0, num_tokens)`` of a slot."""
        return -(-int(num_tokens) * self.row_token_bytes // self.page_size_bytes)

    def units_overlapping(self, start: int, end: int) -> range:
        """Units holding any byte of positions ``[start, end)``."""
        if end <= start:
            return range(0)
        first = start * self.row_token_bytes // self.page_size_bytes
        last = (end * self.row_token_bytes - 1) // self.page_size_bytes
        return range(first, last + 1)

    def max_tokens_for_units(self, num_units: int) -> int:
        """Most positions ``num_units`` leading units back (capped at ``max_model_len``)."""
        return min(self.max_model_len, num_units * self.page_size_bytes // self.row_token_bytes)

    def unit_offset(self, slot: int, unit: int) -> int:
        """Byte offset of ``unit`` of ``slot`` inside every reservation (after the guard page)."""
        return self.guard_bytes + slot * self.slot_stride_bytes + unit * self.page_size_bytes

    def unit_pages(self, slot: int, unit: int) -> list[tuple[int, int]]:
        """``(reservation, page index in reservation)`` of each page of one unit (page 0 is the guard)."""
        index = self.unit_offset(slot, unit) // self.page_size_bytes
        return [(r, index) for r in range(self.num_reservations)]

    def pages_for(self, slot: int, num_tokens: int) -> list[tuple[int, int]]:
        """``(reservation, page index)`` pairs that must be mapped for positions ``[0, num_tokens)``."""
        return [p for u in range(self.num_units(num_tokens)) for p in self.unit_pages(slot, u)]

    def unit_used_bytes(self, num_tokens: int, unit: int) -> int:
        """Bytes of each page of ``unit`` holding positions ``< num_tokens``."""
        used = num_tokens * self.row_token_bytes - unit * self.page_size_bytes
        return max(0, min(self.page_size_bytes, used))

    def _typed(self, base: torch.Tensor) -> torch.Tensor:
        return base.view(self.spec.dtype)

    def describe(self) -> str:
        return (f"{self.name}: {self.num_reservations} reservation(s) x {self.reservation_bytes} B "
                f"(a {self.guard_bytes} B guard page first), slot stride {self.slot_stride_bytes} B = {self.pages_per_slot} pages of "
                f"{self.page_size_bytes} B, {float(self.tokens_per_page):g} tokens/page")


class MegacacheLayout(VMemLayout):
    """One reservation; slot row ``[max_model_len][num_layers][2][H][D]`` (token-major)."""

    name = "megacache"
    num_reservations = 1

    @staticmethod
    def token_bytes_in_row(spec: KVCacheSpec) -> int:
        return spec.bytes_per_token

    def reservations_for_layer(self, layer: int) -> tuple[int, ...]:
        return (0,)

    def kv_views(self, bases):
        s = self.spec
        flat = self._typed(bases[0])
        head_el = s.num_kv_heads * s.head_dim
        size = (self.max_num_seqs, self.max_model_len, s.num_kv_heads, s.head_dim)
        stride = (self.slot_stride_bytes // s.dtype_bytes, s.num_layers * 2 * head_el, s.head_dim, 1)
        first = self.guard_bytes // s.dtype_bytes       # slot 0 starts after the guard page
        keys = [flat.as_strided(size, stride, first + (2 * layer) * head_el) for layer in range(s.num_layers)]
        values = [flat.as_strided(size, stride, first + (2 * layer + 1) * head_el)
                  for layer in range(s.num_layers)]
        return keys, values


class PerLayerLayout(VMemLayout):
    """``2 * num_layers`` reservations (K of layer l is reservation ``2l``, V is ``2l + 1``),
    each ``[max_num_seqs][padded row of max_model_len x H x D]``."""

    name = "per_layer"

    def __init__(self, spec, max_num_seqs, max_model_len, page_size_bytes) -> None:
        self.num_reservations = 2 * spec.num_layers
        super().__init__(spec, max_num_seqs, max_model_len, page_size_bytes)

    @staticmethod
    def token_bytes_in_row(spec: KVCacheSpec) -> int:
        return spec.num_kv_heads * spec.head_bytes

    def reservations_for_layer(self, layer: int) -> tuple[int, ...]:
        return (2 * layer, 2 * layer + 1)

    def kv_views(self, bases):
        s = self.spec
        size = (self.max_num_seqs, self.max_model_len, s.num_kv_heads, s.head_dim)
        stride = (self.slot_stride_bytes // s.dtype_bytes, s.num_kv_heads * s.head_dim, s.head_dim, 1)
        views = [self._typed(b).as_strided(size, stride, self.guard_bytes // s.dtype_bytes) for b in bases]
        return views[0::2], views[1::2]


LAYOUTS = {"megacache": MegacacheLayout, "per_layer": PerLayerLayout}


def make_layout(name: str, spec: KVCacheSpec, max_num_seqs: int, max_model_len: int,
                page_size_bytes: int) -> VMemLayout:
    """Build a layout by name (``"megacache"`` or ``"per_layer"``); ValueError for another name."""
    try:
        cls = LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown vmem layout {name!r}; choose one of {list(LAYOUTS)}") from None
    return cls(spec, max_num_seqs, max_model_len, page_size_bytes)
