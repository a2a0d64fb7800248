"""The engine's requests: unfinished ones by id, finished ones not yet reported, and how a request
ends early (abort, failure).

Failure isolation's bookkeeping half (the engine's module docstring has the rules): a failed request
is finished at once, every one of its sequences dropped from the scheduler (KV freed),
``RequestOutput.error`` says what failed, and its unfinished completions get
``finish_reason="error"``; it is reported by the engine's next output.
"""

from __future__ import annotations

import logging
import time

from vmkv.engine.errors import is_fatal_error
from vmkv.engine.outputs import RequestOutput
from vmkv.engine.scheduler import Scheduler
from vmkv.engine.sequence import SequenceGroup

__all__ = ["RequestTable"]

logger = logging.getLogger(__name__)


class RequestTable:
    """Unfinished requests by id and finished ones waiting to be reported.

    Args:
        scheduler: drops the sequences of a request that ends early.

    Attributes:
        groups: ``request_id -> SequenceGroup`` of every unfinished request.
        num_finished_total: requests finished (any reason).
        num_failed_total: requests failed by an exception.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.groups: dict[str, SequenceGroup] = {}
        self._unreported: list[SequenceGroup] = []
        self.num_finished_total = 0
        self.num_failed_total = 0

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def has_unreported(self) -> bool:
        return bool(self._unreported)

    def add(self, group: SequenceGroup) -> None:
        """Track a new request and queue it in the scheduler.

        Raises:
            ValueError: its id is in use by an unfinished request.
        """
        if group.request_id in self.groups:
            raise ValueError(f"request id {group.request_id!r} is already in use by an unfinished request")
        self.groups[group.request_id] = group
        self.scheduler.add(group)

    def take_unreported(self) -> list[SequenceGroup]:
        """Requests that ended outside a step's output processing (abort, failure) since the last call."""
        out, self._unreported = self._unreported, []
        return out

    def finish(self, group: SequenceGroup, now: float) -> None:
        """Record that ``group`` finished (idempotent)."""
        if group.metrics.finished_time is not None:
            return
        group.metrics.finished_time = now
        self.groups.pop(group.request_id, None)
        self.num_finished_total += 1

    def finish_never_fits(self, group: SequenceGroup, now: float) -> None:
        """Finish a request the KV cache can never hold (``SchedulerOutput.ignored``) with ``"length"``."""
        group.cancel_forks()
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "length"
        self.finish(group, now)

    def abort(self, request_id: str) -> None:
        """Finish a request with ``"abort"`` and free its KV now; unknown/finished ids are ignored."""
        group = self.groups.get(request_id)
        if group is None or group.is_finished:
            return
        group.aborted = True
        group.cancel_forks()
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.drop(seq)        # never raises for a free that fails (logged)
                seq.finish_reason = "abort"
        self.finish(group, time.perf_counter())
        self._unreported.append(group)

    def finish_sequence(self, request_id: str, index: int, stop_reason: str | int | None) -> None:
        """Finish completion ``index`` of a request with ``"stop"`` now and free its KV: a stop
        string found by whoever detokenizes (the server's front process).  The request finishes
        when it was its last unfinished completion; unknown ids, indices and finished completions
        are ignored."""
        group = self.groups.get(request_id)
        if group is None or group.is_finished:
            return
        seq = next((s for s in group.seqs if s.index == index), None)
        if seq is None or seq.is_finished:
            return
        self.scheduler.drop(seq)
        seq.finish_reason, seq.stop_reason = "stop", stop_reason
        if group.is_finished:
            self.finish(group, time.perf_counter())
            self._unreported.append(group)

    def fail(self, group: SequenceGroup, stage: str, exc: BaseException) -> None:
        """Fail ``group`` because ``exc`` was raised in ``stage``: drop every sequence (KV freed),
        mark unfinished completions ``"error"``; reported with the step's outputs."""
        if group.error is not None or group.metrics.finished_time is not None:
            return
        group.error = f"request {group.request_id} failed in {stage}: {type(exc).__name__}: {exc}"
        logger.warning("%s", group.error)
        group.cancel_forks()
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.drop(seq)
                seq.finish_reason = "error"
            elif seq.finish_reason is None:             # dropped by the scheduler
                seq.finish_reason = "error"
        self.num_failed_total += 1
        self.finish(group, time.perf_counter())
        self._unreported.append(group)

    def fail_all(self, exc: BaseException) -> list[SequenceGroup]:
        """Last resort for an exception no request can be blamed for: fail every unfinished
        request, so the scheduler is empty and consistent again; returns them all (to report)."""
        for group in list(self.groups.values()):
            try:
                self.fail(group, "an engine step that failed outside any request's stage", exc)
            except Exception as drop_exc:
                if is_fatal_error(drop_exc):
                    raise
                logger.exception("could not fail request %s cleanly", group.request_id)
                self.groups.pop(group.request_id, None)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        return self.take_unreported()
