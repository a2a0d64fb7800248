"""CUDA VMM driver of the vmem backend (cuda-python's ``cuda.bindings.driver``, imported only when a
:class:`CudaDriver` is made, so this module imports on machines without it)."""

from __future__ import annotations

import torch

from vmkv.vmem.driver import VMMDriver
from vmkv.vmem.protocol import VMMError

__all__ = ["CudaDriver"]

class CudaDriver(VMMDriver):
    """CUDA VMM through cuda-python's ``cuda.bindings.driver`` (imported here only).

    Works in torch's primary context of ``device`` (retained with cuDevicePrimaryCtxRetain and made
    current before every call, so tensors over the reservation are usable by torch).  Pages are
    ``CU_MEM_ALLOCATION_TYPE_PINNED`` device memory of ``page_size_bytes`` (default: the minimum
    allocation granularity, 2 MiB on Hopper; a multiple of it for larger pages); every mapping gets
    read/write access for the device,
    either with its map (``map(va, h)``) or, for a run of adjacent pages mapped with
    ``set_access=False``, in one cuMemSetAccess over the whole run (``set_access(va, nbytes)``).
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
             "unmap": "cuMemUnmap", "set_access": "cuMemSetAccess", "as_tensor": "as_tensor",
             "copy_page": "copy_page"}
    invalid_code = "CUDA_ERROR_INVALID_VALUE"

    def __init__(self, device: torch.device | str = "cuda", page_size_bytes: int | None = None) -> None:
        try:
            from cuda.bindings import driver as cu  # noqa: PLC0415 - only this driver needs cuda-python
        except ImportError as exc:
            raise ImportError("the vmem backend's CUDA driver needs cuda-python, an optional dependency: "
                              "pip install 'vmkv[cuda]' (or driver='host' to run on host memory)") from exc

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

    def _map(self, va: int, handle: int, set_access: bool) -> None:
        self._enter()
        cu, page = self._cu, self.page_size_bytes
        self._check("cuMemMap", cu.cuMemMap(va, page, 0, self._handles[handle], 0))
        if not set_access:
            return
        try:
            self._check("cuMemSetAccess", cu.cuMemSetAccess(va, page, self._access, 1))
        except VMMError:
            cu.cuMemUnmap(va, page)
            raise

    def _set_access(self, va: int, nbytes: int) -> None:
        # one call over a fully mapped range that may span many cuMemMap'ed pages (the driver API
        # requires every byte of [va, va + nbytes) to be mapped; the caller guarantees it)
        self._enter()
        self._check("cuMemSetAccess", self._cu.cuMemSetAccess(va, nbytes, self._access, 1))

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
        scratch = self._create_page()       # the driver keeps no mapping table: try to map it
        try:
            self._map(va, scratch, True)
        except VMMError:                    # something is mapped at va already: no scratch needed
            self._release(scratch)
            scratch = None
        try:
            with torch.cuda.device(self.device):
                return torch.as_tensor(holder, device=self.device)
        finally:
            if scratch is not None:
                self._unmap(va)
                self._release(scratch)

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
