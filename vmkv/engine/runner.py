"""Turns a scheduled step into tensors, runs the model through the KV cache, samples.

Per step (the plan/run split): ``meta = kv_cache.prepare([StepSeq, ...])`` once, then
``model.forward(input_ids, positions, kv_cache, meta)`` whose layers call
``kv_cache.write_kv`` + ``kv_cache.attention``; the logits of each sequence's last new token
come back as ``float32 [num_seqs, vocab_size]``.  While the GPU computes them (the forward is only
enqueued until sampling copies tokens to the host), ``kv_cache.prefetch`` backs the next positions
of the sampling sequences, so the next step's ``extend`` finds them mapped (vAttention, Prabhu et
al., ASPLOS'25, section 6.1: overlapping allocation with compute).
"""

from __future__ import annotations

import time

import torch

from vmkv.engine.sampler import Sampler, SamplingRow
from vmkv.engine.scheduler import SchedulerOutput
from vmkv.kvcache.base import KVCache, StepSeq

__all__ = ["ModelRunner"]


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

    Attributes:
        forward_time_s_total: seconds in :meth:`execute` (prepare, forward, prefetch, sampling).
        prefetch_time_s_total: seconds of that in ``kv_cache.prefetch``.
    """

    def __init__(self, model, kv_cache: KVCache, sampler: Sampler, device: torch.device,
                 prefetch_tokens: int = 0) -> None:
        if isinstance(prefetch_tokens, bool) or not isinstance(prefetch_tokens, int) or prefetch_tokens < 0:
            raise ValueError(f"prefetch_tokens must be an int >= 0, got {prefetch_tokens!r}")
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = torch.device(device)
        self.prefetch_tokens = prefetch_tokens
        self.forward_time_s_total = 0.0
        self.prefetch_time_s_total = 0.0

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> dict[int, list[int]]:
        """Compute the scheduled tokens and sample where a sequence reached its last token.

        Returns:
            ``seq_id -> sampled token ids``: one token, or ``n`` for a request's parent whose
            prompt just finished and that still has ``n - 1`` completions to fork (row ``i`` is
            sampled for completion ``i``).  Sequences in a partial prefill chunk are absent.
        """
        batch: list[StepSeq] = []
        ids: list[int] = []
        for s in sched.scheduled:
            batch.append(StepSeq(s.seq.seq_id, s.num_computed_tokens, s.num_new_tokens))
            ids.extend(s.seq.token_slice(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens))
        t0 = time.perf_counter()
        meta = self.kv_cache.prepare(batch)
        input_ids = torch.tensor(ids, dtype=torch.int64)
        if self.device.type != "cpu":
            input_ids = input_ids.to(self.device, non_blocking=True)
        logits = self.model.forward(input_ids, meta.positions, self.kv_cache, meta)
        row_index: list[int] = []
        rows: list[SamplingRow] = []
        owners: list[int] = []
        for i, s in enumerate(sched.scheduled):
            if not s.samples:
                continue
            group = s.seq.group
            p = group.params
            indices = [s.seq.index]
            if s.seq.index == 0 and group.num_pending_forks:
                indices += list(range(p.n - group.num_pending_forks, p.n))
            for idx in indices:
                row_index.append(i)
                rows.append(SamplingRow(p.temperature, p.effective_top_k, p.top_p,
                                        group.generators[idx]))
                owners.append(s.seq.seq_id)
        if self.prefetch_tokens and owners:
            # the forward is enqueued, the host has not synchronized yet (sampling's .tolist()):
            # map the pages the next steps will need while the GPU runs
            t1 = time.perf_counter()
            self.kv_cache.prefetch(list(dict.fromkeys(owners)), self.prefetch_tokens)
            self.prefetch_time_s_total += time.perf_counter() - t1
        result: dict[int, list[int]] = {}
        if rows:
            sel = torch.tensor(row_index, dtype=torch.int64, device=logits.device)
            tokens = self.sampler.sample(logits.index_select(0, sel), rows)
            for seq_id, tok in zip(owners, tokens):
                result.setdefault(seq_id, []).append(tok)
        self.forward_time_s_total += time.perf_counter() - t0
        return result
