"""The free slots of the vmem backend ordered by how many units they keep mapped, so that choosing a slot
for an admission (:func:`~vmkv.vmem.placement.pick_slot`) visits them best bound first and stops after a
few instead of scoring every free slot (torch-free, no driver calls)."""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Iterator

__all__ = ["FreeSlotIndex"]


class FreeSlotIndex:
    """``(kept units, slot index)`` of every free slot, sorted; ``kept units`` is ``len(slot.units)``,
    the number of units holding at least one mapped page.

    The mapper keeps it current: a slot enters when it is freed (:meth:`add`), leaves when it is
    occupied (:meth:`remove`), and moves when a map or unmap changes its kept units while it is free
    (:meth:`move`).  Each is O(log n) to find plus a memmove of the list.
    """

    def __init__(self, num_slots: int) -> None:
        self._order: list[tuple[int, int]] = [(0, i) for i in range(num_slots)]
        self._kept: dict[int, int] = dict.fromkeys(range(num_slots), 0)

    def __len__(self) -> int:
        return len(self._order)

    def add(self, index: int, kept: int) -> None:
        """Slot ``index`` became free keeping ``kept`` units (it must not be free already)."""
        assert index not in self._kept, f"slot {index} is already free"
        self._kept[index] = kept
        insort(self._order, (kept, index))

    def remove(self, index: int) -> None:
        """Slot ``index`` is no longer free.  Raises KeyError when it was not free."""
        kept = self._kept.pop(index)
        i = bisect_left(self._order, (kept, index))
        assert self._order[i] == (kept, index), f"slot {index} missing from the free order"
        del self._order[i]

    def move(self, index: int, kept: int) -> None:
        """Free slot ``index`` now keeps ``kept`` units (no-op when it is not free or unchanged)."""
        old = self._kept.get(index)
        if old is None or old == kept:
            return
        self.remove(index)
        self.add(index, kept)

    def lowest_empty(self) -> int | None:
        """The lowest index of a free slot that keeps no pages, or ``None``."""
        order = self._order
        return order[0][1] if order and order[0][0] == 0 else None

    def first_keeping(self, num_units: int) -> int | None:
        """The free slot keeping the fewest units among those keeping ``>= num_units`` (the lowest
        index among equals): the first of :meth:`in_bound_order`; ``None`` when no free slot keeps
        that many."""
        order = self._order
        i = bisect_left(order, (num_units, -1))
        return order[i][1] if i < len(order) else None

    def in_bound_order(self, num_units: int) -> Iterator[int]:
        """Free slot indices in ascending order of :func:`~vmkv.vmem.placement.pick_slot`'s lower
        bound for an admission of ``num_units`` units: those keeping ``>= num_units`` units by
        ascending kept count, then those keeping fewer by descending kept count, each count's slots by
        ascending index.  Lazy: the caller stops when the bound exceeds its best key (the list must not
        change meanwhile)."""
        order = self._order
        i = bisect_left(order, (num_units, -1))
        for j in range(i, len(order)):
            yield order[j][1]
        j = i - 1
        while j >= 0:
            start = bisect_left(order, (order[j][0], -1))
            for t in range(start, j + 1):
                yield order[t][1]
            j = start - 1

    def check(self, expected: dict[int, int]) -> None:
        """Compare with ``slot index -> kept units`` of the free slots, counted by a walk."""
        if self._kept != expected:
            diff = sorted(set(self._kept.items()) ^ set(expected.items()))[:8]
            raise AssertionError(f"free-slot order differs from the slots: {diff}")
        if self._order != sorted((k, i) for i, k in expected.items()):
            raise AssertionError("free-slot order is not sorted or has stray entries")
