"""Prefix cache of the vmem backend: chained unit hash -> the physical pages of that unit.

A unit (the pages at one page index of a slot, one per reservation) holding an integral number of
tokens of a prompt is registered under ``vmkv.kvcache.prefix.unit_hashes`` once all its tokens are
written; a later prompt with the same leading tokens maps those pages into its own slot instead of
recomputing them (vLLM automatic prefix caching, Kwon et al., SOSP'23, section 4.4, at page
granularity; vAttention, Prabhu et al., ASPLOS'25, section 7 discusses page-granular sharing).
An entry lives as long as every page of it is mapped somewhere (in a live slot or kept by deferred
reclamation); a page that is overwritten or reclaimed drops its entry.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """``hash -> tuple of page handles`` and the reverse ``page -> hash``."""

    def __init__(self) -> None:
        self._pages_of: dict[int, tuple[int, ...]] = {}
        self._hash_of: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._pages_of)

    def lookup(self, hashes: Sequence[int]) -> list[tuple[int, ...]]:
        """Pages of the longest run of leading ``hashes`` that are registered."""
        hits = []
        for h in hashes:
            pages = self._pages_of.get(h)
            if pages is None:
                break
            hits.append(pages)
        return hits

    def register(self, unit_hash: int, pages: Sequence[int]) -> bool:
        """Register ``pages`` under ``unit_hash``; False (nothing changed) if the hash or a page is
        already registered."""
        if unit_hash in self._pages_of or any(p in self._hash_of for p in pages):
            return False
        self._pages_of[unit_hash] = tuple(pages)
        for p in pages:
            self._hash_of[p] = unit_hash
        return True

    def is_hashed(self, page: int) -> bool:
        return page in self._hash_of

    def drop_page(self, page: int) -> None:
        """Forget the entry ``page`` belongs to (its content is about to change or it is freed)."""
        h = self._hash_of.get(page)
        if h is not None:
            for p in self._pages_of.pop(h):
                del self._hash_of[p]

    def hashed_pages(self) -> set[int]:
        return set(self._hash_of)

    def check_integrity(self) -> None:
        for h, pages in self._pages_of.items():
            for p in pages:
                if self._hash_of.get(p) != h:
                    raise AssertionError(f"page {p} of prefix entry {h:#x} maps back to "
                                         f"{self._hash_of.get(p)!r}")
        total = sum(len(p) for p in self._pages_of.values())
        if total != len(self._hash_of):
            raise AssertionError(f"prefix index: {total} pages in entries, {len(self._hash_of)} reverse")

    def clear(self) -> None:
        self._pages_of.clear()
        self._hash_of.clear()
