"""Access, copies, guard pages and address states of the vmem drivers (a mixin of
:class:`~vmkv.vmem.driver.VMMDriver`; see its module docstring, "Guard pages").

Triton's launcher rejects a pointer argument inside a reserved-but-unmapped range, so every
reservation keeps one permanently backed guard page and kernel launches receive its address.
"""

from __future__ import annotations


__all__ = ["GuardPagesMixin"]


class GuardPagesMixin:
    """Needs the driver's ``_reservations``, ``_mappings``, ``_no_access``, ``_guards``,
    ``_guard_handle`` and its ``_create_page``/``_map``/``_release`` hooks."""

    def map_guard(self, va: int) -> None:
        """Back the page at ``va`` (a page boundary of a reservation, unmapped) with the driver's guard
        page, readable/writable, until the reservation is freed (module docstring, "Guard pages").

        The guard page is one physical page created on the first call (outside :attr:`num_pages`)
        and mapped at every guard address; nothing may rely on its contents.  ``unmap`` refuses a
        guard; :meth:`free_reservation` removes it (and releases the page after the last guard).
        Raises:
            VMMError: bad or already mapped address, or a driver call failed (nothing changes then).
        """
        self._check_open("map")
        start = self._reservation_of("map", va, self.page_size_bytes)
        if (va - start) % self.page_size_bytes:
            raise self._invalid("map", f"guard va={va:#x} is not on a page boundary of its reservation "
                                       f"({start:#x} + k * {self.page_size_bytes})")
        if va in self._mappings or va in self._guards:
            raise self._invalid("map", f"guard va={va:#x} is already mapped")
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
        """Guard mappings (:meth:`map_guard`); not part of :attr:`num_mappings`."""
        return len(self._guards)

    def page_state(self, addr: int) -> str:
        """What backs byte address ``addr``: ``"outside"`` (in no reservation of this driver: ordinary
        memory), ``"unmapped"`` (reserved, nothing mapped: a kernel launch given this address fails
        Triton's pointer check, a kernel touching it faults), ``"no_access"`` (mapped, access not set
        yet), ``"mapped"`` or ``"guard"``.  The address a kernel launch receives must be ``"outside"``,
        ``"mapped"`` or ``"guard"`` (see :meth:`is_backed`)."""
        addr = int(addr)
        for start, size in self._reservations.items():
            if start <= addr < start + size:
                va = start + (addr - start) // self.page_size_bytes * self.page_size_bytes
                if va in self._guards:
                    return "guard"
                if va not in self._mappings:
                    return "unmapped"
                return "no_access" if va in self._no_access else "mapped"
        return "outside"

    def is_backed(self, addr: int) -> bool:
        """Whether a kernel launch may receive ``addr`` (see :meth:`page_state`)."""
        return self.page_state(addr) in ("outside", "mapped", "guard")

    def set_access(self, va: int, nbytes: int) -> None:
        """Make ``[va, va + nbytes)`` readable/writable by the device in one call (cuMemSetAccess /
        mprotect).  The range must lie in one reservation, start on a page boundary, span whole
        pages and be fully mapped; pages that already have access may be part of it.

        Raises:
            VMMError: a bad or not fully mapped range (``EINVAL`` / ``CUDA_ERROR_INVALID_VALUE``,
                the message names the first unmapped page), or the call failed; access is unchanged
                then and the caller decides whether to unmap.
        """
        self._check_open("set_access")
        page = self.page_size_bytes
        nbytes = int(nbytes)
        if nbytes <= 0 or nbytes % page:
            raise self._invalid("set_access", f"nbytes={nbytes} must be a positive multiple of "
                                              f"page_size_bytes={page}")
        start = self._reservation_of("set_access", va, nbytes)
        if (va - start) % page:
            raise self._invalid("set_access", f"va={va:#x} is not on a page boundary of its reservation "
                                              f"({start:#x} + k * {page})")
        missing = [a for a in range(va, va + nbytes, page) if a not in self._mappings]
        if missing:
            raise self._invalid("set_access", f"{len(missing)} of {nbytes // page} pages of "
                                              f"[{va:#x}, {va + nbytes:#x}) are not mapped (first "
                                              f"{missing[0]:#x}); map them first")
        self._set_access(va, nbytes)
        if self._no_access:
            self._no_access.difference_update(range(va, va + nbytes, page))

    def has_access(self, va: int) -> bool:
        """Whether the page mapped at ``va`` is accessible (False for an unmapped ``va``)."""
        return va in self._mappings and va not in self._no_access

    @property
    def num_pending_access(self) -> int:
        """Mapped pages still waiting for :meth:`set_access`."""
        return len(self._no_access)

    def copy_page(self, dst_va: int, src_va: int) -> None:
        """Copy one page's bytes from ``src_va`` to ``dst_va`` (both mapped; stream ordered on CUDA)."""
        self._check_copy(dst_va, src_va)
        page = self.page_size_bytes
        self.as_tensor(dst_va, page).copy_(self.as_tensor(src_va, page))

    def _check_copy(self, dst_va: int, src_va: int) -> None:
        for va in (dst_va, src_va):
            if va not in self._mappings:
                raise self._invalid("copy_page", f"va={va:#x} is not mapped")
            if va in self._no_access:
                raise self._invalid("copy_page", f"va={va:#x} is mapped without access; call set_access")
