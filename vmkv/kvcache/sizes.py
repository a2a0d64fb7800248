"""Byte sizes on the command line: ``parse_size`` (``"512MiB"`` -> 536870912) and ``size_or_zero``.

Torch-free and engine-free, so that a backend's options class (:mod:`vmkv.kvcache.options`) can name the
parser of a size option; :mod:`vmkv.engine.args` re-exports both.
"""

from __future__ import annotations

import argparse
import re
from decimal import Decimal, InvalidOperation

__all__ = ["parse_size", "size_or_zero"]

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")
# bare K/M/G/T and the IEC KiB/MiB/... are powers of 1024; the SI kB/MB/GB/TB are powers of 1000
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}
_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    **{p + s: 1024**n for p, n in _POWERS.items() for s in ("", "i", "ib")},
    **{p + "b": 1000**n for p, n in _POWERS.items()},
}


def parse_size(text: str | int) -> int:
    """A byte count from an int or a size string, for ``argparse`` ``type=``.

    ``4096`` and ``"4096"`` -> 4096; ``"512MiB"``, ``"512M"``, ``"512Mi"`` -> 512 * 2**20;
    ``"1.5G"`` -> 1.5 * 2**30; ``"2GB"`` -> 2 * 10**9 (``B``-suffixed SI units are decimal, bare
    letters and ``iB`` units binary).  Units are case-insensitive; fractions round down to whole bytes.

    Raises:
        argparse.ArgumentTypeError: not a size (bool, negative, unknown unit, garbage) or not
            at least 1 byte; the message gives examples of valid sizes.
    """
    examples = "use a positive byte count such as 268435456, 256MiB, 2GiB or 1.5G"
    if isinstance(text, bool):
        raise argparse.ArgumentTypeError(f"not a size: {text!r}; {examples}")
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.fullmatch(str(text))
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _UNITS:
            raise argparse.ArgumentTypeError(f"not a size: {text!r}; {examples}")
        try:
            value = int(Decimal(m.group(1)) * _UNITS[unit])
        except InvalidOperation:  # pragma: no cover - the regex admits only decimal numbers
            raise argparse.ArgumentTypeError(f"not a size: {text!r}; {examples}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte, got {text!r}; {examples}")
    return value


def size_or_zero(text: str | int) -> int:
    """:func:`parse_size`, and ``0`` (e.g. ``--kv-reserve 0``)."""
    return 0 if str(text).strip() in ("0", "0B", "0b") else parse_size(text)
