"""The KV-cache errors (torch-free): every backend raises these and only these."""

from __future__ import annotations

__all__ = ["KVCacheError", "KVCacheFullError", "UnknownSequenceError", "DuplicateSequenceError",
           "TooManySequencesError", "SlotsExhaustedError"]


class KVCacheError(RuntimeError):
    """Base class of the KV-cache errors."""


class KVCacheFullError(KVCacheError):
    """Not enough KV memory for a request.  The cache is left exactly as it was.

    Attributes:
        needed_tokens: token positions the operation needed backed.
        available_tokens: token positions that could still be backed (0 if unknown).
        transient: the memory exists but could not be obtained right now (the device or host
            refused a page another process holds: vmem's cuMemCreate out of memory); retrying
            later may succeed, so an empty engine waits instead of declaring the request too big.
    """

    def __init__(self, needed_tokens: int, available_tokens: int, detail: str = "", *,
                 transient: bool = False) -> None:
        self.needed_tokens = int(needed_tokens)
        self.available_tokens = int(available_tokens)
        self.transient = bool(transient)
        msg = (
            f"KV cache full: needed {self.needed_tokens} tokens, "
            f"{self.available_tokens} available"
        )
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class UnknownSequenceError(KVCacheError, KeyError):
    """The ``seq_id`` was never allocated or was already freed."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown sequence"


class DuplicateSequenceError(KVCacheError, ValueError):
    """``allocate``/``fork`` was given a ``seq_id`` that is already live."""


class TooManySequencesError(KVCacheFullError, ValueError):
    """``max_num_seqs`` sequences are already live (paged: block-table rows; vmem: slots).  Both a
    full cache and an out-of-range request for one more sequence, so it is a
    :class:`KVCacheFullError` and a ``ValueError``."""


#: the vmem backend's former name of :class:`TooManySequencesError` (one condition, one class)
SlotsExhaustedError = TooManySequencesError
