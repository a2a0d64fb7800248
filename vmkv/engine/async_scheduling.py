"""Async scheduling (vLLM's ``--async-scheduling``): step N+1 is scheduled, prepared and launched
before step N's sampled tokens reach the host, so the host work of a step (scheduling, ``prepare()``,
output processing) overlaps the device's forward of the next one.

A step whose sampling sequences all have ``n == 1`` is followed at once by a step *planned ahead*
(:func:`schedule_ahead`): one decode token for each sequence step N samples for, its input id the
token step N sampled, still on the device (these rows lead the batch), then the rest of the token
budget as a normal schedule would fill it (prompt chunks, admissions, other decodes; vLLM v1's async
scheduling also plans mixed steps ahead), without preemption: what cannot be backed waits a step.
Only then does the engine wait for step N's tokens and process them (stop checks, outputs) while
step N+1 runs, so the host's scheduling, KV allocation and ``prepare()`` of prefill steps overlap
the device as well.  A sequence that step N finishes by length is left out of the step ahead; one
that stops on a token or a string computed one token in vain (its result is dropped: the sequence
is finished when step N+1's output is processed).  Preemption, forks (``n > 1``) and a failed step
fall back to a normal step scheduled after the tokens arrive.  Outputs reach the caller one step
later than with synchronous scheduling; the tokens are the same (greedy) or drawn from the same
distributions.

KV safety: a sequence finished while the step ahead still runs frees its KV on the host; the device
writes of the step ahead come before anything later on the stream, and vmem never unmaps a freed
slot's pages before the fence recorded when it was freed (after the step ahead was enqueued).
"""

from __future__ import annotations

import logging

import torch

from vmkv.engine.errors import check_device, is_fatal_error
from vmkv.engine.host_copy import to_device
from vmkv.engine.runner import ModelRunner, PendingStep, StepResult
from vmkv.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from vmkv.engine.sequence import SequenceStatus

__all__ = ["StepDriver", "schedule_ahead"]

logger = logging.getLogger(__name__)


def schedule_ahead(scheduler: Scheduler, prev: SchedulerOutput) -> SchedulerOutput | None:
    """The step after ``prev``, planned before ``prev``'s sampled tokens reach the host.

    Every sequence ``prev`` samples for gets one decode token fed by that sample (``ahead``), unless
    the sample ends it by length; then the rest of the budget goes as :meth:`Scheduler.schedule`
    would give it (other decodes, prompt chunks, admissions), without preemption
    (:meth:`Scheduler.schedule_after`).  Returns ``None`` (schedule normally once the tokens arrive)
    when ``prev`` preempted, when a sequence it samples for has ``n > 1`` (it forks on its first
    token) or is no longer running as ``prev`` left it, or when such a sequence's next KV position
    is not backed yet (the runner backs it while ``prev`` runs); also when nothing is left to run.
    Advances ``num_computed_tokens`` of the sequences it schedules (like a normal schedule).
    """
    if prev.preempted or not prev.scheduled:
        return None
    ahead = []
    for s in prev.scheduled:
        if not s.samples:
            continue                    # a prompt chunk short of its end: scheduled again below
        seq = s.seq
        if (seq.status is not SequenceStatus.RUNNING or seq.group.params.n != 1
                or seq.num_computed_tokens != s.num_computed_tokens + s.num_new_tokens):
            return None
        if seq.ends_by_length_after(1, scheduler.max_model_len):
            continue                    # prev's token is its last: nothing to compute ahead
        if scheduler.alloc.seq_len(seq.seq_id) < seq.num_computed_tokens + 1:
            return None
        ahead.append(ScheduledSeq(seq, seq.num_computed_tokens, 1, ahead=True))
    out = scheduler.schedule_after(ahead)
    if out.is_empty and not out.failed:
        return None
    return out


def _next_input_ids(p: PendingStep, ahead: SchedulerOutput) -> torch.Tensor | None:
    """The input ids of the step ahead's leading ``ahead`` rows: ``p``'s sampled tokens (device),
    in the step ahead's order; ``None`` when it has no such rows."""
    lead = [s for s in ahead.scheduled if s.ahead]
    if not lead:
        return None
    row = {seq.seq_id: i for i, seq in enumerate(p.owners)}
    idx = [row[s.seq.seq_id] for s in lead]
    if idx == list(range(len(p.owners))):
        return p.tokens
    return p.tokens.index_select(0, to_device(idx, torch.int64, p.tokens.device))


class StepDriver:
    """Runs the engine's steps: schedule, launch, collect, with the failure isolation of the module
    docstring of :mod:`vmkv.engine.llm_engine`, and (``ahead``) one step planned ahead.

    Args:
        scheduler, runner, requests: the engine's.
        device: the model's device (an asynchronous kernel error is checked there).
        ahead: async scheduling (module docstring).
    Attributes:
        num_ahead_steps: steps launched before the previous step's tokens reached the host.
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, requests, device,
                 ahead: bool = False) -> None:
        self.scheduler, self.runner, self.requests = scheduler, runner, requests
        self.device = device
        self.ahead = bool(ahead)
        # the step launched ahead (or the exception its launch raised, failed at the next call)
        self.pending: tuple[SchedulerOutput, PendingStep | Exception] | None = None
        self.num_ahead_steps = 0

    def next(self) -> tuple[SchedulerOutput, StepResult]:
        """``(the step whose outputs are processed now, its result)``: the step planned ahead by
        the previous call if there is one, else a newly scheduled one; with ``ahead``, the step
        after it is launched before this one's tokens are waited for."""
        if self.pending is None:
            sched = self.scheduler.schedule()
            launched = self.launch(sched)
        else:
            (sched, launched), self.pending = self.pending, None
            if isinstance(launched, Exception):      # the step ahead failed to launch: fail its batch
                return sched, self._fail_batch(sched, launched)   # now (the finished are skipped)
        if not isinstance(launched, PendingStep):
            return sched, launched                  # nothing ran, or the step failed
        if self.ahead and launched.token_list is None and (launched.tokens is not None or not launched.rows):
            with self.scheduler.alloc.overlapped():       # the device runs `launched` meanwhile
                ahead = schedule_ahead(self.scheduler, sched)
            if ahead is not None:
                self._fail_unbacked(ahead)      # a KV call of the plan raised: that request fails now
            if ahead is not None and ahead.scheduled:
                try:
                    self.pending = (ahead, self.runner.launch(ahead, _next_input_ids(launched, ahead)))
                    self.num_ahead_steps += 1
                except Exception as exc:
                    if is_fatal_error(exc):
                        raise
                    # failed after this step's tokens are processed, not before: a request this step
                    # finishes keeps its result, the others keep this step's token
                    self.pending = (ahead, exc)
        return sched, self.collect(sched, launched)

    def drop_if_done(self) -> None:
        """Wait for a step launched ahead whose sequences have all finished since (a stop token or
        string, an abort) and drop it, so the next request's first step is not the leftover one."""
        if self.pending is not None and all(s.seq.is_finished for s in self.pending[0].scheduled):
            self.drain()

    def drain(self) -> None:
        """Wait for a step launched ahead and drop its result (before the KV cache closes, so no
        kernel of it still runs on memory being released)."""
        if self.pending is not None:
            (_, launched), self.pending = self.pending, None
            if not isinstance(launched, PendingStep):
                return                              # its launch failed: nothing runs
            try:
                self.runner.collect(launched)
            except Exception as exc:            # closing anyway: the error is only reported
                logger.warning("a step launched ahead failed while the engine closed: %r", exc)

    def _fail_unbacked(self, sched: SchedulerOutput) -> None:
        """Fail the requests whose KV call raised while ``sched`` was scheduled (the scheduler has
        dropped their sequences) and take them out of ``sched``."""
        for seq, exc in sched.failed:
            self.requests.fail(seq.group, "KV allocation", exc)
        if sched.failed:
            sched.scheduled = [s for s in sched.scheduled if not s.seq.is_finished]

    def launch(self, sched: SchedulerOutput, input_ids=None) -> PendingStep | StepResult:
        """Fail the requests the scheduler could not back, launch the rest (``runner.launch``); a
        failed launch fails the requests of the batch.  Returns the launched step, or the result
        when nothing runs."""
        self._fail_unbacked(sched)
        if sched.is_empty:
            return self.runner.idle()       # nothing to run: idle KV memory may go back (vmem)
        try:
            return self.runner.launch(sched, input_ids)
        except Exception as exc:
            return self._fail_batch(sched, exc)

    def collect(self, sched: SchedulerOutput, launched: PendingStep) -> StepResult:
        """Wait for a launched step's tokens; a sampling failure fails its request only."""
        try:
            result = self.runner.collect(launched)
        except Exception as exc:
            return self._fail_batch(sched, exc)
        for seq, exc in result.failed:
            self.requests.fail(seq.group, "sampling", exc)
        return result

    def _fail_batch(self, sched: SchedulerOutput, exc: Exception) -> StepResult:
        """A batch-wide failure (prepare, forward): fail the batch's requests, unless the error is
        fatal or the device reports one (then it propagates)."""
        if is_fatal_error(exc):
            raise exc
        try:
            check_device(self.device)       # an asynchronous kernel error surfaces here
        except Exception as sync_exc:
            raise sync_exc from exc
        logger.error("model forward failed; failing the %d request(s) of the batch",
                     len({s.seq.group.request_id for s in sched.scheduled}), exc_info=exc)
        for s in sched.scheduled:
            self.requests.fail(s.seq.group, "the model forward of its batch", exc)
        return StepResult()
