"""``CheckedDriver``: a driver that validates every call before passing it to a thin driver.

A test aid (not part of the package).  The drivers (:class:`~vmkv.vmem.host_driver.HostDriver`,
:class:`~vmkv.vmem.cuda_driver.CudaDriver`) are thin wrappers over the OS / CUDA calls and keep no mapping table: the cache's page table
(``page_table.py``) is the one record of what is mapped.  Tests wrap a driver in this class to
catch misuse with a typed :class:`~vmkv.vmem.protocol.VMMError` naming the call (what the real call
would do is undefined or a sticky CUDA error): a double map, unmapping an unmapped address, an
address outside a reservation or off a page boundary, releasing a mapped or unknown page, access
to an unmapped range, using a closed driver.  It keeps its own mapping table, so it also tells an
unmapped address from a mapped one (:meth:`page_state`) and lets the mapper's integrity check
(:func:`vmkv.vmem.checks.check_mapper`) compare the page table with what is mapped
(:meth:`check_mappings`, :attr:`num_live_pages`).  Torch-free: :meth:`as_tensor` is the wrapped driver's.
"""

from __future__ import annotations

from vmkv.vmem.protocol import VMMError

__all__ = ["CheckedDriver"]


class CheckedDriver:
    """Wraps ``driver`` (same protocol); every other attribute is the wrapped driver's.

    Closing it unmaps and releases whatever is still mapped or created, frees the reservations and
    closes the wrapped driver.
    """

    def __init__(self, driver) -> None:
        self.inner = driver
        self._reservations: dict[int, int] = {}        # va -> nbytes
        self._mappings: dict[int, int] = {}            # va -> page handle
        self._page_map_count: dict[int, int] = {}      # live page handle -> number of mappings
        self._no_access: set[int] = set()              # mapped va whose access is not set yet
        self._guards: set[int] = set()
        self._closed = False

    def __getattr__(self, name: str):
        if name == "inner":      # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ------------------------------------------------------------------ checks
    def _invalid(self, op: str, detail: str) -> VMMError:
        return VMMError(self.inner.calls.get(op, op), self.inner.invalid_code, detail)

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise self._invalid(op, f"{self.inner.name} driver is closed")

    def _reservation_of(self, op: str, va: int, nbytes: int) -> int:
        for start, size in self._reservations.items():
            if start <= va and va + nbytes <= start + size:
                return start
        raise self._invalid(op, f"[{va:#x}, {va + nbytes:#x}) is not inside a reservation")

    def _check_page_va(self, op: str, va: int, what: str = "va") -> None:
        page = self.inner.page_size_bytes
        start = self._reservation_of(op, va, page)
        if (va - start) % page:
            raise self._invalid(op, f"{what}={va:#x} is not on a page boundary of its reservation "
                                    f"({start:#x} + k * {page})")

    # ------------------------------------------------------------------ protocol
    def reserve(self, nbytes: int) -> int:
        self._check_open("reserve")
        nbytes, page = int(nbytes), self.inner.page_size_bytes
        if nbytes <= 0 or nbytes % page:
            raise self._invalid("reserve", f"nbytes={nbytes} must be a positive multiple of "
                                           f"page_size_bytes={page}")
        va = self.inner.reserve(nbytes)
        self._reservations[va] = nbytes
        return va

    def free_reservation(self, va: int, nbytes: int) -> None:
        self._check_open("free_reservation")
        if self._reservations.get(va) != nbytes:
            raise self._invalid("free_reservation", f"no reservation of {nbytes} bytes at {va:#x}")
        inside = sum(1 for m in self._mappings if va <= m < va + nbytes)
        if inside:
            raise self._invalid("free_reservation", f"{inside} pages still mapped in {va:#x}+{nbytes}; "
                                                    f"unmap them first")
        self.inner.free_reservation(va, nbytes)
        self._guards = {g for g in self._guards if not va <= g < va + nbytes}
        del self._reservations[va]

    def create_page(self) -> int:
        self._check_open("create_page")
        handle = self.inner.create_page()
        self._page_map_count[handle] = 0
        return handle

    def release(self, handle: int) -> None:
        self._check_open("release")
        count = self._page_map_count.get(handle)
        if count is None:
            raise self._invalid("release", f"unknown or already released page handle {handle}")
        if count:
            raise self._invalid("release", f"page {handle} is still mapped at {count} addresses; "
                                           f"unmap it first")
        self.inner.release(handle)
        del self._page_map_count[handle]

    def map(self, va: int, handle: int, *, set_access: bool = True) -> None:
        self._check_open("map")
        self._check_page_va("map", va)
        if handle not in self._page_map_count:
            raise self._invalid("map", f"unknown or released page handle {handle}")
        if va in self._mappings:
            raise self._invalid("map", f"va={va:#x} is already mapped; unmap it first")
        if va in self._guards:
            raise self._invalid("map", f"va={va:#x} is a guard page (mapped for the reservation's "
                                       f"lifetime); map another page")
        self.inner.map(va, handle, set_access=set_access)
        self._mappings[va] = handle
        if not set_access:
            self._no_access.add(va)
        self._page_map_count[handle] += 1

    def unmap(self, va: int) -> None:
        self._check_open("unmap")
        mapped = self._mappings.get(va)
        if mapped is None:
            what = "a guard page is mapped for the reservation's lifetime" if va in self._guards else \
                "nothing is mapped"
            raise self._invalid("unmap", f"{what} at va={va:#x}")
        self.inner.unmap(va)
        del self._mappings[va]
        self._no_access.discard(va)
        self._page_map_count[mapped] -= 1

    def set_access(self, va: int, nbytes: int) -> None:
        self._check_open("set_access")
        page, nbytes = self.inner.page_size_bytes, int(nbytes)
        if nbytes <= 0 or nbytes % page:
            raise self._invalid("set_access", f"nbytes={nbytes} must be a positive multiple of "
                                              f"page_size_bytes={page}")
        self._reservation_of("set_access", va, nbytes)
        self._check_page_va("set_access", va)
        missing = [a for a in range(va, va + nbytes, page) if a not in self._mappings]
        if missing:
            raise self._invalid("set_access", f"{len(missing)} of {nbytes // page} pages of "
                                              f"[{va:#x}, {va + nbytes:#x}) are not mapped (first "
                                              f"{missing[0]:#x}); map them first")
        self.inner.set_access(va, nbytes)
        self._no_access.difference_update(range(va, va + nbytes, page))

    def map_guard(self, va: int) -> None:
        self._check_open("map")
        self._check_page_va("map", va, "guard va")
        if va in self._mappings or va in self._guards:
            raise self._invalid("map", f"guard va={va:#x} is already mapped")
        self.inner.map_guard(va)
        self._guards.add(va)

    def copy_page(self, dst_va: int, src_va: int) -> None:
        self._check_open("copy_page")
        for va in (dst_va, src_va):
            if va not in self._mappings:
                raise self._invalid("copy_page", f"va={va:#x} is not mapped")
            if va in self._no_access:
                raise self._invalid("copy_page", f"va={va:#x} is mapped without access; call set_access")
        self.inner.copy_page(dst_va, src_va)

    def as_tensor(self, va: int, nbytes: int, *args, **kwargs):
        self._check_open("as_tensor")
        self._reservation_of("as_tensor", va, nbytes)
        return self.inner.as_tensor(va, nbytes, *args, **kwargs)

    # ------------------------------------------------------------------ state
    def page_state(self, addr: int) -> str:
        """``"outside"``, ``"unmapped"``, ``"no_access"``, ``"mapped"`` or ``"guard"`` (see
        :meth:`VMMDriver.page_state`, which cannot tell the middle three apart)."""
        addr, page = int(addr), self.inner.page_size_bytes
        for start, size in self._reservations.items():
            if start <= addr < start + size:
                va = start + (addr - start) // page * page
                if va in self._guards:
                    return "guard"
                if va not in self._mappings:
                    return "unmapped"
                return "no_access" if va in self._no_access else "mapped"
        return "outside"

    def is_backed(self, addr: int) -> bool:
        return self.page_state(addr) in ("outside", "mapped", "guard")

    def has_access(self, va: int) -> bool:
        return va in self._mappings and va not in self._no_access

    def mapped_handle(self, va: int) -> int | None:
        """The page handle mapped at ``va``."""
        return self._mappings.get(va)

    def check_mappings(self, expected: dict[int, int]) -> None:
        """Raise ``AssertionError`` unless exactly ``expected`` (``va -> handle``) is mapped, every
        mapping with access."""
        if self._no_access:
            raise AssertionError(f"{len(self._no_access)} mapped pages have no access set")
        if self._mappings != expected:
            diff = sorted(set(self._mappings.items()) ^ set(expected.items()))[:4]
            raise AssertionError(f"driver has {len(self._mappings)} mappings, the slots {len(expected)}; "
                                 f"differ at (va, handle) {[(hex(v), h) for v, h in diff]}")

    @property
    def num_live_pages(self) -> int:
        """Live (created, not released) pages, guards aside."""
        return len(self._page_map_count)

    num_pages = num_live_pages

    @property
    def num_mappings(self) -> int:
        return len(self._mappings)

    @property
    def num_pending_access(self) -> int:
        return len(self._no_access)

    @property
    def num_guards(self) -> int:
        return len(self._guards)

    @property
    def num_reservations(self) -> int:
        return len(self._reservations)

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reservations.values())

    def close(self) -> None:
        """Unmap every page, release every page and reservation, close the wrapped driver
        (idempotent)."""
        if self._closed:
            return
        for va in list(self._mappings):
            self.unmap(va)
        for handle in list(self._page_map_count):
            self.release(handle)
        for va, nbytes in list(self._reservations.items()):
            self.free_reservation(va, nbytes)
        self.inner.close()
        self._closed = True
