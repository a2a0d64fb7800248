"""Iteration-level (continuous-batching) scheduler with chunked prefill and recompute preemption.

Each step (Orca's iteration-level scheduling, Yu et al., OSDI'22; vLLM's scheduler, Kwon et al.,
SOSP'23, section 4.5) gets a token budget of ``max_num_batched_tokens``:

1. running sequences that decode (one new token each), oldest first: before the step each gets
   one more backed position (``KVCache.extend(seq, 1)``).  When the cache is full the NEWEST
   running sequence is preempted by recompute (its KV freed, it goes back to the front of the
   waiting queue and later recomputes prompt + generated tokens), until the extension fits;
2. running sequences still prefilling (chunked prefill: a long prompt is split over steps, at
   most the remaining budget per step, as in Sarathi / vLLM's chunked prefill);
3. waiting sequences in FIFO order (preempted ones first), while the budget, ``max_num_seqs`` and
   the KV capacity allow (no admission in a step that preempted).  Admission allocates the whole
   prompt with its token ids, so the prefix cache reports cached leading tokens that are not
   recomputed (``num_computed_tokens`` starts at the hit count).  Without chunked prefill a prompt
   is allocated only when all its tokens fit the step's remaining budget: nothing is allocated that
   the step cannot run, so each admission is one prefix-cache lookup (no allocate/free retries).

Static reservation (``SchedulerConfig.kv_reservation`` other than ``"none"``,
:mod:`vmkv.engine.reservation`, the Orca baselines): admission backs ``min(prompt + estimated output,
max_model_len)`` positions at once (``allocate`` of the prompt, with its prefix-cache lookup, then one
``extend`` to the reservation, undone if it does not fit), so a running sequence never extends and
nothing is ever preempted; a request that does not fit waits at the head of the queue (FCFS, no
overtaking).  A fork (``n > 1``) does not share the parent's reserved range (its unwritten tail would
need copy-on-write memory later, which nothing set aside): the child waits at the front of the queue and
is admitted with a reservation of its own, its prompt found in the prefix cache when that is on.

Failure isolation: a KV call (allocate, extend, fork, free) that raises anything but
``KVCacheFullError`` fails only the sequence it was made for: the scheduler drops it (frees what it
holds, best effort) and reports it in ``SchedulerOutput.failed``; the engine then fails its request.
A fatal error (:func:`vmkv.engine.errors.is_fatal_error`) propagates.

The scheduler deals in sequence ids and counts only; the runner turns them into tensors.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence as Seq

from vmkv.engine.config import SchedulerConfig
from vmkv.engine.errors import is_fatal_error
from vmkv.engine.reservation import reserved_tokens
from vmkv.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from vmkv.kvcache.base import KVCache, KVCacheFullError

__all__ = ["ScheduledSeq", "SchedulerOutput", "TimedAllocator", "Scheduler"]

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: compute positions ``num_computed_tokens ..
    num_computed_tokens + num_new_tokens - 1``."""

    seq: Sequence
    num_computed_tokens: int
    num_new_tokens: int
    ahead: bool = False     # scheduled before the previous step's token reached the host

    @property
    def samples(self) -> bool:
        """The step reaches the sequence's last token, so a new token is sampled."""
        return self.ahead or self.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_new_tokens > 1 or self.num_computed_tokens < self.seq.prompt_len


@dataclass
class SchedulerOutput:
    """What one step computes.

    Attributes:
        scheduled: decodes first, then prefill chunks (batch order of the step).
        preempted: sequences preempted while scheduling this step.
        ignored: requests that can never fit in the KV cache (finished with ``"length"``).
        failed: ``(sequence, exception)`` for sequences whose KV call raised (not
            ``KVCacheFullError``); already dropped from the queues (``FINISHED``), KV freed.
    """

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    ignored: list[SequenceGroup] = field(default_factory=list)
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class _NotForked(Exception):
    """A fork under static reservation: the child is admitted with its own reservation instead."""


class TimedAllocator:
    """Forwards the cache's lifecycle calls and adds their wall time to ``time_s`` (seconds); the
    part made inside :meth:`overlapped` (scheduling a step ahead while the device runs the previous
    one) is also added to ``ahead_time_s``."""

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        self.time_s = 0.0
        self.ahead_time_s = 0.0
        self._overlapped = False

    @contextlib.contextmanager
    def overlapped(self):
        """Count the calls made inside as overlapping the device's work (``ahead_time_s``)."""
        self._overlapped, prev = True, self._overlapped
        try:
            yield
        finally:
            self._overlapped = prev

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            self.time_s += dt
            if self._overlapped:
                self.ahead_time_s += dt

    def allocate(self, seq_id: int, num_tokens: int, token_ids: Seq[int] | None,
                 extra_key: str | None = None) -> int:
        return self._timed(self.kv_cache.allocate, seq_id, num_tokens, token_ids, extra_key)

    def extend(self, seq_id: int, num_tokens: int) -> None:
        self._timed(self.kv_cache.extend, seq_id, num_tokens)

    def can_allocate(self, num_tokens: int) -> bool:
        return self._timed(self.kv_cache.can_allocate, num_tokens)

    def fork(self, parent_id: int, child_id: int) -> None:
        self._timed(self.kv_cache.fork, parent_id, child_id)

    def free(self, seq_id: int, written: bool = True) -> None:
        self._timed(self.kv_cache.free, seq_id, written=written)

    def seq_len(self, seq_id: int) -> int:
        return self.kv_cache.seq_len(seq_id)

    def has_seq(self, seq_id: int) -> bool:
        return self.kv_cache.has_seq(seq_id)


class Scheduler:
    """Owns the waiting queue and the running list; decides every step's batch.

    Args:
        config: budget and limits.
        allocator: the KV cache's lifecycle calls (timed).
        max_model_len: positions per sequence.
        enable_prefix_caching: pass prompt token ids to ``allocate``.
    Attributes:
        reservation: ``config.kv_reservation`` (``"none"``: KV grows on demand).
        num_reservation_overruns: extensions of a reserved sequence (0 unless the reservation was too
            small: an internal error, logged).
    """

    def __init__(self, config: SchedulerConfig, allocator: TimedAllocator, max_model_len: int,
                 enable_prefix_caching: bool = True) -> None:
        self.config = config
        self.alloc = allocator
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preempted_total = 0
        self.num_prefill_chunks_total = 0
        self.num_cached_tokens_total = 0
        #: admissions deferred because memory could not be obtained right now (KVCacheFullError.transient)
        self.num_transient_full = 0
        self.reservation = config.kv_reservation
        self.num_reservation_overruns = 0

    # ------------------------------------------------------------------ queues
    def add(self, group: SequenceGroup) -> None:
        """Queue a new request's parent sequence."""
        self.waiting.append(group.parent)

    @property
    def reserves(self) -> bool:
        """Does admission reserve every position a sequence can need (static reservation)?"""
        return self.reservation != "none"

    def reserved_len(self, seq: Sequence) -> int | None:
        """Positions ``seq`` reserves at admission: ``min(prompt + estimate, max_model_len)``, never
        below its current tokens; ``None`` without reservation."""
        n = reserved_tokens(self.reservation, seq.prompt_len, seq.group.params.max_tokens, self.max_model_len)
        return None if n is None else max(n, seq.num_tokens)

    def admission_len(self, seq: Sequence) -> int:
        """Positions admitting ``seq`` backs: its reservation, or its tokens without one (the hint
        ``kv_cache.prefetch_admission`` gets, so vmem maps a reservation's pages off the critical path)."""
        n = self.reserved_len(seq)
        return seq.num_tokens if n is None else n

    def reserved_unused_tokens(self) -> int:
        """Backed positions of the running sequences that no scheduled step has written (under
        reservation, the reserved-but-unused part; without it, at most the positions backed ahead)."""
        return sum(max(0, self.alloc.seq_len(s.seq_id) - s.num_computed_tokens) for s in self.running)

    def num_reserved_seqs(self) -> int:
        """Running sequences plus the forks their requests will still make."""
        return sum(s.group.num_seats(s) for s in self.running)

    def num_waiting(self) -> int:
        """Sequences waiting for admission (new, preempted or forks not yet admitted)."""
        return len(self.waiting)

    def upcoming_admissions(self) -> list[Sequence]:
        """The waiting sequences the next step would admit first (within the token budget and the
        free seats): ``kv_cache.prefetch_admission``'s hint."""
        out, budget = [], self.config.max_num_batched_tokens
        for seq in itertools.islice(self.waiting, max(0, self.config.max_num_seqs - len(self.running))):
            if budget <= 0:
                break
            out.append(seq)
            budget -= seq.num_tokens
        return out

    def finish(self, seq: Sequence) -> None:
        """Free a finished (or aborted) sequence's KV and drop it from the queues.  The queues are
        updated first, so they stay consistent even when ``free`` raises."""
        was_running = seq.status is SequenceStatus.RUNNING
        if was_running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        if was_running:
            self.alloc.free(seq.seq_id)

    def drop(self, seq: Sequence) -> None:
        """Take a failed sequence out of the scheduler whatever its state: out of the queues,
        ``FINISHED``, and its KV freed if the cache holds any (even half-made by a call that
        raised).  A ``free`` that raises is logged, not raised (the memory stays in use); a fatal
        one propagates."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        try:
            if self.alloc.has_seq(seq.seq_id):
                # its last prepare() may have registered prefix units a failed forward never wrote
                self.alloc.free(seq.seq_id, written=False)
        except Exception as exc:
            if is_fatal_error(exc):
                raise
            logger.exception("could not free the KV of failed seq %d (request %s); it stays allocated",
                             seq.seq_id, seq.group.request_id)

    def _fail(self, seq: Sequence, exc: Exception, out: SchedulerOutput) -> None:
        """A KV call for ``seq`` raised ``exc`` (not KVCacheFullError): re-raise a fatal one, else
        drop the sequence and report it in ``out.failed``."""
        if is_fatal_error(exc):
            raise exc
        logger.error("KV call for seq %d of request %s failed: %r; failing the request",
                     seq.seq_id, seq.group.request_id, exc)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.drop(seq)
        out.failed.append((seq, exc))

    def add_forked(self, parent: Sequence, child: Sequence) -> bool:
        """Fork ``parent``'s KV into ``child`` (made by ``SequenceGroup.fork``) and run it next to
        the parent.

        When the cache cannot take the fork (``KVCacheFullError``, e.g. no free vmem slot), the
        child waits at the front of the queue to recompute its prompt (prefix hits share it).
        Under reservation nothing is forked: the child waits the same way and is admitted with a
        reservation of its own (module docstring).
        Returns whether the fork succeeded.
        """
        try:
            if self.reserves:
                raise _NotForked("a reserved range is not shared; the child reserves its own KV")
            self.alloc.fork(parent.seq_id, child.seq_id)
        except (KVCacheFullError, _NotForked) as e:
            logger.debug("fork of seq %d into %d failed (%s); child will recompute",
                         parent.seq_id, child.seq_id, e)
            child.status = SequenceStatus.PREEMPTED
            child.num_computed_tokens = 0
            self.waiting.appendleft(child)
            return False
        child.status = SequenceStatus.RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        pos = self.running.index(parent) + 1
        while pos < len(self.running) and self.running[pos].group is parent.group:
            pos += 1
        self.running.insert(pos, child)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.alloc.free(seq.seq_id)
        self.running.remove(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preempted_total += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted seq %d of request %s (recompute %d tokens)",
                     seq.seq_id, seq.group.request_id, seq.num_tokens)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch and back its KV (see the module docstring)."""
        out = SchedulerOutput()
        self._fill(out, self.config.max_num_batched_tokens, preempt=True)
        return out

    def schedule_after(self, ahead: list[ScheduledSeq]) -> SchedulerOutput:
        """The step after one whose sampled tokens are still on the device (async scheduling):
        ``ahead`` (one token each, positions already backed, ``ahead=True``: their input is the
        previous step's sampled token) first, then what :meth:`schedule` would add with the rest
        of the budget (other decodes, prompt chunks, admissions), except that nothing is preempted:
        a sequence whose KV cannot be backed now waits for a later step.  The sequences whose token
        is in flight count as computed past it, so nothing else schedules them."""
        out = SchedulerOutput(scheduled=list(ahead))
        for s in ahead:
            s.seq.num_computed_tokens += 1
        self._fill(out, self.config.max_num_batched_tokens - len(ahead), preempt=False)
        return out

    def _fill(self, out: SchedulerOutput, budget: int, preempt: bool) -> None:
        """Decodes, then prompt chunks of the running sequences, then admissions, into ``out``
        (``preempt``: preempt the newest running sequences while the cache is full; otherwise
        skip a sequence that cannot be backed; never under reservation)."""
        chunked = self.config.enable_chunked_prefill
        preempt = preempt and not self.reserves
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue                                    # preempted earlier in this step
            num_new = seq.num_uncomputed_tokens
            if num_new > budget:
                if not chunked:
                    continue
                num_new = budget
            if preempt:
                budget = self._back(seq, seq.num_computed_tokens + num_new, out, budget)
                if seq.status is not SequenceStatus.RUNNING:
                    continue                                # it preempted itself
            elif not self._back_if_room(seq, seq.num_computed_tokens + num_new, out):
                continue
            self._take(seq, num_new, out)
            budget -= num_new
        if not out.preempted:
            self._admit(out, budget)

    def _back_if_room(self, seq: Sequence, needed_len: int, out: SchedulerOutput) -> bool:
        """Extend ``seq`` to ``needed_len`` positions if the cache has room now (no preemption);
        a KV call that fails otherwise fails the sequence.  Returns whether it is backed."""
        extra = needed_len - self.alloc.seq_len(seq.seq_id)
        if extra <= 0:
            return True
        if self.reserves:
            self.num_reservation_overruns += 1
            logger.error("reserved seq %d of request %s needs %d positions past its reservation",
                         seq.seq_id, seq.group.request_id, extra)
        try:
            self.alloc.extend(seq.seq_id, extra)
            return True
        except KVCacheFullError:
            return False
        except Exception as exc:                            # noqa: BLE001 - this sequence's failure
            self._fail(seq, exc, out)
            return False

    def _take(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        sched = ScheduledSeq(seq, seq.num_computed_tokens, num_new)
        out.scheduled.append(sched)
        if sched.is_prefill and not sched.samples:
            self.num_prefill_chunks_total += 1
        seq.num_computed_tokens += num_new

    def _back(self, seq: Sequence, needed_len: int, out: SchedulerOutput, budget: int) -> int:
        """Extend ``seq`` to ``needed_len`` positions, preempting the newest running sequences
        while the cache is full.  Returns the budget (refunded for preempted scheduled ones)."""
        while True:
            extra = needed_len - self.alloc.seq_len(seq.seq_id)
            if extra <= 0:
                return budget
            try:
                self.alloc.extend(seq.seq_id, extra)
                return budget
            except KVCacheFullError:
                victim = self.running[-1]
                for i, sched in enumerate(out.scheduled):
                    if sched.seq is victim:                 # undo its share of this step
                        budget += sched.num_new_tokens
                        del out.scheduled[i]
                        break
                try:
                    self._preempt(victim)
                except Exception as exc:                    # noqa: BLE001 - the victim's failure
                    self._fail(victim, exc, out)
                else:
                    out.preempted.append(victim)
                if victim is seq:
                    return budget
            except Exception as exc:                        # noqa: BLE001 - this sequence's failure
                self._fail(seq, exc, out)
                return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        chunked = self.config.enable_chunked_prefill
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            group = seq.group
            if self.num_reserved_seqs() + group.num_seats(seq) > self.config.max_num_seqs:
                break
            num_tokens = seq.num_tokens
            if not chunked and num_tokens > budget:
                break       # the step cannot run it: do not allocate (nor count a prefix lookup)
            token_ids = seq.all_token_ids() if self.enable_prefix_caching else None
            reserve = self.reserved_len(seq)
            if reserve is not None and (self.running or out.scheduled) and not self.alloc.can_allocate(reserve):
                break       # FCFS: the head waits for its whole reservation (no lookup, no retry)
            try:
                num_cached = self._allocate(seq, num_tokens, token_ids, reserve)
            except KVCacheFullError as e:
                if e.transient:     # memory held elsewhere right now: wait, retry next step
                    self.num_transient_full += 1
                    break
                if not self.running and not out.scheduled:
                    logger.warning("request %s can never fit in the KV cache (%s); finishing it "
                                   "with finish_reason='length'", group.request_id, e)
                    self.waiting.popleft()
                    out.ignored.append(group)
                    continue
                break
            except Exception as exc:                        # noqa: BLE001 - this sequence's failure
                self._fail(seq, exc, out)
                continue
            num_new = min(num_tokens - num_cached, budget)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            self.running.append(seq)
            self.num_cached_tokens_total += num_cached
            if not group.admitted:
                group.admitted = True
                group.num_cached_tokens = num_cached
            self._take(seq, num_new, out)
            budget -= num_new

    def _allocate(self, seq: Sequence, num_tokens: int, token_ids, reserve: int | None) -> int:
        """Allocate ``seq``'s ``num_tokens`` positions (prefix lookup with ``token_ids``), then extend
        it to ``reserve`` positions when reserving; a reservation that does not fit is undone and its
        ``KVCacheFullError`` raised.  Returns the prompt tokens found in the prefix cache."""
        num_cached = self.alloc.allocate(seq.seq_id, num_tokens, token_ids, seq.group.cache_salt)
        if reserve is not None and reserve > num_tokens:
            try:
                self.alloc.extend(seq.seq_id, reserve - num_tokens)
            except KVCacheFullError:
                self.alloc.free(seq.seq_id, written=False)
                raise
        return num_cached
