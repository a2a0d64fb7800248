"""Turns a scheduled step into tensors, runs the model through the KV cache, samples.

Per step (the plan/run split): ``meta = kv_cache.prepare([StepSeq, ...])`` once, then
``model.forward(input_ids, positions, kv_cache, meta)`` whose layers call
``kv_cache.write_kv`` + ``kv_cache.attention``; the logits of each sequence's last new token
come back as ``float32 [num_seqs, vocab_size]``.  While the GPU computes them (the forward is only
enqueued until sampling copies tokens to the host), ``kv_cache.prefetch`` backs the next positions
of the sampling sequences, so the next step's ``extend`` finds them mapped (vAttention, Prabhu et
al., ASPLOS'25, section 6.1: overlapping allocation with compute), and ``kv_cache.release_idle`` gives
idle KV memory back (elastic vmem; also on steps that schedule nothing, :meth:`ModelRunner.idle`).

Failure isolation: ``prepare`` and the forward are batch-wide, so an exception there propagates
(the engine fails the step's batch).  Sampling is per request: when the batched ``sample`` raises,
each request's rows are sampled alone and only the requests whose rows still raise fail
(:attr:`StepResult.failed`).  A failing ``prefetch`` (a hint) is logged and ignored.  Fatal errors
(:func:`vmkv.engine.errors.is_fatal_error`) always propagate.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from vmkv.engine.errors import is_fatal_error
from vmkv.engine.host_copy import to_device
from vmkv.engine.sampler import LogitsProcessing, Sampler, SamplingRow
from vmkv.engine.scheduler import SchedulerOutput
from vmkv.engine.sequence import Sequence
from vmkv.kvcache.base import KVCache, KVCacheFullError, StepSeq

__all__ = ["ModelRunner", "PendingStep", "StepResult"]

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What a step computed.

    Attributes:
        sampled: ``seq_id -> sampled token ids``: one token, or ``n`` for a request's parent whose
            prompt just finished and that still has ``n - 1`` completions to fork (row ``i`` is
            sampled for completion ``i``).  Sequences in a partial prefill chunk are absent.
        failed: ``(sequence, exception)`` for sequences whose sampling raised; absent from ``sampled``.
    """

    sampled: dict[int, list[int]] = field(default_factory=dict)
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)


@dataclass
class PendingStep:
    """A launched step (:meth:`ModelRunner.launch`) whose sampled tokens may still be on the device.

    Attributes:
        sched: the step.
        owners / rows / row_index: the sampling rows: their sequence, parameters and logit row.
        tokens: ``int64 [num_rows]`` sampled on the device (the next step's input ids when it is
            scheduled ahead); host / event: their pinned host copy and the event that marks it done.
        token_list: tokens already on the host (per-request sampling after a batched failure).
    """

    sched: SchedulerOutput
    owners: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    row_index: list = field(default_factory=list)
    selected: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    host: torch.Tensor | None = None
    event: object = None
    token_list: list | None = None
    result: StepResult = field(default_factory=StepResult)


class ModelRunner:
    """Runs one step of the model and samples.

    Args:
        model: ``forward(input_ids int64 [num_tokens], positions int64 [num_tokens], kv_cache,
            meta) -> float32 [num_seqs, vocab_size]``.
        kv_cache: the engine's cache.
        sampler: the engine's sampler.
        device: the model's device.
        prefetch_tokens: look-ahead in positions passed to ``kv_cache.prefetch`` every step for the
            sequences that sample (0: no prefetch).
        cuda_graphs: a captured :class:`~vmkv.engine.cuda_graphs.CUDAGraphRunner`: decode steps it
            fits are replayed (prepare into its static buffer, one replay); ``None``: all eager.
        upcoming: ``() -> waiting sequences`` the next step admits first (the scheduler's
            ``upcoming_admissions``); their lengths, token ids and cache salts go to
            ``kv_cache.prefetch_admission`` while the forward runs.
        num_waiting: ``() -> requests waiting for admission`` (the scheduler's ``num_waiting``),
            passed to ``kv_cache.release_idle``: memory does not go back while requests wait.
        admission_len: ``(sequence) -> positions its admission backs`` (the scheduler's
            ``admission_len``: a static reservation's length); ``None``: its tokens.
        eos_token_ids: the model's EOS ids, never sampled before a request's ``min_tokens``.

    Attributes:
        forward_time_s_total: seconds in :meth:`execute` (prepare, forward, prefetch, sampling).
        prefetch_time_s_total: seconds of that spent while the forward runs on the device: each
            sampling sequence's next position backed ahead (``kv_cache.extend(seq_id, 1)``, so the
            next schedule's ``extend`` has nothing to do), ``kv_cache.prefetch`` and
            ``kv_cache.prefetch_admission``.
        release_time_s_total: seconds in ``kv_cache.release_idle`` (elastic shrink), called every
            step after the forward is enqueued (next to prefetch) and by :meth:`idle`.
        num_graph_steps: steps replayed from a CUDA graph.
    """

    def __init__(self, model, kv_cache: KVCache, sampler: Sampler, device: torch.device,
                 prefetch_tokens: int = 0, cuda_graphs=None, upcoming=None, num_waiting=None,
                 eos_token_ids: tuple[int, ...] = (), admission_len=None) -> None:
        if isinstance(prefetch_tokens, bool) or not isinstance(prefetch_tokens, int) or prefetch_tokens < 0:
            raise ValueError(f"prefetch_tokens must be an int >= 0, got {prefetch_tokens!r}")
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = torch.device(device)
        self.prefetch_tokens = prefetch_tokens
        self.forward_time_s_total = 0.0
        self.prefetch_time_s_total = 0.0
        self.release_time_s_total = 0.0
        self.cuda_graphs = cuda_graphs
        self.num_graph_steps = 0
        self.upcoming = upcoming
        self.num_waiting = num_waiting
        self._admission_len = admission_len or (lambda seq: seq.num_tokens)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._pinned: list[torch.Tensor | None] = [None, None]
        self._turn = 0

    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Compute the scheduled tokens and sample where a sequence reached its last token
        (:meth:`launch` then :meth:`collect`).

        Raises:
            whatever ``prepare`` or the forward raise (batch-wide: nothing is sampled then).
        """
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, input_ids: torch.Tensor | None = None) -> PendingStep:
        """Enqueue the step: prepare, the forward (a graph replay for a decode step that fits one),
        the token-independent KV work while it runs (next positions, page prefetch, the next
        admissions' pages, idle release), the sampling kernels and the asynchronous copy of the
        sampled tokens to pinned host memory.  Nothing waits for the device.

        Args:
            input_ids: ``int64 [k]`` on the device: the token ids of the step's first ``k`` rows (one
                token each) when they are not on the host yet (a step scheduled ahead, fed the
                previous step's sampled tokens); the other rows' ids are read from the sequences.
                ``None``: every id read from the sequences.
        Raises:
            whatever ``prepare`` or the forward raise (batch-wide).
        """
        batch: list[StepSeq] = []
        ids: list[int] = []
        lead = 0 if input_ids is None else int(input_ids.shape[0])
        for i, s in enumerate(sched.scheduled):
            batch.append(StepSeq(s.seq.seq_id, s.num_computed_tokens, s.num_new_tokens))
            if i >= lead:
                ids.extend(s.seq.token_slice(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens))
        t0 = time.perf_counter()
        if input_ids is not None and ids:           # device ids first, then the host's
            input_ids = torch.cat((input_ids, to_device(ids, torch.int64, input_ids.device)))
        size = None if self.cuda_graphs is None else self.cuda_graphs.size_for(batch)
        if size is not None:
            logits = self.cuda_graphs.run(batch, ids if input_ids is None else input_ids, size)
            self.num_graph_steps += 1
        else:
            meta = self.kv_cache.prepare(batch)
            if input_ids is None:
                input_ids = to_device(ids, torch.int64, self.device)
            logits = self.model.forward(input_ids, meta.positions, self.kv_cache, meta)
        p = PendingStep(sched)
        for i, s in enumerate(sched.scheduled):
            if not s.samples:
                continue
            group = s.seq.group
            params = group.params
            for idx in group.sample_indices(s.seq):
                p.row_index.append(i)
                p.rows.append(SamplingRow(params.temperature, params.effective_top_k, params.top_p,
                                          group.generators[idx],
                                          self._processing(s, idx) if params.processes_logits else None))
                p.owners.append(s.seq)
        self._host_kv_work(p.owners)
        if p.rows:
            sel = to_device(p.row_index, torch.int64, logits.device)
            p.selected = logits.index_select(0, sel)
            try:
                p.tokens = self.sampler.sample_device(p.selected, p.rows)
            except Exception as exc:
                if is_fatal_error(exc):
                    raise
                logger.warning("batched sampling failed (%r); sampling each request alone", exc)
                p.token_list = self._sample_per_request(p.selected, p.rows, p.owners, p.result.failed)
            else:
                p.host, p.event = self._copy_to_host(p.tokens)
        self.forward_time_s_total += time.perf_counter() - t0
        return p

    def _processing(self, s, index: int) -> LogitsProcessing:
        """Completion ``index``'s logits processing in this step (its request has some:
        ``SamplingParams.processes_logits``).  ``min_tokens`` counts the output tokens the completion has
        before this sample: the sequence's, plus the token still on the device when the step was launched
        ahead (``s.ahead``); a completion forked from this row has none yet."""
        group = s.seq.group
        params = group.params
        num_output = len(s.seq.output_token_ids) + int(s.ahead) if index == s.seq.index else 0
        suppress: tuple[int, ...] = ()
        if num_output < params.min_tokens:
            suppress = tuple(params.stop_token_ids or ()) + (() if params.ignore_eos else self.eos_token_ids)
        return LogitsProcessing(suppress, params.logit_bias, params.repetition_penalty,
                                params.frequency_penalty, params.presence_penalty, params.min_p,
                                group, index, group.prompt_token_ids)

    def collect(self, p: PendingStep) -> StepResult:
        """Wait for a launched step's sampled tokens and return them per sequence."""
        t0 = time.perf_counter()
        tokens = p.token_list
        if tokens is None and p.rows:
            if p.event is not None:
                p.event.synchronize()
            tokens = p.host[:len(p.rows)].tolist()
        for seq, tok in zip(p.owners, tokens or ()):
            if tok is not None:
                p.result.sampled.setdefault(seq.seq_id, []).append(tok)
        self.forward_time_s_total += time.perf_counter() - t0
        return p.result

    def _host_kv_work(self, owners: list[Sequence]) -> None:
        """While the forward runs (nothing has synchronized yet): back the position each sampling
        sequence writes next step, map the pages of the steps after and of the next admissions,
        and give idle KV pages past the grace back (off the critical path of the next schedule)."""
        t1 = time.perf_counter()
        if owners:
            # n > 1: a parent forks after this step and parent and children then share the unit
            # they write: the schedule's extend makes it private (preempting if full), not this
            self._extend_ahead([o for o in dict.fromkeys(owners) if o.group.params.n == 1])
            if self.prefetch_tokens:
                self._prefetch(list(dict.fromkeys(o.seq_id for o in owners)))
        if self.upcoming is not None and self.kv_cache.wants_admission_hints:
            self._prefetch(None)
        self.prefetch_time_s_total += time.perf_counter() - t1
        self._release_idle()

    def _copy_to_host(self, tokens: torch.Tensor):
        """``(host int64 tensor, event or None)``: an asynchronous copy into one of two pinned
        buffers on CUDA (a step's buffer is read before the step after next reuses it), the tensor
        itself elsewhere."""
        if tokens.device.type != "cuda":
            return tokens, None
        self._turn ^= 1
        buf = self._pinned[self._turn]
        if buf is None or buf.numel() < tokens.numel():
            buf = self._pinned[self._turn] = torch.empty(max(256, tokens.numel()), dtype=torch.int64,
                                                         pin_memory=True)
        buf[:tokens.numel()].copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return buf, event

    def graph_stats(self) -> dict:
        """``EngineStats`` fields of the CUDA graphs: replayed steps, capture time and memory."""
        g = self.cuda_graphs
        return dict(num_cuda_graph_steps_total=self.num_graph_steps,
                    cuda_graph_capture_s=0.0 if g is None else g.capture_time_s,
                    cuda_graph_memory_bytes=0 if g is None else g.graph_memory_bytes)

    def idle(self) -> StepResult:
        """A step with nothing scheduled: idle KV memory may go back to the device
        (``kv_cache.release_idle``); nothing is computed."""
        self._release_idle()
        return StepResult()

    def _release_idle(self) -> None:
        t0 = time.perf_counter()
        try:
            self.kv_cache.release_idle(num_waiting=self.num_waiting() if self.num_waiting else 0)
        except Exception as exc:
            if is_fatal_error(exc):
                raise
            logger.warning("kv_cache.release_idle failed (memory stays held; ignored): %r", exc)
        self.release_time_s_total += time.perf_counter() - t0

    def _extend_ahead(self, seqs: list[Sequence]) -> None:
        """``extend(seq_id, 1)`` for sequences about to sample whose next position is not backed yet
        (a static reservation backs it already): they write that position next step unless they
        finish now (then ``free`` releases it with the rest).  A full cache or the end of
        ``max_model_len`` is left to the scheduler (it preempts or finishes), so nothing raises."""
        kv = self.kv_cache
        for seq in seqs:
            seq_id = seq.seq_id
            try:
                if kv.seq_len(seq_id) > seq.num_computed_tokens:
                    continue                   # backed (reserved at admission)
                kv.extend(seq_id, 1)
            except KVCacheFullError:
                return                     # full: the scheduler decides (preempts); the rest would fail too
            except Exception as exc:
                if is_fatal_error(exc):
                    raise
                continue                   # this one is at max_model_len: the scheduler finishes it

    def _prefetch(self, seq_ids: list[int] | None) -> None:
        """``kv_cache.prefetch`` of ``seq_ids``, or (``None``) ``prefetch_admission`` of the next
        admissions; hints: a failure is logged and ignored."""
        try:
            if seq_ids is None:
                seqs = self.upcoming()
                if seqs:
                    self.kv_cache.prefetch_admission([self._admission_len(q) for q in seqs],
                                                     [q.all_token_ids() for q in seqs],
                                                     [q.group.cache_salt for q in seqs])
            else:
                self.kv_cache.prefetch(seq_ids, self.prefetch_tokens)
        except Exception as exc:
            if is_fatal_error(exc):
                raise
            logger.warning("kv_cache.prefetch failed (a hint; ignored): %r", exc)

    def _sample_per_request(self, logits: torch.Tensor, rows: list[SamplingRow], owners: list[Sequence],
                            failed: list[tuple[Sequence, Exception]]) -> list[int | None]:
        """Sample each sequence's rows of ``logits`` (``float32 [num_rows, vocab_size]``) alone;
        a sequence whose sampling raises goes to ``failed`` and gets ``None`` tokens."""
        tokens: list[int | None] = [None] * len(rows)
        by_seq: dict[int, list[int]] = {}
        for i, seq in enumerate(owners):
            by_seq.setdefault(seq.seq_id, []).append(i)
        for idx in by_seq.values():
            seq = owners[idx[0]]
            try:
                sel = to_device(idx, torch.int64, logits.device)
                got = self.sampler.sample_device(logits.index_select(0, sel),
                                                 [rows[i] for i in idx]).tolist()
            except Exception as exc:
                if is_fatal_error(exc):
                    raise
                failed.append((seq, exc))
                continue
            for i, tok in zip(idx, got):
                tokens[i] = tok
        return tokens
