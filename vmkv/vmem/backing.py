"""What backs a ``VMemKVCache``: the driver, the layout, the page pool, the slot mapper, the tensors
over the reservations and their guard pages, built and validated together (and torn down together
when any step fails), so the cache holds only its hooks (DESIGN.md "vmem backend")."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from vmkv.kvcache.prefix import PrefixIndex
from vmkv.kvcache.spec import KVCacheSpec
from vmkv.vmem.cuda_driver import CudaDriver
from vmkv.vmem.driver import VMMDriver
from vmkv.vmem.host_driver import HostDriver
from vmkv.vmem.layout import LAYOUTS, VMemLayout, make_layout
from vmkv.vmem.mapper import SlotMapper
from vmkv.vmem.page_pool import PagePool
from vmkv.vmem.placement import default_host_page_size as _host_page_size

logger = logging.getLogger(__name__)

__all__ = ["Backing", "build_backing", "default_host_page_size", "get_driver"]


def get_driver(kind: str, device: torch.device | str, page_size_bytes: int | None = None) -> VMMDriver:
    """Make a driver.

    Args:
        kind: ``"auto"`` (cuda for a CUDA device, host otherwise), ``"cuda"`` or ``"host"``.
        device: the KV cache's torch device.
        page_size_bytes: page size; default 2 MiB granularity (cuda) or 64 KiB (host).
    Raises:
        ValueError: unknown kind, or a kind that cannot serve ``device``.
    """
    device = torch.device(device)
    if kind == "auto":
        kind = "cuda" if device.type == "cuda" else "host"
    if kind == "cuda":
        return CudaDriver(device, page_size_bytes)
    if kind == "host":
        return HostDriver(device, page_size_bytes)
    raise ValueError(f"unknown vmem driver {kind!r}; choose 'auto', 'cuda' or 'host'")


def default_host_page_size(layout: str, spec: KVCacheSpec, max_model_len: int) -> int:
    """Host page size of ``layout``: see :func:`vmkv.vmem.placement.default_host_page_size`."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown vmem layout {layout!r}; choose one of {list(LAYOUTS)}")
    return _host_page_size(LAYOUTS[layout].token_bytes_in_row(spec), max_model_len)


@dataclass
class Backing:
    """The pieces :func:`build_backing` made.

    Attributes:
        base_tensors: one uint8 ``[reservation_bytes]`` tensor per reservation (the mapper is
            torch-free; the cache's views are made over these).
        keys, values: per layer, ``[max_num_seqs, max_model_len, H, D]`` views of ``spec.dtype``.
        key_anchors, value_anchors: per layer, the guard-page element kernel launches receive.
        owns_driver: the driver was made here (by name), so the cache closes it.
    """

    driver: VMMDriver
    owns_driver: bool
    layout: VMemLayout
    pool: PagePool
    mapper: SlotMapper
    max_pages: int
    base_tensors: list
    keys: list
    values: list
    key_anchors: list
    value_anchors: list


def _driver(spec: KVCacheSpec, driver: str | VMMDriver, layout: str, max_model_len: int,
            page_size_bytes: int | None) -> VMMDriver:
    if isinstance(driver, str):
        if page_size_bytes is None and (driver == "host" or (driver == "auto" and not spec.is_cuda)):
            page_size_bytes = default_host_page_size(layout, spec, max_model_len)
        return get_driver(driver, spec.torch_device, page_size_bytes)
    if page_size_bytes is not None and page_size_bytes != driver.page_size_bytes:
        raise ValueError(f"page_size_bytes={page_size_bytes} disagrees with the given driver's "
                         f"{driver.page_size_bytes}; leave it None")
    return driver


def build_backing(spec: KVCacheSpec, *, max_num_seqs: int, max_model_len: int, memory_bytes: int,
                  driver: str | VMMDriver, layout: str, page_size_bytes: int | None, preallocate: bool,
                  prefix: PrefixIndex) -> Backing:
    """Make (or check) the driver, the layout, ``memory_bytes // page_size_bytes`` pages of pool, the
    reservations and their guard pages and the K/V views (arguments as ``VMemKVCache``'s).

    Raises:
        ValueError: a bad argument (names the value and the allowed range).
        VMMError: a virtual-memory call failed.
        Whatever was made is undone first (a driver made here is closed).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown vmem layout {layout!r}; choose one of {list(LAYOUTS)}")
    owns_driver = isinstance(driver, str)
    drv = _driver(spec, driver, layout, max_model_len, page_size_bytes)
    try:
        if drv.device.type != spec.torch_device.type:
            raise ValueError(f"driver {drv.name!r} serves {drv.device}, spec.device is {spec.device}")
        lay = make_layout(layout, spec, max_num_seqs, max_model_len, drv.page_size_bytes)
        page = lay.page_size_bytes
        max_pages = memory_bytes // page
        if max_pages < lay.pages_per_unit:
            raise ValueError(
                f"memory_bytes={memory_bytes} holds {max_pages} pages of {page} B; the "
                f"{layout} layout maps {lay.pages_per_unit} page(s) per token range; raise "
                f"memory_bytes to >= {lay.bytes_per_unit} or lower page_size_bytes")
        pool = PagePool(drv, max_pages, preallocate, prefix)
        mapper = SlotMapper(drv, lay, pool, prefix)
        try:  # kernel launches receive guard addresses, never slot 0's (layout.py, "guard page")
            bases = [drv.as_tensor(va, lay.reservation_bytes) for va in mapper.bases]
            lay.map_guards(drv, mapper.bases)
        except BaseException:
            mapper.close()
            raise
        keys, values = lay.kv_views(bases)
        key_anchors, value_anchors = lay.kv_anchors(bases)
    except BaseException:
        if owns_driver:
            drv.close()
        raise
    return Backing(drv, owns_driver, lay, pool, mapper, max_pages, bases, keys, values,
                   key_anchors, value_anchors)
