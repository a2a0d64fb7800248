"""``VMemOptions``: the vmem backend's options and name lists (torch-free; the registry maps
``"vmem"`` here).

The keywords are :class:`vmkv.vmem.cache.VMemKVCache`'s; the name lists (``LAYOUTS``, ``DRIVERS``,
``ATTENTION_IMPLS``) live here once: the implementation, the engine config and the CLIs read them from
this module (the CLIs through the registry).
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Any, ClassVar

from vmkv.kvcache.options import BackendOptions, Check, boolean, non_negative_int, one_of, option, size_bytes

__all__ = ["VMemOptions", "LAYOUTS", "DRIVERS", "ATTENTION_IMPLS", "DEFAULT_KV_RESERVE_BYTES",
           "DEFAULT_KV_SHRINK_GRACE_S"]

#: virtual layouts: one reservation for all layers (a page covers all layers of a token range), or
#: vAttention's ``2 * num_layers`` reservations
LAYOUTS = ("megacache", "per_layer")
#: page drivers: ``auto`` picks ``cuda`` for a CUDA device and ``host`` (mmap + memfd) otherwise
DRIVERS = ("auto", "cuda", "host")
#: ``vmkv.kernels.ops.contiguous_attention`` implementations: ``auto`` (Triton on CUDA, SDPA on CPU
#: for fp16/bf16/fp32, else the torch reference), ``triton``, ``torch``, ``sdpa`` (unmodified
#: ``scaled_dot_product_attention`` on slot views: vAttention's thesis)
ATTENTION_IMPLS = ("auto", "triton", "torch", "sdpa")


#: ``kv_reserve_bytes`` default: idle KV memory kept after a shrink, ready for the next burst
DEFAULT_KV_RESERVE_BYTES = 64 << 20
#: ``kv_shrink_grace_s`` default: long enough that an offline run's dips between waves of requests
#: release nothing (no create/release churn), short enough that a server's burst gives memory back soon
DEFAULT_KV_SHRINK_GRACE_S = 10.0


def _grace_check() -> Check:
    def test(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)
    return Check(test, "a number of seconds (0: at once; negative or inf: never)", parse=float, metavar="S")


def _driver_check() -> Check:
    # a name, or a driver object the caller owns (the VMMDriver protocol: it can create pages)
    def test(v: Any) -> bool:
        return v in DRIVERS if isinstance(v, str) else callable(getattr(v, "create_page", None))
    return Check(test, f"one of {list(DRIVERS)} or a VMMDriver", DRIVERS)


@dataclass(frozen=True)
class VMemOptions(BackendOptions):
    """Options of the vmem KV backend.

    Args:
        page_size_bytes: bytes per physical page; ``None``: the driver's default (2 MiB on CUDA, a
            size fitted to the shape on the host driver).
        layout: virtual layout (``LAYOUTS``).
        driver: page driver name (``DRIVERS``) or a ``VMMDriver`` the caller owns.
        enable_prefix_caching: share full pages of identical prompt prefixes.
        attention_impl: attention implementation on slot views (``ATTENTION_IMPLS``); the paged
            backend refuses a value other than the default.
        lookahead_tokens: back this many positions past a sequence's length ahead of need.
        preallocate: create the whole page pool up front instead of on demand.
        kv_reserve_bytes: elastic shrink: idle physical KV memory (created pages no live sequence
            claims) kept; the rest goes back to the device/OS once it has been idle for
            ``kv_shrink_grace_s``.  Kept ready off the step's critical path: as plain free pages
            while sequences are live (grows find them without ``cuMemCreate``), mapped in a freed
            slot while none is (the next admission adopts them without a map call).  The cap is
            the cache's ``memory_bytes`` (``--kv-memory``).
        kv_shrink_grace_s: the shrink's window: memory beyond the reserve and the high-water mark
            of demand over this many seconds is released (never while requests wait; ``elastic.py``);
            0: at once, negative or ``inf``: never (the pool only grows).  ``preallocate`` turns it off.
    Raises:
        ValueError: a field is out of range (the message names field, value and range).
    """

    backend: ClassVar[str] = "vmem"

    page_size_bytes: int | None = option(None, size_bytes(allow_none=True),
                                         "vmem: bytes per physical page, e.g. 2MiB "
                                         "(default: the driver's)")
    layout: str = option("megacache", one_of(LAYOUTS), "vmem: virtual layout")
    driver: Any = option("auto", _driver_check(), "vmem: page driver")
    enable_prefix_caching: bool = option(True, boolean(), "share KV of identical prompt prefixes")
    attention_impl: str = option("auto", one_of(ATTENTION_IMPLS),
                                 "vmem: attention implementation on slot views (sdpa: unmodified "
                                 "torch scaled_dot_product_attention, vAttention's thesis)",
                                 refused_elsewhere=True)
    lookahead_tokens: int = option(0, non_negative_int(), "vmem: positions backed ahead of need")
    preallocate: bool = option(False, boolean(), "vmem: create the page pool up front")
    kv_reserve_bytes: int = option(DEFAULT_KV_RESERVE_BYTES, size_bytes(allow_zero=True),
                                   "vmem: idle KV memory kept after a shrink, e.g. 64MiB; paged keeps "
                                   "its whole static pool", flag="--kv-reserve")
    kv_shrink_grace_s: float = option(DEFAULT_KV_SHRINK_GRACE_S, _grace_check(),
                                      "vmem: seconds KV memory stays idle above the reserve before it "
                                      "is released to the device (0: at once; -1 or inf: never); "
                                      "paged never releases")
