"""Virtual-memory drivers of the vmem backend: reserve address space, create physical pages, map them.

Two drivers share one protocol (DESIGN.md, "vmem backend"; vAttention, Prabhu et al., ASPLOS'25,
section 5 "CUDA virtual memory APIs"):

    va = drv.reserve(nbytes)          # contiguous virtual range, no memory behind it
    h = drv.create_page()             # one physical page of ``page_size_bytes``
    drv.map(va + i * page, h)         # back one page of the range (readable/writable); ``unmap`` undoes it
    drv.map(va, h, set_access=False)  # map only ...
    drv.set_access(va, n * page)      # ... then grant access to a contiguous run of mapped pages at once
    t = drv.as_tensor(va, nbytes)     # zero-copy torch view over (mapped parts of) the range
    drv.map_guard(va)                 # a permanently backed page (see "Guard pages" below)

* :class:`CudaDriver` (``cuda_driver.py``): CUDA VMM through cuda-python (cuMemAddressReserve, cuMemCreate, cuMemMap,
  cuMemSetAccess, cuMemUnmap, cuMemRelease, cuMemAddressFree); page = allocation granularity (2 MiB).
* :class:`HostDriver` (``host_driver.py``): the same mechanism on Linux through libc: a ``PROT_NONE`` reservation, a
  ``memfd`` file as the physical pool and ``mmap(MAP_SHARED|MAP_FIXED)`` of file pages into it.

Access is a separate step on CUDA: a page mapped by cuMemMap is inaccessible until cuMemSetAccess.
Callers that map several adjacent pages pass ``set_access=False`` and call :meth:`VMMDriver.set_access`
once per run, which saves the per-call overhead only: cuMemSetAccess costs about the same per
*allocation* it covers, one page or a run of them (H200, driver 580: 26 us for one 2 MiB page, 3.1 ms
for a run of 128 separately created pages, 33 us for one 128 MiB allocation;
``python -m vmkv.compare.driver_bench``, ``docs/results/h200/issue12/driver_calls_71a21e3/``).  It is the
largest part of mapping a page (cuMemCreate 11 us, cuMemMap 3 us, cuMemUnmap 18 us, cuMemRelease 13 us
there), so the cost of mapping a byte falls with the page size: ``page_size_bytes`` of 32 MiB (any
multiple of the granularity) maps 16 times as much per call as the default 2 MiB, at the price of a
coarser unit of allocation.  The host driver mirrors the two steps: such a page is mapped ``PROT_NONE`` until
``set_access`` (``mprotect``) makes it read/write.

The drivers are thin: they keep the reservations (for tensors and teardown) and the guard pages,
no mapping table and no reference counts (the cache's page table, ``page_table.py``, is the one
record).  Argument validation (page-aligned addresses inside a reservation, no double map, no
release of a mapped page, no use after close) is the tests' checked driver's (``tests/vmem/``), a
wrapper around a driver that also keeps a mapping table (:meth:`VMMDriver.check_mappings`,
:attr:`VMMDriver.num_live_pages`); a failing OS/CUDA call raises :class:`VMMError` naming it.
Touching an unmapped part of a tensor from :meth:`VMMDriver.as_tensor` is a fault (SIGSEGV on the
host, an illegal address on CUDA); callers only touch mapped pages.

Guard pages: Triton's launcher asks the driver about every pointer argument (cuPointerGetAttribute)
and rejects an address inside a reserved-but-unmapped range ("Pointer argument ... cannot be accessed
from Triton").  A kernel over a slot view receives the view's first element (slot 0, position 0),
which is unmapped whenever slot 0 holds no page.  :meth:`VMMDriver.map_guard` backs one page of a
reservation for the reservation's lifetime with the driver's guard page (one physical page shared by
every guard of the driver, never handed out, never unmapped until :meth:`free_reservation`); a launch
passes that address and the element offset of the view from it (``vmkv.kernels`` "anchors"), so every
address a launch receives is backed whatever is mapped.  :meth:`page_state` tells guards
and addresses outside any reservation (backed) from reserved pages.
"""

from __future__ import annotations

import abc
import logging

import torch

from vmkv.vmem.protocol import VMMError

__all__ = ["VMMError", "VMMDriver", "DEFAULT_HOST_PAGE_BYTES"]

logger = logging.getLogger(__name__)

#: default page of the host driver (keeps the number of mappings under ``vm.max_map_count``)
DEFAULT_HOST_PAGE_BYTES = 64 * 1024

class VMMDriver(abc.ABC):
    """The driver protocol: a thin layer over the OS/CUDA calls (no validation: the tests' checked
    driver validates every call): the host side of
    :class:`~vmkv.vmem.protocol.PageDriver` plus tensors over the reservations (:meth:`as_tensor`).

    Page handles are opaque ints; ``map``/``unmap`` work on one page at ``va``.

    Attributes:
        device: torch device of the tensors from :meth:`as_tensor`.
        page_size_bytes: bytes of one physical page (the map/unmap unit).
    """

    name = ""
    #: underlying call of each protocol operation, used in error messages
    calls: dict = {}
    invalid_code = "EINVAL"

    def __init__(self, device: torch.device, page_size_bytes: int) -> None:
        self.device = torch.device(device)
        self.page_size_bytes = int(page_size_bytes)
        self._reservations: dict[int, int] = {}        # va -> nbytes
        self._tensors: dict[int, torch.Tensor] = {}    # reservation va -> uint8 tensor over it
        self._guards: set[int] = set()                 # va of guard pages (see map_guard)
        self._guard_handle: int | None = None          # the one physical page behind every guard
        self._closed = False

    # ------------------------------------------------------------------ driver hooks
    @abc.abstractmethod
    def _reserve(self, nbytes: int) -> int: ...

    @abc.abstractmethod
    def _free_reservation(self, va: int, nbytes: int) -> None: ...

    @abc.abstractmethod
    def _create_page(self) -> int: ...

    @abc.abstractmethod
    def _release(self, handle: int) -> None: ...

    @abc.abstractmethod
    def _map(self, va: int, handle: int, set_access: bool) -> None:
        """Map one page; grant read/write access to it too when ``set_access``."""

    @abc.abstractmethod
    def _set_access(self, va: int, nbytes: int) -> None:
        """Grant read/write access to ``[va, va + nbytes)`` (all mapped, one reservation) in one call."""

    @abc.abstractmethod
    def _unmap(self, va: int) -> None: ...

    @abc.abstractmethod
    def _tensor(self, va: int, nbytes: int) -> torch.Tensor:
        """uint8 ``[nbytes]`` tensor over ``va`` (no copy)."""

    # ------------------------------------------------------------------ protocol
    def _invalid(self, op: str, detail: str) -> VMMError:
        return VMMError(self.calls.get(op, op), self.invalid_code, detail)

    def reserve(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (a positive multiple of ``page_size_bytes``) of virtual address space;
        returns the start address (page aligned).  Raises VMMError: the reservation call failed."""
        nbytes = int(nbytes)
        va = self._reserve(nbytes)
        self._reservations[va] = nbytes
        return va

    def free_reservation(self, va: int, nbytes: int) -> None:
        """Give back a whole reservation (its guard page too); every other page in it must be
        unmapped first."""
        self._tensors.pop(va, None)
        for g in sorted(g for g in self._guards if va <= g < va + nbytes):
            self._unmap(g)
            self._guards.discard(g)
        if not self._guards and self._guard_handle is not None:
            self._release(self._guard_handle)
            self._guard_handle = None
        self._free_reservation(va, nbytes)
        del self._reservations[va]

    def create_page(self) -> int:
        """Create one physical page of ``page_size_bytes``; returns its handle.  Raises VMMError: the
        creation failed (out of memory: ``VMMError.out_of_memory``)."""
        return self._create_page()

    def release(self, handle: int) -> None:
        """Release a page that is mapped nowhere (call ``unmap`` first)."""
        self._release(handle)

    def _reservation_of(self, op: str, va: int, nbytes: int) -> int:
        for start, size in self._reservations.items():
            if start <= va and va + nbytes <= start + size:
                return start
        raise self._invalid(op, f"[{va:#x}, {va + nbytes:#x}) is not inside a reservation")

    def map(self, va: int, handle: int, *, set_access: bool = True) -> None:
        """Back the page at ``va`` (a page boundary of a reservation, unmapped) with ``handle``.

        Args:
            set_access: also make the page readable/writable (default).  ``False`` leaves it
                inaccessible until :meth:`set_access` covers it (batch several adjacent pages into
                one access call); touching it before is a fault.
        Raises:
            VMMError: the map (or access) call failed; nothing is mapped then.
        """
        self._map(va, handle, bool(set_access))

    def unmap(self, va: int) -> None:
        """Remove the page mapped at ``va``; the range stays reserved (and inaccessible)."""
        self._unmap(va)

    def set_access(self, va: int, nbytes: int) -> None:
        """Make ``[va, va + nbytes)`` readable/writable by the device in one call (cuMemSetAccess /
        mprotect).  The range must lie in one reservation, start on a page boundary, span whole pages
        and be fully mapped; pages that already have access may be part of it.

        Raises:
            VMMError: the call failed; access is unchanged then and the caller decides whether to
            unmap.
        """
        self._set_access(va, int(nbytes))

    def copy_page(self, dst_va: int, src_va: int) -> None:
        """Copy one page's bytes from ``src_va`` to ``dst_va`` (both mapped; stream ordered on CUDA)."""
        page = self.page_size_bytes
        self.as_tensor(dst_va, page).copy_(self.as_tensor(src_va, page))

    # ------------------------------------------------------------------ guard pages
    def map_guard(self, va: int) -> None:
        """Back the page at ``va`` (a page boundary of a reservation, unmapped) with the driver's guard
        page, readable/writable, until the reservation is freed (module docstring, "Guard pages").
        The guard page is one physical page created on the first call and mapped at every guard
        address; nothing may rely on its contents.
        Raises:
            VMMError: a driver call failed (nothing changes then).
        """
        created = self._guard_handle is None
        if created:
            self._guard_handle = self._create_page()
        try:
            self._map(va, self._guard_handle, True)
        except BaseException:
            if created:
                self._release(self._guard_handle)
                self._guard_handle = None
            raise
        self._guards.add(va)

    @property
    def num_guards(self) -> int:
        return len(self._guards)

    def page_state(self, addr: int) -> str:
        """What backs byte address ``addr``, as far as this thin driver knows: ``"outside"`` (in no
        reservation: ordinary memory), ``"guard"``, or ``"reserved"`` (some other page of a
        reservation, mapped or not: the page table knows)."""
        addr = int(addr)
        for start, size in self._reservations.items():
            if start <= addr < start + size:
                va = start + (addr - start) // self.page_size_bytes * self.page_size_bytes
                return "guard" if va in self._guards else "reserved"
        return "outside"

    def is_backed(self, addr: int) -> bool:
        """Whether ``addr`` is backed whatever is mapped (a guard page or outside every reservation):
        what an anchor of a kernel launch must be."""
        return self.page_state(addr) in ("outside", "guard")

    # ------------------------------------------------------------------ checks (a thin driver has no table)
    def check_mappings(self, expected: dict[int, int]) -> None:
        """Compare the driver's own mapping table with ``expected`` (``va -> page``, guards aside);
        a thin driver keeps none and accepts anything.  Raises AssertionError on a difference."""

    @property
    def num_live_pages(self) -> int | None:
        """Created and not released pages, guards aside, where the driver counts them, else ``None``."""
        return None

    def as_tensor(self, va: int, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Zero-copy 1-D tensor over ``[va, va + nbytes)`` inside one reservation.

        One uint8 tensor is made per reservation and sliced, so this is cheap.
        Returns:
            ``[nbytes // dtype_size]`` tensor of ``dtype`` on :attr:`device`.
        """
        base_va = self._reservation_of("as_tensor", va, nbytes)
        base = self._tensors.get(base_va)
        if base is None:
            base = self._tensor(base_va, self._reservations[base_va])
            self._tensors[base_va] = base
        part = base[va - base_va:va - base_va + nbytes]
        return part if dtype == torch.uint8 else part.view(dtype)

    def record_fence(self) -> object:
        """A marker after all work queued so far (CUDA event); ``None`` where work is synchronous."""
        return None

    def fence_done(self, fence: object) -> bool:
        return True

    def wait_fence(self, fence: object) -> None:
        """Block until the work before ``fence`` has completed."""

    @property
    def num_reservations(self) -> int:
        return len(self._reservations)

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reservations.values())

    def close(self) -> None:
        """Free the reservations that are left (the pages in them must be unmapped and released by
        their owner first: the cache's mapper does) and tear the driver down (idempotent)."""
        if self._closed:
            return
        self._tensors.clear()
        for va, nbytes in list(self._reservations.items()):
            self.free_reservation(va, nbytes)
        self._close()
        self._closed = True

    def _close(self) -> None:
        """Driver-specific teardown after everything is released."""
