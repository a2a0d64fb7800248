"""Token sampling over a batch of logits: greedy, temperature, top-k, top-p, per-request seeds.

Order of operations as in vLLM's sampler: divide by temperature, mask to the top-k, mask to the
top-p nucleus (Holtzman et al., "The Curious Case of Neural Text Degeneration", ICLR 2020,
section 3.1), softmax, then sample.  Sampling uses the exponential race
``argmax(p_i / E_i), E_i ~ Exp(1)`` (equivalent to the Gumbel-max trick), so seeded rows only
need their own noise vector drawn from their own ``torch.Generator``: a seeded request's samples
do not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vmkv.engine.host_copy import to_device

__all__ = ["SamplingRow", "Sampler", "apply_top_k", "apply_top_p"]


@dataclass(frozen=True)
class SamplingRow:
    """How to sample one row of logits.

    Args:
        temperature: 0 (or below 1e-5) means greedy.
        top_k: keep the k largest logits (ties at the k-th kept); 0 disables; any k at or above
            the vocabulary size keeps every logit (clamped, never an error).
        top_p: nucleus mass in (0, 1]; 1 disables.
        generator: this row's own generator (seeded request), or ``None`` for the shared one.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

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
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def probabilities(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution each non-greedy row samples from: ``float32 [num_rows, vocab_size]``
        (greedy rows get temperature 1 and no masks)."""
        logits = logits.float()
        dev = logits.device
        temps = to_device([1.0 if r.is_greedy else r.temperature for r in rows], torch.float32, dev)
        logits = logits / temps.unsqueeze(1)
        vocab = logits.shape[-1]
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
