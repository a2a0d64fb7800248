"""Parked slots: a freed slot's claims released lazily, so that the next admission into it takes its kept
pages as one range (a mixin of :class:`~vmkv.vmem.mapper.SlotMapper`; torch-free, no driver calls).

Freeing a slot releases the claims on its units ``[0, claimed)`` page by page (``PageTable.claim_pages``),
and the next admission into the slot claims them again page by page: for a 2048-token prompt on 2 MiB
pages, 128 page-table updates each way on the host, while the memory underneath does not change at all.
vAttention (Prabhu et al., ASPLOS'25, section 5.3, deferred reclamation) hands a freed request slot's
pages to the next request with no per-page work.  Here a slot is **parked** instead when it is freed and
nothing can observe the difference: no page of the slot is mapped in another slot and no page of the
pool holds a prefix-cache unit (:meth:`SlotMapper.unshared`), so every page the slot claims is claimed
by it alone.

A parked slot is free (``seq_id is None``) but keeps ``claimed`` and its pages keep their claim counts.
Every reader of the claim state sees the pages as released: :attr:`num_parked_pages` is added to the
idle and obtainable counts and taken from the allocated count.  The state is made real
(:meth:`unpark`: the release vacate would have made, with vacate's tick, so that eviction order and
last-use ticks are the same) before anything looks at the pages one by one: reclamation, the elastic
release, and teardown (:meth:`unpark_all`).  An admission or fork into a parked slot **adopts** it
(:meth:`adopt`): the pages' claims become the new occupant's, and only the units between the parked
count and the new one change hands.  A page of a parked slot cannot become shared or cached while it is
parked: forks and prefix hits map pages of live sequences, and only a live sequence registers units.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vmkv.vmem.mapper import Slot

__all__ = ["ParkingMixin"]


class ParkingMixin:
    """Needs the state of :class:`~vmkv.vmem.mapper.SlotMapper`; sets ``_parked`` (slot indices) and
    ``num_parked_pages`` (pages whose only claim is a parked slot's)."""

    def _init_parking(self) -> None:
        self._parked: set[int] = set()
        self.num_parked_pages = 0
        self.num_parks = self.num_adoptions = 0

    def is_parked(self, slot: Slot) -> bool:
        """Is free ``slot`` parked (its claims still on its pages)?"""
        return slot.index in self._parked

    def _park(self, slot: Slot) -> bool:
        """Park live ``slot`` as it is freed, if no page is shared or cached (module docstring);
        returns whether it did (else the caller releases the claims now)."""
        if not slot.claimed or not self.unshared(slot):
            return False
        self._parked.add(slot.index)
        self.num_parked_pages += slot.claimed * self.num_res   # claimed units are fully mapped
        self.num_parks += 1
        return True

    def adopt(self, slot: Slot, num_units: int) -> None:
        """The free ``slot`` is being given to a sequence that claims ``num_units`` (its ``seq_id`` set
        by the caller): a parked slot's claims on units below ``num_units`` become the occupant's, those
        above are released with the slot's vacate tick, as vacate would have released them (the caller
        then claims from ``claimed`` on)."""
        if slot.index not in self._parked:
            return
        self._parked.remove(slot.index)
        self.num_parked_pages -= slot.claimed * self.num_res
        self.num_adoptions += 1
        if slot.claimed > num_units:
            self.table.claim_pages(self._pages_of(slot, num_units, slot.claimed), -1, slot.free_tick)
            slot.claimed = num_units

    def unpark(self, slot: Slot) -> None:
        """Release a parked slot's claims as :meth:`vacate` would have, with its tick."""
        self._parked.remove(slot.index)
        self.num_parked_pages -= slot.claimed * self.num_res
        self.table.claim_pages(self._pages_of(slot, 0, slot.claimed), -1, slot.free_tick)
        slot.claimed = 0

    def unpark_all(self) -> None:
        """Make every parked slot's release real (before a walk over reclaimable pages)."""
        for index in sorted(self._parked):
            self.unpark(self.slots[index])
