"""Chained hashes of full prefix units, shared by both backends' prefix caches.

A unit (a paged block, or the tokens of a vmem page) is identified by
``hash(parent_hash, token ids of the unit, extra_key)``, so equal hashes imply equal whole prefixes
(vLLM's automatic prefix caching; Kwon et al., SOSP'23, section 4.4 "shared prefix").
"""

from __future__ import annotations

import hashlib
import struct
from typing import Hashable, Sequence

#: parent hash of a sequence's first unit
ROOT_HASH = 0


def hash_unit(parent_hash: int, token_ids: Sequence[int], extra_key: Hashable = None) -> int:
    """Stable 64-bit hash of one full unit chained on its parent (blake2b; same across processes)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent_hash & 0xFFFFFFFFFFFFFFFF))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_key is not None:
        h.update(repr(extra_key).encode())
    return int.from_bytes(h.digest(), "little")


def unit_hashes(token_ids: Sequence[int], unit_tokens: int, extra_key: Hashable = None,
                max_units: int | None = None) -> list[int]:
    """Chained hashes of the full units of ``token_ids`` (``len // unit_tokens`` of them, or fewer).

    Args:
        token_ids: the prompt's token ids.
        unit_tokens: tokens per unit (> 0).
        max_units: stop after this many units.
    """
    if unit_tokens <= 0:
        raise ValueError(f"unit_tokens must be > 0, got {unit_tokens}")
    n = len(token_ids) // unit_tokens
    if max_units is not None:
        n = min(n, max_units)
    out: list[int] = []
    parent = ROOT_HASH
    for i in range(n):
        parent = hash_unit(parent, token_ids[i * unit_tokens:(i + 1) * unit_tokens], extra_key)
        out.append(parent)
    return out
