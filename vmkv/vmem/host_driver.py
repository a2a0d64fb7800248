"""Linux host driver of the vmem backend: the CPU twin of the CUDA VMM driver (mmap + memfd via ctypes)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as errno_mod
import mmap
import os

import torch

from vmkv.vmem.driver import DEFAULT_HOST_PAGE_BYTES, VMMDriver
from vmkv.vmem.protocol import VMMError

__all__ = ["HostDriver"]

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
             "release": "fallocate", "map": "mmap", "unmap": "mmap", "set_access": "mprotect",
             "as_tensor": "as_tensor", "copy_page": "memmove"}

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
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
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
        page = self.page_size_bytes
        offset = self._file_pages * page
        if self._libc.ftruncate(self._fd, offset + page) != 0:
            raise self._fail("ftruncate", f"grow the page file to {offset + page} bytes")
        self._file_pages += 1
        return offset

    def _release(self, handle: int) -> None:
        # give the memory back to the OS; the next page created at this offset reads as zeros
        page = self.page_size_bytes
        if self._libc.fallocate(self._fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, handle, page) != 0:
            raise self._fail("fallocate", f"punch hole at offset {handle}+{page}")
        self._free_offsets.append(handle)

    def _map(self, va: int, handle: int, set_access: bool) -> None:
        # without set_access the page is mapped PROT_NONE, like a CUDA mapping before cuMemSetAccess
        prot = _PROT_READ | _PROT_WRITE if set_access else _PROT_NONE
        ret = self._mmap(va, self.page_size_bytes, prot, _MAP_SHARED | _MAP_FIXED,
                         self._fd, handle, f"map the page at offset {handle} to {va:#x}")
        if ret != va:  # MAP_FIXED never moves; a different address means the kernel ignored it
            raise VMMError("mmap", "EFAULT", f"MAP_FIXED returned {ret:#x}, wanted {va:#x}")

    def _set_access(self, va: int, nbytes: int) -> None:
        if self._libc.mprotect(va, nbytes, _PROT_READ | _PROT_WRITE) != 0:
            raise self._fail("mprotect", f"{va:#x}+{nbytes} PROT_READ|PROT_WRITE")

    def _unmap(self, va: int) -> None:
        self._mmap(va, self.page_size_bytes, _PROT_NONE,
                   _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0,
                   f"re-reserve {va:#x} PROT_NONE")

    def _tensor(self, va: int, nbytes: int) -> torch.Tensor:
        buf = (ctypes.c_uint8 * nbytes).from_address(va)
        return torch.frombuffer(buf, dtype=torch.uint8)

    def copy_page(self, dst_va: int, src_va: int) -> None:
        ctypes.memmove(dst_va, src_va, self.page_size_bytes)

    @property
    def file_pages(self) -> int:
        """Pages the memfd file has grown to (live + free offsets)."""
        return self._file_pages

    def _close(self) -> None:
        os.close(self._fd)
