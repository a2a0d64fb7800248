"""The sequence table of the shared core: live sequences, their lengths, written marks and prefix
chains, and the validation every backend applies the same way (torch-free).

One rule for every count argument: an ``int`` (``bool`` is rejected, although Python counts it as
an int), in the documented range, else ``ValueError`` naming the value, the range and the fix.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from vmkv.kvcache.errors import DuplicateSequenceError, TooManySequencesError, UnknownSequenceError
from vmkv.kvcache.prefix import PrefixChain
from vmkv.kvcache.records import StepSeq

__all__ = ["SeqState", "SeqTable", "check_count"]


def check_count(name: str, value, low: int, high: int | None = None, fix: str = "") -> int:
    """``value`` as an int in ``[low, high]`` (``high=None``: no upper bound); bools are rejected.

    Raises:
        ValueError: naming ``name``, the value and the allowed range.
    """
    ok = not isinstance(value, bool)
    if ok:
        try:
            ok = int(value) == value
        except (TypeError, ValueError):
            ok = False
    if ok and low <= value and (high is None or value <= high):
        return int(value)
    rng = f"[{low}, {high}]" if high is not None else f">= {low}"
    raise ValueError(f"{name} must be an int {rng}, got {value!r}" + (f"; {fix}" if fix else ""))


class SeqState:
    """Host bookkeeping of one live sequence.

    Attributes:
        seq_id: its id.
        seq_len: positions backed.
        units: the backend's handle of its memory (paged: block table list; vmem: its slot).
        row: the backend's row for it (paged: host block-table row), or ``None``.
        marks: per layer, positions ``0..marks[l]-1`` hold K/V (feeds prefix registration only).
        prefix: the prompt's unit keys and how many are cached, or ``None`` (no prefix caching).
    """

    __slots__ = ("seq_id", "seq_len", "units", "row", "marks", "prefix")

    def __init__(self, seq_id: Hashable, seq_len: int, units, num_layers: int, written: int,
                 prefix: PrefixChain | None, row: int | None = None) -> None:
        self.seq_id, self.seq_len, self.units, self.prefix = seq_id, seq_len, units, prefix
        self.row = row
        self.marks = [written] * num_layers

    @property
    def written(self) -> int:
        """Positions written in every layer."""
        return min(self.marks)

    def mark(self, start: int, end: int, layers: Sequence[int] | None = None) -> bool:
        """Positions ``start..end-1`` were written in ``layers`` (all if ``None``); a mark only
        advances when the write touches it (no gap).  Returns whether every-layer progress may
        have changed (a registration is worth trying)."""
        marks = self.marks
        changed = False
        for layer in range(len(marks)) if layers is None else layers:
            if start <= marks[layer] < end:
                marks[layer] = end
                changed = True
        return changed

    def fork(self, child_id: Hashable, units, row: int | None = None) -> "SeqState":
        child = SeqState(child_id, self.seq_len, units, 0, 0,
                         None if self.prefix is None else self.prefix.copy(), row)
        child.marks = list(self.marks)
        return child


class SeqTable:
    """``seq_id -> SeqState`` with the checks of :class:`~vmkv.kvcache.base.KVCache`'s docstrings
    and a running ``num_used_tokens`` (sum of ``seq_len``; O(1) for ``usage()``).

    Args:
        max_num_seqs: live sequences at most.
        max_model_len: positions per sequence at most.
    """

    def __init__(self, max_num_seqs: int, max_model_len: int) -> None:
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self._seqs: dict[Hashable, SeqState] = {}
        self.num_used_tokens = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def __iter__(self):
        return iter(self._seqs)

    def __getitem__(self, seq_id: Hashable) -> SeqState:
        return self._seqs[seq_id]

    def values(self):
        return self._seqs.values()

    def items(self):
        return self._seqs.items()

    def get(self, seq_id: Hashable) -> SeqState:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}: never allocated or already freed") from None

    def lookup(self, seq_id: Hashable) -> SeqState | None:
        return self._seqs.get(seq_id)

    # ------------------------------------------------------------------ checks
    def check_new(self, seq_id: Hashable, num_tokens, token_ids: Sequence[int] | None) -> int:
        """Checks of ``allocate``: a new id, ``num_tokens`` in ``[1, max_model_len]``, ``token_ids``
        of that length, a free seat.  Returns ``num_tokens`` as an int."""
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already allocated; free it first "
                                         f"or use a new seq_id")
        n = check_count("num_tokens", num_tokens, 1, self.max_model_len, "max_model_len bounds it")
        if token_ids is not None and len(token_ids) != n:
            raise ValueError(f"token_ids has {len(token_ids)} ids, num_tokens is {n}; they must match")
        self.check_seat(n)
        return n

    def check_seat(self, num_tokens: int) -> None:
        if len(self._seqs) >= self.max_num_seqs:
            raise TooManySequencesError(
                num_tokens, 0, f"max_num_seqs reached: {len(self._seqs)} of {self.max_num_seqs} "
                               f"live; free a sequence first or raise max_num_seqs")

    def check_fork(self, parent_id: Hashable, child_id: Hashable) -> SeqState:
        parent = self.get(parent_id)
        if child_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {child_id!r} is already allocated; fork into a new id")
        self.check_seat(parent.seq_len)
        return parent

    def check_extend(self, seq_id: Hashable, num_tokens) -> tuple[SeqState, int]:
        """``(state, new seq_len)`` of ``extend(seq_id, num_tokens)``."""
        s = self.get(seq_id)
        n = check_count("num_tokens", num_tokens, 0)
        if s.seq_len + n > self.max_model_len:
            raise ValueError(f"sequence {seq_id!r}: seq_len {s.seq_len} + {n} exceeds max_model_len "
                             f"{self.max_model_len}")
        return s, s.seq_len + n

    def check_batch(self, batch: Sequence[StepSeq]) -> list[SeqState]:
        """States of a step's entries: known, distinct, ``computed + new <= seq_len`` (each entry's
        own ranges are checked by :class:`StepSeq`)."""
        if not batch:
            raise ValueError("prepare() needs at least one scheduled sequence")
        states = []
        seen: set = set()
        for e in batch:
            s = self.get(e.seq_id)
            if e.seq_id in seen:
                raise ValueError(f"sequence {e.seq_id!r} appears twice in the batch")
            seen.add(e.seq_id)
            end = e.num_computed_tokens + e.num_new_tokens
            if end > s.seq_len:
                raise ValueError(f"{e} writes up to position {end}, past seq_len {s.seq_len}; "
                                 f"extend() the sequence first")
            states.append(s)
        return states

    def check_range(self, s: SeqState, start, n: int) -> int:
        """Checks of ``write``: positions ``start..start+n-1`` below ``seq_len``."""
        if isinstance(start, bool) or int(start) != start or start < 0 or start + n > s.seq_len:
            raise ValueError(f"write of positions [{start}, {start + n}) outside [0, {s.seq_len}) "
                             f"(seq_len {s.seq_len}) of sequence {s.seq_id!r}; extend() it first")
        return int(start)

    # ------------------------------------------------------------------ changes
    def add(self, s: SeqState) -> None:
        self._seqs[s.seq_id] = s
        self.num_used_tokens += s.seq_len

    def set_len(self, s: SeqState, seq_len: int) -> None:
        self.num_used_tokens += seq_len - s.seq_len
        s.seq_len = seq_len

    def remove(self, s: SeqState) -> None:
        del self._seqs[s.seq_id]
        self.num_used_tokens -= s.seq_len

    def clear(self) -> None:
        self._seqs.clear()
        self.num_used_tokens = 0

    def check_integrity(self) -> None:
        if len(self._seqs) > self.max_num_seqs:
            raise AssertionError(f"{len(self._seqs)} live sequences > max_num_seqs {self.max_num_seqs}")
        total = sum(s.seq_len for s in self._seqs.values())
        if total != self.num_used_tokens:
            raise AssertionError(f"used tokens counter {self.num_used_tokens} != sum of seq_len {total}")
        for s in self._seqs.values():
            if not 0 < s.seq_len <= self.max_model_len:
                raise AssertionError(f"sequence {s.seq_id!r}: seq_len {s.seq_len} outside "
                                     f"[1, {self.max_model_len}]")
            if max(s.marks) > s.seq_len:
                raise AssertionError(f"sequence {s.seq_id!r}: written {s.marks} > seq_len {s.seq_len}")
            if s.prefix is not None and s.prefix.num_registered > len(s.prefix.keys):
                raise AssertionError(f"sequence {s.seq_id!r}: {s.prefix.num_registered} units "
                                     f"registered of {len(s.prefix.keys)}")
