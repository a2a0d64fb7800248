"""What the sampler does to a row's logits besides temperature, top-k and top-p: ``min_tokens``,
``logit_bias``, the repetition / frequency / presence penalties, and ``min_p``.

Order (vLLM v1's sampler): the processors that can change the argmax run first, on every row that asks
for them, greedy rows included: ``min_tokens`` (EOS and the stop token ids to ``-inf``), ``logit_bias``,
then the penalties; the sampler then takes the greedy rows' argmax, divides the other rows by their
temperature, applies ``min_p`` (:func:`apply_min_p`), then top-k and top-p.

Penalties need each completion's token statistics: how often every vocabulary id occurs in its output so
far, and which ids its prompt holds.  :class:`TokenCounts` keeps them on the logits' device in two tables
with one row ("slot") per completion that uses a penalty, made when it first samples: the prompt's row
once (one scatter of its ids), the output's row updated by the sampler right after each sampling kernel
with the tokens it just drew (one ``index_put_`` per step for the whole batch, on the device).  So a step
costs the penalty rows one gather of their slots, never a Python pass over their tokens or over the
vocabulary, and the statistics stay right under async scheduling: the step launched before the previous
step's tokens reach the host reads tables those tokens were already added to, in stream order.  A
sampled token is only ever dropped for a completion that has finished (a stop token or string found
while the step ahead ran), whose slot is free from then on.  Requests without penalties never touch the
tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from vmkv.engine.host_copy import to_device

__all__ = ["LogitsProcessing", "TokenCounts", "apply_penalties", "apply_min_p"]


@dataclass(frozen=True)
class LogitsProcessing:
    """A row's logits processing (``SamplingRow.processing``; ``None`` there: none of it).

    Args:
        suppress_token_ids: ids whose logit is set to ``-inf`` (``min_tokens`` not reached yet: the EOS
            ids and the stop token ids); ids outside the vocabulary are ignored.
        logit_bias: ``{token_id: bias}`` added to the logits (ids outside the vocabulary ignored).
        repetition_penalty / frequency_penalty / presence_penalty: as ``SamplingParams``; neutral values
            1, 0, 0.
        min_p: in [0, 1]; 0 disables it.
        owner / index: whose token statistics the penalties read: a request (anything with an
            ``is_finished`` property: its slots are reused once it is finished) and the completion's
            index in it.  Needed only when a penalty is on.
        prompt_token_ids: the prompt (read once, when the completion's slot is made).
    """

    suppress_token_ids: tuple[int, ...] = ()
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    owner: Any = None
    index: int = 0
    prompt_token_ids: Sequence[int] = ()

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties (``apply_penalties``), without a host synchronisation.

    A token in the prompt or the output has its logit divided by ``repetition`` when positive and
    multiplied by it otherwise; then ``frequency * count`` and ``presence * (count > 0)`` are subtracted,
    counts over the output only (OpenAI's definition).

    Args:
        logits: ``float32 [num_rows, vocab_size]``.
        output_counts: ``int32 [num_rows, vocab_size]``: occurrences of each id in the row's output.
        prompt_mask: ``bool [num_rows, vocab_size]``: the ids in the row's prompt.
        repetition: ``float32 [num_rows]`` (> 0; 1 is neutral).
        frequency, presence: ``float32 [num_rows]`` (0 is neutral).
    Returns:
        A new ``float32 [num_rows, vocab_size]`` tensor.
    """
    in_output = output_counts > 0
    rep = torch.where(prompt_mask | in_output, repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    return (logits - frequency.unsqueeze(1) * output_counts
            - presence.unsqueeze(1) * in_output.to(logits.dtype))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask every token whose probability is below ``min_p`` times the row's largest (vLLM's min-p).

    Args:
        logits: ``float32 [num_rows, vocab_size]``, temperature applied (may hold ``-inf``).
        min_p: ``float32 [num_rows]`` in [0, 1]; 0 leaves the row unchanged.
    Returns:
        A new ``float32 [num_rows, vocab_size]`` tensor, masked entries ``-inf``.
    """
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


class TokenCounts:
    """Per-completion token statistics on the device, for the rows that use penalties (module docstring).

    Args:
        device: the logits' device.

    Attributes:
        output_counts: ``int32 [capacity, vocab_size]``: occurrences of each id in a slot's output so far.
        prompt_mask: ``bool [capacity, vocab_size]``: the ids in a slot's prompt.
        Both ``None`` until the first completion with a penalty samples; the capacity doubles when every
        slot is held by an unfinished request.
    """

    INITIAL_CAPACITY = 4

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self._slots: dict[tuple[Any, int], int] = {}
        self._free: list[int] = []

    @property
    def num_slots(self) -> int:
        """Slots held (by completions whose request may still be running)."""
        return len(self._slots)

    @property
    def capacity(self) -> int:
        return 0 if self.output_counts is None else int(self.output_counts.shape[0])

    def slots(self, procs: Sequence[LogitsProcessing], vocab_size: int) -> torch.Tensor:
        """``int64 [len(procs)]`` on the device: each completion's slot, made (its prompt recorded) the
        first time it is asked for."""
        out = []
        for p in procs:
            slot = self._slots.get((p.owner, p.index))
            if slot is None:
                slot = self._new_slot((p.owner, p.index), p.prompt_token_ids, vocab_size)
            out.append(slot)
        return to_device(out, torch.int64, self.device)

    def add(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one sampled token per slot (device tensors, ``int64 [k]`` each; no host sync)."""
        assert self.output_counts is not None, "TokenCounts.add before any slot was made"
        ones = torch.ones(token_ids.shape, dtype=self.output_counts.dtype, device=self.output_counts.device)
        self.output_counts.index_put_((slots, token_ids), ones, accumulate=True)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output counts int32 [k, vocab_size], prompt mask bool [k, vocab_size])`` of ``slots``."""
        assert self.output_counts is not None and self.prompt_mask is not None, "no slot was made"
        return self.output_counts.index_select(0, slots), self.prompt_mask.index_select(0, slots)

    def _new_slot(self, key: tuple[Any, int], prompt_token_ids: Sequence[int], vocab_size: int) -> int:
        if self.output_counts is None or int(self.output_counts.shape[1]) != vocab_size:
            self._allocate(self.INITIAL_CAPACITY, vocab_size)
        if not self._free:
            self._reclaim()
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.output_counts[slot].zero_()
        self.prompt_mask[slot].zero_()
        if len(prompt_token_ids):
            ids = to_device(list(prompt_token_ids), torch.int64, self.device)
            self.prompt_mask[slot].index_fill_(0, ids.clamp(0, vocab_size - 1), True)
        self._slots[key] = slot
        return slot

    def _allocate(self, capacity: int, vocab_size: int) -> None:
        self.output_counts = torch.zeros((capacity, vocab_size), dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros((capacity, vocab_size), dtype=torch.bool, device=self.device)
        self._slots.clear()
        self._free = list(range(capacity - 1, -1, -1))

    def _reclaim(self) -> None:
        """Free the slots of finished requests."""
        for key, slot in list(self._slots.items()):
            if key[0] is None or getattr(key[0], "is_finished", True):
                del self._slots[key]
                self._free.append(slot)

    def _grow(self) -> None:
        old = self.capacity
        counts, mask = self.output_counts, self.prompt_mask
        self.output_counts = torch.zeros((2 * old, counts.shape[1]), dtype=counts.dtype, device=self.device)
        self.prompt_mask = torch.zeros((2 * old, mask.shape[1]), dtype=mask.dtype, device=self.device)
        self.output_counts[:old].copy_(counts)
        self.prompt_mask[:old].copy_(mask)
        self._free.extend(range(2 * old - 1, old - 1, -1))
