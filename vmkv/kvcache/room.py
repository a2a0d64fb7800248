"""``Room``: the plan half of the shared core's check-then-apply protocol (torch-free).

Every operation that takes units (allocate, extend, copy-on-write) is first planned by a backend
hook into a :class:`Room`, without changing anything; the core calls :meth:`Room.check`, which
raises :class:`KVCacheFullError` when the units do not suffice, and only then the apply hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vmkv.kvcache.errors import KVCacheFullError

__all__ = ["Room"]


@dataclass
class Room:
    """What an operation needs against what it may use, in units (blocks or pages); built by a
    ``_plan_*`` hook without changing anything.

    Attributes:
        num_needed / num_available: fresh units it takes / units obtainable for it.
        needed_tokens / available_tokens / detail: the :class:`KVCacheFullError` if short
            (``available_tokens`` and ``detail`` may be callables, evaluated only then: plans on
            the per-step path are many, failures few; nothing changes between plan and check).
        payload: whatever the backend's apply hook wants back.
    """

    num_needed: int
    num_available: int
    needed_tokens: int
    available_tokens: int | Callable[[], int]
    detail: str | Callable[[], str]
    payload: object = None

    def check(self) -> None:
        """Raise :class:`KVCacheFullError` (nothing was changed) when the units do not suffice."""
        if self.num_needed > self.num_available:
            detail = self.detail() if callable(self.detail) else self.detail
            tokens = self.available_tokens
            raise KVCacheFullError(self.needed_tokens, tokens() if callable(tokens) else tokens, detail)
