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
from vmkv.engine.sampler import Sampler, SamplingRow
from vmkv.engine.scheduler import SchedulerOutput
from vmkv.engine.sequence import Sequence
from vmkv.kvcache.base import KVCache, StepSeq

__all__ = ["ModelRunner", "StepResult"]

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
        upcoming: ``() -> prompt lengths`` of the next admissions (the scheduler's
            ``upcoming_admissions``), passed to ``kv_cache.prefetch_admission`` while the forward runs.

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
                 prefetch_tokens: int = 0, cuda_graphs=None, upcoming=None) -> None:
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

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Compute the scheduled tokens and sample where a sequence reached its last token.

        Raises:
            whatever ``prepare`` or the forward raise (batch-wide: nothing is sampled then).
        """
        batch: list[StepSeq] = []
        ids: list[int] = []
        for s in sched.scheduled:
            batch.append(StepSeq(s.seq.seq_id, s.num_computed_tokens, s.num_new_tokens))
            ids.extend(s.seq.token_slice(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens))
        t0 = time.perf_counter()
        size = None if self.cuda_graphs is None else self.cuda_graphs.size_for(batch)
        if size is not None:
            logits = self.cuda_graphs.run(batch, ids, size)
            self.num_graph_steps += 1
        else:
            meta = self.kv_cache.prepare(batch)
            input_ids = torch.tensor(ids, dtype=torch.int64)
            if self.device.type != "cpu":
                input_ids = input_ids.to(self.device, non_blocking=True)
            logits = self.model.forward(input_ids, meta.positions, self.kv_cache, meta)
        row_index: list[int] = []
        rows: list[SamplingRow] = []
        owners: list[Sequence] = []
        for i, s in enumerate(sched.scheduled):
            if not s.samples:
                continue
            group = s.seq.group
            p = group.params
            for idx in group.sample_indices(s.seq):
                row_index.append(i)
                rows.append(SamplingRow(p.temperature, p.effective_top_k, p.top_p,
                                        group.generators[idx]))
                owners.append(s.seq)
        if owners:
            # the forward is enqueued, the host has not synchronized yet (sampling's .tolist()):
            # back the position each sampling sequence writes next step, and map the pages of the
            # steps after, while the GPU runs (off the critical path of the next step's schedule)
            t1 = time.perf_counter()
            seq_ids = list(dict.fromkeys(o.seq_id for o in owners))
            # n > 1: a parent forks after this step and parent and children then share the unit
            # they write: the schedule's extend makes it private (preempting if full), not this
            self._extend_ahead([o.seq_id for o in dict.fromkeys(owners) if o.group.params.n == 1])
            if self.prefetch_tokens:
                self._prefetch(seq_ids)
            self.prefetch_time_s_total += time.perf_counter() - t1
        if self.upcoming is not None:
            t1 = time.perf_counter()
            self._prefetch(None)
            self.prefetch_time_s_total += time.perf_counter() - t1
        self._release_idle()      # still before the sync: idle KV pages past the grace go back
        result = StepResult()
        if rows:
            sel = torch.tensor(row_index, dtype=torch.int64, device=logits.device)
            selected = logits.index_select(0, sel)
            try:
                tokens: list[int | None] = list(self.sampler.sample(selected, rows))
            except Exception as exc:
                if is_fatal_error(exc):
                    raise
                logger.warning("batched sampling failed (%r); sampling each request alone", exc)
                tokens = self._sample_per_request(selected, rows, owners, result.failed)
            for seq, tok in zip(owners, tokens):
                if tok is not None:
                    result.sampled.setdefault(seq.seq_id, []).append(tok)
        self.forward_time_s_total += time.perf_counter() - t0
        return result

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
            self.kv_cache.release_idle()
        except Exception as exc:
            if is_fatal_error(exc):
                raise
            logger.warning("kv_cache.release_idle failed (memory stays held; ignored): %r", exc)
        self.release_time_s_total += time.perf_counter() - t0

    def _extend_ahead(self, seq_ids: list[int]) -> None:
        """``extend(seq_id, 1)`` for sequences about to sample: they write that position next step
        unless they finish now (then ``free`` releases it with the rest).  A full cache or the end of
        ``max_model_len`` is left to the scheduler (it preempts or finishes), so nothing raises."""
        kv = self.kv_cache
        for seq_id in seq_ids:
            try:
                kv.extend(seq_id, 1)
            except Exception as exc:
                if is_fatal_error(exc):
                    raise
                return                     # full (or at max_model_len): the scheduler decides

    def _prefetch(self, seq_ids: list[int] | None) -> None:
        """``kv_cache.prefetch`` of ``seq_ids``, or (``None``) ``prefetch_admission`` of the next
        admissions; hints: a failure is logged and ignored."""
        try:
            if seq_ids is None:
                lengths = self.upcoming()
                if lengths:
                    self.kv_cache.prefetch_admission(lengths)
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
                sel = torch.tensor(idx, dtype=torch.int64, device=logits.device)
                got = self.sampler.sample(logits.index_select(0, sel), [rows[i] for i in idx])
            except Exception as exc:
                if is_fatal_error(exc):
                    raise
                failed.append((seq, exc))
                continue
            for i, tok in zip(idx, got):
                tokens[i] = tok
        return tokens
