"""``VMemOptions``: the vmem backend's options and name lists (torch-free; the registry maps
``"vmem"`` here).

The keywords are :class:`vmkv.vmem.cache.VMemKVCache`'s; the name lists (``LAYOUTS``, ``DRIVERS``,
``ATTENTION_IMPLS``) live here once: the implementation, the engine config and the CLIs read them from
this module (the CLIs through the registry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from vmkv.kvcache.options import BackendOptions, Check, boolean, non_negative_int, one_of, option, positive_int

__all__ = ["VMemOptions", "LAYOUTS", "DRIVERS", "ATTENTION_IMPLS"]

#: virtual layouts: one reservation for all layers (a page covers all layers of a token range), or
#: vAttention's ``2 * num_layers`` reservations
LAYOUTS = ("megacache", "per_layer")
#: page drivers: ``auto`` picks ``cuda`` for a CUDA device and ``host`` (mmap + memfd) otherwise
DRIVERS = ("auto", "cuda", "host")
#: ``vmkv.kernels.ops.contiguous_attention`` implementations: ``auto`` (Triton on CUDA, the torch
#: reference elsewhere), ``triton``, ``torch``, ``sdpa`` (unmodified
#: ``scaled_dot_product_attention`` on slot views: vAttention's thesis)
ATTENTION_IMPLS = ("auto", "triton", "torch", "sdpa")


def _driver_check() -> Check:
    # a name, or a driver object the caller owns (the VMMDriver protocol: it can create pages)
    def test(v: Any) -> bool:
        return v in DRIVERS if isinstance(v, str) else callable(getattr(v, "create_page", None))
    return Check(test, f"one of {list(DRIVERS)} or a VMMDriver", DRIVERS)


@dataclass(frozen=True)
class VMemOptions(BackendOptions):
    """Options of the vmem KV backend.

    Args:
        driver: page driver name (``DRIVERS``) or a ``VMMDriver`` the caller owns.
        layout: virtual layout (``LAYOUTS``).
        page_size_bytes: bytes per physical page; ``None``: the driver's default (2 MiB on CUDA, a
            size fitted to the shape on the host driver).
        enable_prefix_caching: share full pages of identical prompt prefixes.
        lookahead_tokens: back this many positions past a sequence's length ahead of need.
        preallocate: create the whole page pool up front instead of on demand.
        attention_impl: attention implementation on slot views (``ATTENTION_IMPLS``).
    Raises:
        ValueError: a field is out of range (the message names field, value and range).
    """

    backend: ClassVar[str] = "vmem"

    driver: Any = option("auto", _driver_check(), "vmem: page driver")
    layout: str = option("megacache", one_of(LAYOUTS), "vmem: virtual layout")
    page_size_bytes: int | None = option(None, positive_int(allow_none=True),
                                         "vmem: bytes per physical page, e.g. 2MiB "
                                         "(default: the driver's)")
    enable_prefix_caching: bool = option(True, boolean(), "share KV of identical prompt prefixes")
    lookahead_tokens: int = option(0, non_negative_int(), "vmem: positions backed ahead of need")
    preallocate: bool = option(False, boolean(), "vmem: create the page pool up front")
    attention_impl: str = option("auto", one_of(ATTENTION_IMPLS),
                                 "vmem: attention implementation on slot views (sdpa: unmodified "
                                 "torch scaled_dot_product_attention, vAttention's thesis)")
