"""Incremental detokenization and stop-string handling for streaming.

Incremental decoding follows vLLM's ``detokenize_incrementally``: decode a small window of ids
twice, ``ids[prefix_offset:read_offset]`` and ``ids[prefix_offset:]``, and emit the difference,
so tokenizers that strip a leading space from the first token of a decode (SentencePiece) or
whose tokens are partial UTF-8 bytes (byte-level BPE) still give the right text.  A window that
ends in U+FFFD (an incomplete UTF-8 sequence) emits nothing until the next token completes it.
The window starts on the last few prompt tokens, so the first output token keeps its leading
space as it would in the full text.

Stop strings: the output text ends right before the first occurrence of any stop string.  Text
that could still become the start of a stop string is held back from the emitted text, so the
emitted text only ever grows (append-only streaming).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["IncrementalDetokenizer", "find_stop_string", "stop_holdback_len"]

#: prompt tokens the first decoding window starts on (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
INITIAL_OFFSET = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas.

    Args:
        tokenizer: a ``transformers`` tokenizer (anything with ``decode(ids,
            skip_special_tokens=...)``).
        prompt_token_ids: the prompt's ids; its last :data:`INITIAL_OFFSET` give context.
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-INITIAL_OFFSET:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip,
                                      clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> str:
        """Append one output token; returns the new text it completes (may be ``""``)."""
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still pending at the end of the output (an incomplete UTF-8 tail, as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith(_REPLACEMENT)):
            delta = full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        if final:
            self._prefix_offset = self._read_offset = len(self._ids)
        return ""


def find_stop_string(text: str, stop: Sequence[str], new_text_len: int) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last ``new_text_len`` characters of ``text``.

    Returns:
        ``(index, stop_string)``: where the stop string starts in ``text``, or ``None``.
    """
    best: tuple[int, str] | None = None
    for s in stop:
        start = max(0, len(text) - new_text_len - len(s) + 1)
        idx = text.find(s, start)
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, s)
    return best


def stop_holdback_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string.

    That many trailing characters are held back from the emitted text until more text shows
    whether a stop string starts there.
    """
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold
