"""The host side of the vmem driver protocol, torch-free: :class:`VMMError` and :class:`PageDriver`,
what the page bookkeeping (page pool, page table, slot mapper, placement) calls.

The tensor side (``as_tensor``, ``copy_page``) belongs to the full driver
(:class:`~vmkv.vmem.driver.VMMDriver`) and is used only by the cache, so the bookkeeping imports and
runs without torch (DESIGN.md: "the id/page bookkeeping is host-only and torch-free") and tests drive
it with an in-memory driver.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["VMMError", "PageDriver"]


class VMMError(RuntimeError):
    """A virtual-memory call failed.

    Attributes:
        call: the failing call (``"cuMemMap"``, ``"mmap"``, ...).
        code: its result code (``"CUDA_ERROR_OUT_OF_MEMORY"``, ``"ENOMEM"``, ...).
    """

    def __init__(self, call: str, code: str, detail: str = "") -> None:
        self.call = call
        self.code = code
        msg = f"{call} failed: {code}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)

    @property
    def out_of_memory(self) -> bool:
        """The device or the host could not provide the memory (``CUDA_ERROR_OUT_OF_MEMORY``,
        ``ENOMEM``, ``ENOSPC``): a full cache, not a broken one."""
        return self.code.split(" ")[0] in ("CUDA_ERROR_OUT_OF_MEMORY", "ENOMEM", "ENOSPC")


class PageDriver(Protocol):
    """Reservations, pages, mappings and fences: the calls the page bookkeeping makes (no tensors).

    Attributes:
        name: ``"host"``, ``"cuda"``, ...
        page_size_bytes: bytes of one physical page (the map/unmap unit).
        calls: underlying call of each operation (``{"create_page": "cuMemCreate", ...}``), used to
            tell an out-of-memory ``create_page`` from other failures.
    """

    name: str
    page_size_bytes: int
    calls: dict

    def reserve(self, nbytes: int) -> int: ...

    def free_reservation(self, va: int, nbytes: int) -> None: ...

    def create_page(self) -> int: ...

    def release(self, handle: int) -> None: ...

    def map(self, va: int, handle: int, *, set_access: bool = True) -> None: ...

    def set_access(self, va: int, nbytes: int) -> None: ...

    def unmap(self, va: int) -> None: ...

    def record_fence(self) -> object: ...

    def fence_done(self, fence: object) -> bool: ...

    def wait_fence(self, fence: object) -> None: ...

    def check_mappings(self, expected: dict[int, int]) -> None: ...

    @property
    def num_live_pages(self) -> int | None: ...
