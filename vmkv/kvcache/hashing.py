"""Unit keys of the prefix cache: typed extra-key encoding and the chained sha256 of full units.

Torch-free; see :mod:`vmkv.kvcache.prefix` for the verified index that uses these keys.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from array import array
from typing import Hashable, NamedTuple, Sequence

__all__ = ["HASH_BYTES", "ROOT_HASH", "UnitKey", "encode_extra_key", "extra_key_digest", "hash_unit",
           "hash_unit_bytes", "unit_keys"]

#: bytes of a unit hash (sha256)
HASH_BYTES = 32
#: parent hash of a sequence's first unit
ROOT_HASH = bytes(HASH_BYTES)

_INT64 = (-(1 << 63), (1 << 63) - 1)


# ---------------------------------------------------------------------------------------- encoding
def _length(n: int) -> bytes:
    return struct.pack("<Q", n)


def _encode(value: object, out: list[bytes]) -> None:
    # one tag byte per value, then a fixed-size or length-prefixed payload: no two values of
    # different types or contents share an encoding (repr() would: 1 / True / "1" ...)
    if value is None:
        out.append(b"N")
    elif isinstance(value, bool):
        out.append(b"B\x01" if value else b"B\x00")
    elif isinstance(value, int):
        raw = value.to_bytes(max(1, (value.bit_length() + 8) // 8), "little", signed=True)
        out += (b"I", _length(len(raw)), raw)
    elif isinstance(value, float):
        if math.isnan(value):
            raise ValueError("extra_key must not contain NaN (it never equals itself)")
        out += (b"F", struct.pack("<d", value))
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        out += (b"S", _length(len(raw)), raw)
    elif isinstance(value, (bytes, bytearray)):
        out += (b"Y", _length(len(value)), bytes(value))
    elif isinstance(value, tuple):
        out += (b"T", _length(len(value)))
        for item in value:
            _encode(item, out)
    else:
        raise TypeError(f"extra_key must be None, bool, int, float, str, bytes or a tuple of those, "
                        f"got {type(value).__name__}; convert it to one of these (e.g. str)")


def encode_extra_key(extra_key: Hashable) -> bytes:
    """Canonical, typed, length-prefixed bytes of ``extra_key`` (``None`` -> ``b"N"``).

    Two keys have equal encodings only if they have the same types and equal values, so
    ``1``, ``True``, ``1.0`` and ``"1"`` are four different keys.

    Raises:
        TypeError: a type other than None, bool, int, float, str, bytes or tuple (of those).
        ValueError: a NaN float.
    """
    out: list[bytes] = []
    _encode(extra_key, out)
    return b"".join(out)


def extra_key_digest(extra_key: Hashable) -> bytes:
    """sha256 (:data:`HASH_BYTES` bytes) of ``encode_extra_key(extra_key)``: what every unit hash and
    every hit verification uses, so a long extra key (a 7 MB ``cache_salt``) is encoded and hashed
    once per call, not once per unit, and never compared byte by byte.  Two keys share a digest only
    if their typed encodings are equal (or sha256 collides).

    Raises:
        TypeError, ValueError: see :func:`encode_extra_key`.
    """
    return hashlib.sha256(b"vmkv-extra-key\0" + encode_extra_key(extra_key)).digest()


def hash_unit(parent_hash: bytes, token_ids: Sequence[int], extra: bytes) -> bytes:
    """sha256 of one full unit chained on its parent (stable across processes and platforms).

    The input is unambiguous: the 32-byte parent hash, the number of tokens, each token id as a
    little-endian int64, then ``extra`` (a fixed-size :func:`extra_key_digest`).

    Args:
        parent_hash: the previous unit's hash, :data:`ROOT_HASH` for the first unit.
        token_ids: the unit's token ids, each in the int64 range.
        extra: ``extra_key_digest(extra_key)`` (computed once per request, not per unit).
    """
    return hash_unit_bytes(parent_hash, len(token_ids), struct.pack(f"<{len(token_ids)}q", *token_ids), extra)


def hash_unit_bytes(parent_hash: bytes, num_tokens: int, packed: bytes | memoryview, extra: bytes) -> bytes:
    """:func:`hash_unit` of a unit whose ``num_tokens`` token ids are already ``packed`` as
    little-endian int64 (``unit_keys`` packs a whole prompt once and slices it)."""
    h = hashlib.sha256(parent_hash)
    h.update(_length(num_tokens))
    h.update(packed)
    h.update(extra)
    return h.digest()


class UnitKey(NamedTuple):
    """What identifies one full unit of a request: its chained hash (the lookup key) and the
    token ids and extra-key digest (:func:`extra_key_digest`) a hit is verified against.  (A named
    tuple: immutable, and built once per unit of every prompt, about 4x cheaper than a frozen
    dataclass.)"""

    hash: bytes
    token_ids: tuple[int, ...]
    extra: bytes


def unit_keys(token_ids: Sequence[int], unit_tokens: int, extra_key: Hashable = None,
              max_units: int | None = None) -> list[UnitKey]:
    """Keys of the full units of ``token_ids`` (``len // unit_tokens`` of them, or ``max_units``).

    Args:
        token_ids: the prompt's token ids (ints in the int64 range).
        unit_tokens: tokens per unit (> 0).
        extra_key: salt of every unit (tenant, LoRA id ...), see :func:`encode_extra_key`.
        max_units: stop after this many units.
    Raises:
        ValueError: ``unit_tokens <= 0`` or a token id outside int64; TypeError: see
        :func:`encode_extra_key`.
    """
    if unit_tokens <= 0:
        raise ValueError(f"unit_tokens must be > 0, got {unit_tokens}")
    extra = extra_key_digest(extra_key)  # once: O(len(extra key)) per call, O(1) per unit
    try:
        if isinstance(token_ids, (list, tuple)):
            try:
                packed = array("q", token_ids)  # int64 each (ints, or anything with __index__)
            except TypeError:
                packed = array("q", [int(t) for t in token_ids])
        else:
            # anything else (a numpy array, bytes, a range ...) one id per item: array() would take
            # bytes / bytearray as raw int64 buffers, and a failed pass would consume an iterator
            packed = array("q", [int(t) for t in token_ids])
    except OverflowError:
        tokens = [int(t) for t in token_ids]
        raise ValueError(f"token ids must be in the int64 range, got {min(tokens)}..{max(tokens)}") from None
    tokens = packed.tolist()
    if sys.byteorder != "little":
        packed.byteswap()
    data = memoryview(packed.tobytes())
    n = len(tokens) // unit_tokens
    if max_units is not None:
        n = min(n, max_units)
    # each unit's bytes sliced from one little-endian buffer instead of packed unit by unit
    step = 8 * unit_tokens
    keys: list[UnitKey] = []
    parent = ROOT_HASH
    for i in range(n):
        parent = hash_unit_bytes(parent, unit_tokens, data[i * step:(i + 1) * step], extra)
        keys.append(UnitKey(parent, tuple(tokens[i * unit_tokens:(i + 1) * unit_tokens]), extra))
    return keys
