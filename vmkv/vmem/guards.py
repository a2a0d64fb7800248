"""Access, copies, guard pages and address states of the vmem drivers (a mixin of
:class:`~vmkv.vmem.driver.VMMDriver`; see its module docstring, "Guard pages").

Triton's launcher rejects a pointer argument inside a reserved-but-unmapped range, so every
reservation keeps one permanently backed guard page and kernel launches receive its address.
"""

from __future__ import annotations


__all__ = ["GuardPagesMixin"]


class GuardPagesMixin:
    """Needs the driver's ``_reservations``, ``_guards``, ``_guard_handle`` and its
    ``_create_page``/``_map``/``_release``/``_set_access`` hooks."""

    def map_guard(self, va: int) -> None:
        """Back the page at ``va`` (a page boundary of a reservation, unmapped) with the driver's guard
        page, readable/writable, until the reservation is freed (module docstring, "Guard pages").

        The guard page is one physical page created on the first call and mapped at every guard
        address; nothing may rely on its contents.  :meth:`free_reservation` removes it (and
        releases the page after the last guard).
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
        """Guard mappings (:meth:`map_guard`)."""
        return len(self._guards)

    def page_state(self, addr: int) -> str:
        """What backs byte address ``addr``, as far as this thin driver knows: ``"outside"`` (in no
        reservation of this driver: ordinary memory), ``"guard"``, or ``"reserved"`` (some other
        page of a reservation: mapped or not, the page table knows;
        :class:`~vmkv.vmem.checked_driver.CheckedDriver` tells ``"unmapped"``, ``"no_access"`` and
        ``"mapped"`` apart).  Kernel launches receive guard addresses (see :meth:`is_backed`)."""
        addr = int(addr)
        for start, size in self._reservations.items():
            if start <= addr < start + size:
                va = start + (addr - start) // self.page_size_bytes * self.page_size_bytes
                return "guard" if va in self._guards else "reserved"
        return "outside"

    def is_backed(self, addr: int) -> bool:
        """Whether ``addr`` is known to be backed whatever is mapped: a guard page or outside every
        reservation (what an anchor of a kernel launch must be)."""
        return self.page_state(addr) in ("outside", "guard")

    def set_access(self, va: int, nbytes: int) -> None:
        """Make ``[va, va + nbytes)`` readable/writable by the device in one call (cuMemSetAccess /
        mprotect).  The range must lie in one reservation, start on a page boundary, span whole
        pages and be fully mapped; pages that already have access may be part of it.

        Raises:
            VMMError: the call failed; access is unchanged then and the caller decides whether to
            unmap.
        """
        self._set_access(va, int(nbytes))

    def copy_page(self, dst_va: int, src_va: int) -> None:
        """Copy one page's bytes from ``src_va`` to ``dst_va`` (both mapped; stream ordered on CUDA)."""
        page = self.page_size_bytes
        self.as_tensor(dst_va, page).copy_(self.as_tensor(src_va, page))
