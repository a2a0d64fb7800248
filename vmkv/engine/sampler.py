"""Token sampling over a batch of logits: greedy, temperature, top-k, top-p, per-request seeds, and the
logits processing of :mod:`vmkv.engine.logits_processing` (``min_tokens``, ``logit_bias``, penalties,
``min_p``) for the rows that ask for it.

Order of operations as in vLLM's (v1) sampler: ``min_tokens``, ``logit_bias`` and the penalties (they may
change the argmax, so greedy rows get them too), the greedy rows' argmax, then divide by temperature, mask
to ``min_p``, mask to the top-k, mask to the top-p nucleus (Holtzman et al., "The Curious Case of Neural Text Degeneration", ICLR 2020,
section 3.1), softmax, then sample.  Sampling uses the exponential race
``argmax(p_i / E_i), E_i ~ Exp(1)`` (equivalent to the Gumbel-max trick), so seeded rows only
need their own noise vector drawn from their own ``torch.Generator``: a seeded request's samples
do not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vmkv.engine.host_copy import to_device
from vmkv.engine.logits_processing import LogitsProcessing, TokenCounts, apply_min_p, apply_penalties

__all__ = ["SamplingRow", "Sampler", "apply_top_k", "apply_top_p", "LogitsProcessing"]


@dataclass(frozen=True)
class SamplingRow:
    """How to sample one row of logits.

    Args:
        temperature: 0 (or below 1e-5) means greedy.
        top_k: keep the k largest logits (ties at the k-th kept); 0 disables; any k at or above
            the vocabulary size keeps every logit (clamped, never an error).
        top_p: nucleus mass in (0, 1]; 1 disables.
        generator: this row's own generator (seeded request), or ``None`` for the shared one.
        processing: ``min_tokens`` / ``logit_bias`` / penalties / ``min_p`` of the row, or ``None`` (none
            of them: the common case pays nothing for them).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    processing: LogitsProcessing | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask every logit below each row's k-th largest to ``-inf`` (ties with it are kept).

    Args:
        logits: ``float32 [num_rows, vocab_size]``.
        top_k: ``int64 [num_rows]``; 0 (or >= vocab_size) leaves the row unchanged.
    Returns:
        A new ``float32 [num_rows, vocab_size]`` tensor.
    """
    vocab = logits.shape[-1]
    k = top_k.clamp(min=0, max=vocab)
    k = torch.where(k == 0, torch.full_like(k, vocab), k)
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (k - 1).unsqueeze(1))                 # [num_rows, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most-likely tokens whose probability mass reaches ``top_p``.

    A token (in descending probability order) is kept iff the mass of the tokens before it is
    below ``top_p``; the most likely token is always kept.

    Args:
        logits: ``float32 [num_rows, vocab_size]`` (may hold ``-inf`` from top-k).
        top_p: ``float32 [num_rows]`` in (0, 1]; 1 leaves the row unchanged.
    Returns:
        A new ``float32 [num_rows, vocab_size]`` tensor, masked entries ``-inf``.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove_sorted = mass_before >= top_p.unsqueeze(1)
    remove_sorted[:, 0] = False
    remove_sorted &= (top_p < 1.0).unsqueeze(1)
    remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


class Sampler:
    """Samples one token per row of logits.

    Args:
        seed: seeds the shared generator used by rows without their own.
        device: the logits' device.

    Attributes:
        token_counts: the penalty rows' token statistics (:class:`TokenCounts`), updated by every
            :meth:`sample_device` with the tokens it draws for them.
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.token_counts = TokenCounts(self.device)

    def process(self, logits: torch.Tensor, rows: list[SamplingRow]
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The logits processing that may change the argmax: ``min_tokens`` suppression, ``logit_bias``,
        penalties, on the rows whose ``processing`` asks for them.

        Args:
            logits: ``[num_rows, vocab_size]`` (any float dtype).
        Returns:
            ``(logits, penalty_rows)``: ``logits`` itself when no row has processing, else a new
            ``float32 [num_rows, vocab_size]`` tensor, and ``(row indices int64 [k], slots int64 [k])`` of the rows with penalties, whose
            sampled tokens :meth:`sample_device` adds to :attr:`token_counts` (``None``: no such row).
        Raises:
            ValueError: a row with a penalty and no ``owner``.
        """
        procs = [(i, r.processing) for i, r in enumerate(rows) if r.processing is not None]
        if not procs:
            return logits, None
        logits = logits.to(torch.float32, copy=True)
        dev, vocab = logits.device, logits.shape[-1]
        # min_tokens: EOS and the stop token ids can not be drawn yet
        sup_rows = [i for i, p in procs for t in p.suppress_token_ids if 0 <= t < vocab]
        if sup_rows:
            sup_cols = [t for _, p in procs for t in p.suppress_token_ids if 0 <= t < vocab]
            logits.index_put_((to_device(sup_rows, torch.int64, dev), to_device(sup_cols, torch.int64, dev)),
                              logits.new_full((), float("-inf")))
        bias = [(i, t, b) for i, p in procs if p.logit_bias for t, b in p.logit_bias.items() if 0 <= t < vocab]
        if bias:
            b_rows, b_cols, b_vals = zip(*bias)
            logits.index_put_((to_device(b_rows, torch.int64, dev), to_device(b_cols, torch.int64, dev)),
                              to_device(b_vals, torch.float32, dev), accumulate=True)
        pen = [(i, p) for i, p in procs if p.uses_penalties]
        if not pen:
            return logits, None
        if any(p.owner is None for _, p in pen):
            raise ValueError("a row with a penalty needs LogitsProcessing.owner (whose token counts it reads)")
        idx = to_device([i for i, _ in pen], torch.int64, dev)
        slots = self.token_counts.slots([p for _, p in pen], vocab)
        counts, prompt_mask = self.token_counts.gather(slots)
        penalized = apply_penalties(
            logits.index_select(0, idx), counts, prompt_mask,
            to_device([p.repetition_penalty for _, p in pen], torch.float32, dev),
            to_device([p.frequency_penalty for _, p in pen], torch.float32, dev),
            to_device([p.presence_penalty for _, p in pen], torch.float32, dev))
        logits.index_copy_(0, idx, penalized)
        return logits, (idx, slots)

    def probabilities(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution each non-greedy row samples from: ``float32 [num_rows, vocab_size]``
        (greedy rows get temperature 1 and no masks).  ``logits`` are taken as :meth:`process` left
        them (this applies temperature, ``min_p``, top-k and top-p)."""
        logits = logits.float()
        dev = logits.device
        temps = to_device([1.0 if r.is_greedy else r.temperature for r in rows], torch.float32, dev)
        logits = logits / temps.unsqueeze(1)
        vocab = logits.shape[-1]
        if any(r.processing is not None and r.processing.min_p > 0 and not r.is_greedy for r in rows):
            m = to_device([0.0 if r.is_greedy or r.processing is None else r.processing.min_p for r in rows],
                          torch.float32, dev)
            logits = apply_min_p(logits, m)
        if any(0 < r.top_k < vocab and not r.is_greedy for r in rows):
            # clamped on the host: a k beyond the vocabulary keeps every token (and 2**63 would
            # not even fit the int64 tensor)
            k = to_device([0 if r.is_greedy or r.top_k >= vocab else max(r.top_k, 0) for r in rows],
                          torch.int64, dev)
            logits = apply_top_k(logits, k)
        if any(r.top_p < 1.0 and not r.is_greedy for r in rows):
            p = to_device([1.0 if r.is_greedy else r.top_p for r in rows], torch.float32, dev)
            logits = apply_top_p(logits, p)
        return logits.softmax(dim=-1)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """Sample one token id per row.

        Args:
            logits: ``[num_rows, vocab_size]`` (any float dtype; computed in float32).
            rows: one :class:`SamplingRow` per row.
        Returns:
            ``num_rows`` token ids.
        Raises:
            ValueError: ``len(rows)`` differs from the number of logit rows.
        """
        return self.sample_device(logits, rows).tolist()

    def sample_device(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """:meth:`sample` without the copy to the host: ``int64 [num_rows]`` on ``logits.device``
        (the engine copies it asynchronously, or feeds it to the next step as its input ids)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab_size], got {tuple(logits.shape)}")
        if not rows:
            return torch.zeros(0, dtype=torch.int64, device=logits.device)
        logits, penalty_rows = self.process(logits, rows)
        tokens = self._sample(logits, rows)
        if penalty_rows is not None:
            idx, slots = penalty_rows
            self.token_counts.add(slots, tokens.index_select(0, idx))
        return tokens

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = [r.is_greedy for r in rows]
        argmax = logits.argmax(dim=-1)
        if all(greedy):
            return argmax
        probs = self.probabilities(logits, rows)
        noise = torch.empty_like(probs)
        shared = [i for i, r in enumerate(rows) if r.generator is None and not r.is_greedy]
        if shared:
            draw = torch.empty((len(shared), probs.shape[1]), dtype=probs.dtype, device=probs.device)
            draw.exponential_(generator=self.generator)
            noise.index_copy_(0, to_device(shared, torch.int64, noise.device), draw)
        for i, r in enumerate(rows):
            if r.generator is not None and not r.is_greedy:
                noise[i].exponential_(generator=r.generator)
        for i, g in enumerate(greedy):
            if g:
                noise[i].fill_(1.0)
        sampled = (probs / noise.clamp_min(1e-20)).argmax(dim=-1)
        mask = to_device(greedy, torch.bool, sampled.device)
        return torch.where(mask, argmax, sampled)
