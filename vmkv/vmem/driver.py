"""Virtual-memory drivers of the vmem backend: reserve address space, create physical pages, map them.

Two drivers share one protocol (DESIGN.md, "vmem backend"; vAttention, Prabhu et al., ASPLOS'25,
section 5 "CUDA virtual memory APIs"):

    va = drv.reserve(nbytes)          # contiguous virtual range, no memory behind it
    h = drv.create_page()             # one physical page of ``page_size_bytes``
    drv.map(va + i * page, h)         # back one page of the range; ``unmap`` undoes it
    t = drv.as_tensor(va, nbytes)     # zero-copy torch view over (mapped parts of) the range

* :class:`CudaDriver`: CUDA VMM through cuda-python (cuMemAddressReserve, cuMemCreate, cuMemMap,
  cuMemSetAccess, cuMemUnmap, cuMemRelease, cuMemAddressFree); page = allocation granularity (2 MiB).
* :class:`HostDriver`: the same mechanism on Linux through libc: a ``PROT_NONE`` reservation, a
  ``memfd`` file as the physical pool and ``mmap(MAP_SHARED|MAP_FIXED)`` of file pages into it.

Both drivers validate their arguments the same way (page-aligned addresses inside a reservation, no
double map, no release of a mapped page) and raise :class:`VMMError` naming the failing call.
Touching an unmapped part of a tensor from :meth:`VMMDriver.as_tensor` is a fault (SIGSEGV on the
host, an illegal address on CUDA); callers only touch mapped pages.
"""

from __future__ import annotations

import abc
import ctypes
import ctypes.util
import errno as errno_mod
import logging
import mmap
import os

import torch

__all__ = ["VMMError", "VMMDriver", "HostDriver", "CudaDriver", "get_driver", "DEFAULT_HOST_PAGE_BYTES"]

logger = logging.getLogger(__name__)

#: default page of the host driver (keeps the number of mappings under ``vm.max_map_count``)
DEFAULT_HOST_PAGE_BYTES = 64 * 1024


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


class VMMDriver(abc.ABC):
    """The driver protocol, with the bookkeeping and argument checks both drivers share.

    Page handles are opaque ints.  ``map``/``unmap`` work on exactly one page at ``va``.

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
        self._mappings: dict[int, int] = {}            # va -> page handle
        self._page_map_count: dict[int, int] = {}      # live page handle -> number of mappings
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
    def _map(self, va: int, handle: int) -> None: ...

    @abc.abstractmethod
    def _unmap(self, va: int) -> None: ...

    @abc.abstractmethod
    def _tensor(self, va: int, nbytes: int) -> torch.Tensor:
        """uint8 ``[nbytes]`` tensor over ``va`` (no copy)."""

    # ------------------------------------------------------------------ protocol
    def _invalid(self, op: str, detail: str) -> VMMError:
        return VMMError(self.calls.get(op, op), self.invalid_code, detail)

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise self._invalid(op, f"{self.name} driver is closed")

    def reserve(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (a positive multiple of ``page_size_bytes``) of virtual address space.

        Returns:
            The start address (page aligned).
        Raises:
            VMMError: bad size or the reservation call failed.
        """
        self._check_open("reserve")
        nbytes = int(nbytes)
        if nbytes <= 0 or nbytes % self.page_size_bytes:
            raise self._invalid("reserve", f"nbytes={nbytes} must be a positive multiple of "
                                           f"page_size_bytes={self.page_size_bytes}")
        va = self._reserve(nbytes)
        self._reservations[va] = nbytes
        return va

    def free_reservation(self, va: int, nbytes: int) -> None:
        """Give back a whole reservation; every page in it must be unmapped first."""
        self._check_open("free_reservation")
        if self._reservations.get(va) != nbytes:
            raise self._invalid("free_reservation", f"no reservation of {nbytes} bytes at {va:#x}")
        inside = sum(1 for m in self._mappings if va <= m < va + nbytes)
        if inside:
            raise self._invalid("free_reservation", f"{inside} pages still mapped in {va:#x}+{nbytes}; "
                                                    f"unmap them first")
        self._tensors.pop(va, None)
        self._free_reservation(va, nbytes)
        del self._reservations[va]

    def create_page(self) -> int:
        """Create one physical page; returns its handle."""
        self._check_open("create_page")
        handle = self._create_page()
        self._page_map_count[handle] = 0
        return handle

    def release(self, handle: int) -> None:
        """Release a page that is mapped nowhere (call ``unmap`` first)."""
        self._check_open("release")
        count = self._page_map_count.get(handle)
        if count is None:
            raise self._invalid("release", f"unknown or already released page handle {handle}")
        if count:
            raise self._invalid("release", f"page {handle} is still mapped at {count} addresses; "
                                           f"unmap it first")
        self._release(handle)
        del self._page_map_count[handle]

    def _reservation_of(self, op: str, va: int, nbytes: int) -> int:
        for start, size in self._reservations.items():
            if start <= va and va + nbytes <= start + size:
                return start
        raise self._invalid(op, f"[{va:#x}, {va + nbytes:#x}) is not inside a reservation")

    def map(self, va: int, handle: int) -> None:
        """Back the page at ``va`` (a page boundary of a reservation, unmapped) with ``handle``."""
        self._check_open("map")
        start = self._reservation_of("map", va, self.page_size_bytes)
        if (va - start) % self.page_size_bytes:
            raise self._invalid("map", f"va={va:#x} is not on a page boundary of its reservation "
                                       f"({start:#x} + k * {self.page_size_bytes})")
        if va in self._mappings:
            raise self._invalid("map", f"va={va:#x} is already mapped; unmap it first")
        if handle not in self._page_map_count:
            raise self._invalid("map", f"unknown or released page handle {handle}")
        self._map(va, handle)
        self._mappings[va] = handle
        self._page_map_count[handle] += 1

    def unmap(self, va: int) -> None:
        """Remove the page mapped at ``va``; the range stays reserved (and inaccessible)."""
        self._check_open("unmap")
        handle = self._mappings.get(va)
        if handle is None:
            raise self._invalid("unmap", f"nothing is mapped at va={va:#x}")
        self._unmap(va)
        del self._mappings[va]
        self._page_map_count[handle] -= 1

    def as_tensor(self, va: int, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Zero-copy 1-D tensor over ``[va, va + nbytes)`` inside one reservation.

        One uint8 tensor is made per reservation and sliced, so this is cheap.
        Returns:
            ``[nbytes // dtype_size]`` tensor of ``dtype`` on :attr:`device`.
        """
        self._check_open("as_tensor")
        base_va = self._reservation_of("as_tensor", va, nbytes)
        base = self._tensors.get(base_va)
        if base is None:
            base = self._tensor(base_va, self._reservations[base_va])
            self._tensors[base_va] = base
        part = base[va - base_va:va - base_va + nbytes]
        return part if dtype == torch.uint8 else part.view(dtype)

    def copy_page(self, dst_va: int, src_va: int) -> None:
        """Copy one page's bytes from ``src_va`` to ``dst_va`` (both mapped; stream ordered on CUDA)."""
        for op, va in (("copy_page", dst_va), ("copy_page", src_va)):
            if va not in self._mappings:
                raise self._invalid(op, f"va={va:#x} is not mapped")
        page = self.page_size_bytes
        self.as_tensor(dst_va, page).copy_(self.as_tensor(src_va, page))

    def record_fence(self) -> object:
        """A marker after all work queued so far (CUDA event); ``None`` where work is synchronous."""
        return None

    def fence_done(self, fence: object) -> bool:
        return True

    def wait_fence(self, fence: object) -> None:
        """Block until the work before ``fence`` has completed."""

    @property
    def num_pages(self) -> int:
        """Live (created, not released) page handles."""
        return len(self._page_map_count)

    @property
    def num_mappings(self) -> int:
        return len(self._mappings)

    @property
    def num_reservations(self) -> int:
        return len(self._reservations)

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reservations.values())

    def mapped_handle(self, va: int) -> int | None:
        """Handle mapped at ``va``, or None."""
        return self._mappings.get(va)

    def close(self) -> None:
        """Unmap every page, release every page and reservation (idempotent)."""
        if self._closed:
            return
        self._tensors.clear()
        for va in list(self._mappings):
            self.unmap(va)
        for handle in list(self._page_map_count):
            self.release(handle)
        for va, nbytes in list(self._reservations.items()):
            self.free_reservation(va, nbytes)
        self._close()
        self._closed = True

    def _close(self) -> None:
        """Driver-specific teardown after everything is released."""


# ---------------------------------------------------------------------------------------- host
_PROT_NONE, _PROT_READ, _PROT_WRITE = 0, 1, 2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MFD_CLOEXEC = 0x0001
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value


def _errno_text(err: int) -> str:
    return f"{errno_mod.errorcode.get(err, str(err))} ({os.strerror(err)})"


class HostDriver(VMMDriver):
    """Linux virtual memory through libc (ctypes): the CPU twin of :class:`CudaDriver`.

    Reservation: ``mmap(NULL, n, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``.  Physical pool:
    one ``memfd_create`` file grown with ``ftruncate``; a page handle is the page's byte offset in
    it, released offsets are reused (their memory is returned with ``fallocate(PUNCH_HOLE)``).
    Map: ``mmap(va, page, PROT_READ|PROT_WRITE, MAP_SHARED|MAP_FIXED, fd, offset)``, so two
    addresses mapping one handle share memory.  Unmap: re-map ``PROT_NONE`` anonymous over the page,
    which keeps the range reserved.

    Args:
        device: must be a CPU device.
        page_size_bytes: a multiple of the OS page size (default 64 KiB).
    Raises:
        ValueError: bad device or page size.  VMMError: a libc call failed.
    """

    name = "host"
    calls = {"reserve": "mmap", "free_reservation": "munmap", "create_page": "ftruncate",
             "release": "fallocate", "map": "mmap", "unmap": "mmap", "as_tensor": "as_tensor",
             "copy_page": "memmove"}

    def __init__(self, device: torch.device | str = "cpu", page_size_bytes: int | None = None) -> None:
        device = torch.device(device)
        if device.type != "cpu":
            raise ValueError(f"HostDriver serves CPU tensors, got device {device}; use the cuda driver")
        page = DEFAULT_HOST_PAGE_BYTES if page_size_bytes is None else int(page_size_bytes)
        if page <= 0 or page % mmap.PAGESIZE:
            raise ValueError(f"page_size_bytes must be a positive multiple of the OS page size "
                             f"{mmap.PAGESIZE}, got {page_size_bytes}")
        super().__init__(device, page)
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.memfd_create.argtypes = [ctypes.c_char_p, ctypes.c_uint]
        libc.ftruncate.argtypes = [ctypes.c_int, ctypes.c_long]
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        self._libc = libc
        fd = libc.memfd_create(b"vmkv-kv-pages", _MFD_CLOEXEC)
        if fd < 0:
            raise VMMError("memfd_create", _errno_text(ctypes.get_errno()))
        self._fd = fd
        self._file_pages = 0
        self._free_offsets: list[int] = []

    def _fail(self, call: str, detail: str = "") -> VMMError:
        return VMMError(call, _errno_text(ctypes.get_errno()), detail)

    def _mmap(self, va, nbytes, prot, flags, fd, offset, what: str) -> int:
        ret = self._libc.mmap(va, nbytes, prot, flags, fd, offset)
        if ret is None or ret == _MAP_FAILED:
            raise self._fail("mmap", what)
        return ret

    def _reserve(self, nbytes: int) -> int:
        return self._mmap(None, nbytes, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE,
                          -1, 0, f"reserve {nbytes} bytes PROT_NONE")

    def _free_reservation(self, va: int, nbytes: int) -> None:
        if self._libc.munmap(va, nbytes) != 0:
            raise self._fail("munmap", f"{va:#x}+{nbytes}")

    def _create_page(self) -> int:
        if self._free_offsets:
            return self._free_offsets.pop()
        offset = self._file_pages * self.page_size_bytes
        if self._libc.ftruncate(self._fd, offset + self.page_size_bytes) != 0:
            raise self._fail("ftruncate", f"grow the page file to {offset + self.page_size_bytes} bytes")
        self._file_pages += 1
        return offset

    def _release(self, handle: int) -> None:
        # give the memory back to the OS; the next page created at this offset reads as zeros
        if self._libc.fallocate(self._fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, handle,
                                self.page_size_bytes) != 0:
            raise self._fail("fallocate", f"punch hole at offset {handle}")
        self._free_offsets.append(handle)

    def _map(self, va: int, handle: int) -> None:
        ret = self._mmap(va, self.page_size_bytes, _PROT_READ | _PROT_WRITE, _MAP_SHARED | _MAP_FIXED,
                         self._fd, handle, f"map page at offset {handle} to {va:#x}")
        if ret != va:  # MAP_FIXED never moves; a different address means the kernel ignored it
            raise VMMError("mmap", "EFAULT", f"MAP_FIXED returned {ret:#x}, wanted {va:#x}")

    def _unmap(self, va: int) -> None:
        self._mmap(va, self.page_size_bytes, _PROT_NONE,
                   _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0,
                   f"re-reserve {va:#x} PROT_NONE")

    def _tensor(self, va: int, nbytes: int) -> torch.Tensor:
        buf = (ctypes.c_uint8 * nbytes).from_address(va)
        return torch.frombuffer(buf, dtype=torch.uint8)

    def copy_page(self, dst_va: int, src_va: int) -> None:
        for va in (dst_va, src_va):
            if va not in self._mappings:
                raise self._invalid("copy_page", f"va={va:#x} is not mapped")
        ctypes.memmove(dst_va, src_va, self.page_size_bytes)

    @property
    def file_pages(self) -> int:
        """Pages the memfd file has grown to (live + free offsets)."""
        return self._file_pages

    def _close(self) -> None:
        os.close(self._fd)


# ---------------------------------------------------------------------------------------- cuda
class CudaDriver(VMMDriver):
    """CUDA VMM through cuda-python's ``cuda.bindings.driver`` (imported here only).

    Works in torch's primary context of ``device`` (retained with cuDevicePrimaryCtxRetain and made
    current before every call, so tensors over the reservation are usable by torch).  Pages are
    ``CU_MEM_ALLOCATION_TYPE_PINNED`` device memory of ``page_size_bytes`` (default: the minimum
    allocation granularity, 2 MiB on Hopper); every mapping gets read/write access for the device.
    Every ``CUresult`` is checked: a failure raises ``VMMError("cuMemMap failed: CUDA_ERROR_...")``.

    Args:
        device: a CUDA device (``"cuda"`` means the current one).
        page_size_bytes: a multiple of the allocation granularity.
    Raises:
        ValueError: bad device or page size.  VMMError: a driver call failed.
        ImportError: cuda-python is not installed.
    """

    name = "cuda"
    calls = {"reserve": "cuMemAddressReserve", "free_reservation": "cuMemAddressFree",
             "create_page": "cuMemCreate", "release": "cuMemRelease", "map": "cuMemMap",
             "unmap": "cuMemUnmap", "as_tensor": "as_tensor", "copy_page": "copy_page"}
    invalid_code = "CUDA_ERROR_INVALID_VALUE"

    def __init__(self, device: torch.device | str = "cuda", page_size_bytes: int | None = None) -> None:
        from cuda.bindings import driver as cu  # noqa: PLC0415 - only this driver needs cuda-python

        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaDriver needs a CUDA device, got {device}; use the host driver")
        if not torch.cuda.is_available():
            raise ValueError("CudaDriver needs CUDA, but torch.cuda.is_available() is False")
        index = torch.cuda.current_device() if device.index is None else device.index
        device = torch.device("cuda", index)
        torch.cuda.init()
        torch.empty(1, device=device)  # make sure torch created the primary context of the device
        self._cu = cu
        self._check("cuInit", cu.cuInit(0))
        self._cudev = self._check("cuDeviceGet", cu.cuDeviceGet(index))
        self._ctx = self._check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self._cudev))
        self._check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._ctx))
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        self._prop = prop
        gran = int(self._check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        page = gran if page_size_bytes is None else int(page_size_bytes)
        if page <= 0 or page % gran:
            self._check("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease(self._cudev))
            raise ValueError(f"page_size_bytes must be a positive multiple of the CUDA allocation "
                             f"granularity {gran}, got {page_size_bytes}")
        self.granularity_bytes = gran
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        self._handles: dict[int, object] = {}  # int(handle) -> CUmemGenericAllocationHandle
        super().__init__(device, page)

    def _check(self, call: str, result):
        """Unpack a cuda-python result tuple ``(CUresult, *values)``; raise VMMError on failure."""
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self._cu.CUresult.CUDA_SUCCESS:
            raise VMMError(call, getattr(err, "name", str(err)))
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def _enter(self) -> None:
        # the VMM calls need a current context on this thread (e.g. a server worker thread)
        self._check("cuCtxSetCurrent", self._cu.cuCtxSetCurrent(self._ctx))

    def _reserve(self, nbytes: int) -> int:
        self._enter()
        ptr = self._check("cuMemAddressReserve",
                          self._cu.cuMemAddressReserve(nbytes, self.granularity_bytes, 0, 0))
        return int(ptr)

    def _free_reservation(self, va: int, nbytes: int) -> None:
        self._enter()
        self._check("cuMemAddressFree", self._cu.cuMemAddressFree(va, nbytes))

    def _create_page(self) -> int:
        self._enter()
        handle = self._check("cuMemCreate", self._cu.cuMemCreate(self.page_size_bytes, self._prop, 0))
        key = int(handle)
        self._handles[key] = handle
        return key

    def _release(self, handle: int) -> None:
        self._enter()
        self._check("cuMemRelease", self._cu.cuMemRelease(self._handles[handle]))
        del self._handles[handle]

    def _map(self, va: int, handle: int) -> None:
        self._enter()
        cu, page = self._cu, self.page_size_bytes
        self._check("cuMemMap", cu.cuMemMap(va, page, 0, self._handles[handle], 0))
        try:
            self._check("cuMemSetAccess", cu.cuMemSetAccess(va, page, self._access, 1))
        except VMMError:
            cu.cuMemUnmap(va, page)
            raise

    def _unmap(self, va: int) -> None:
        self._enter()
        self._check("cuMemUnmap", self._cu.cuMemUnmap(va, self.page_size_bytes))

    def _tensor(self, va: int, nbytes: int) -> torch.Tensor:
        make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
        if make is not None:
            # a storage over the raw pointer, no deleter, no pointer-attribute query (the range is
            # mostly unmapped, which cudaPointerGetAttributes would reject)
            storage = make(va, self.device, nbytes)
            return torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (nbytes,), (1,))
        return self._tensor_via_cai(va, nbytes)

    def _tensor_via_cai(self, va: int, nbytes: int) -> torch.Tensor:
        """Fallback: ``__cuda_array_interface__``; torch asks the driver which device owns ``va``,
        so a scratch page is mapped at ``va`` while the tensor is made."""
        holder = type("_CudaArray", (), {})()
        holder.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (va, False),
                                           "version": 3, "strides": None}
        scratch = None
        if va not in self._mappings:
            scratch = self.create_page()
            self.map(va, scratch)
        try:
            with torch.cuda.device(self.device):
                return torch.as_tensor(holder, device=self.device)
        finally:
            if scratch is not None:
                self.unmap(va)
                self.release(scratch)

    def record_fence(self) -> object:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def fence_done(self, fence: object) -> bool:
        return fence is None or fence.query()

    def wait_fence(self, fence: object) -> None:
        if fence is not None:
            fence.synchronize()

    def _close(self) -> None:
        self._check("cuDevicePrimaryCtxRelease", self._cu.cuDevicePrimaryCtxRelease(self._cudev))


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
