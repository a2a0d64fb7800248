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

:class:`OutputText` (detokenization + stop strings + hold-back) and :class:`DeltaTracker` (what is new
since the previous output) are one completion's text state.  They live here once and serve both the
in-process engine (:class:`~vmkv.engine.sequence.Sequence`) and the server's front process, which
detokenizes the token ids the engine core process sends (:mod:`vmkv.server.output_processor`).
"""

from __future__ import annotations

from typing import Sequence

from vmkv.engine.outputs import CompletionOutput, ListPrefix

__all__ = ["IncrementalDetokenizer", "OutputText", "DeltaTracker", "find_stop_string", "stop_holdback_len"]

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


class OutputText:
    """One completion's output text: incremental detokenization, stop strings and the held-back tail.

    Args:
        tokenizer: as :class:`IncrementalDetokenizer`.
        prompt_token_ids: the prompt's ids (decoding context for the first output token).
        stop: stop strings (``None`` or empty: none).
        skip_special_tokens: leave special tokens out of the text.
        min_tokens: stop strings are looked for only in the text of output token ``min_tokens + 1`` on
            (vLLM: a stop string cannot end the output before ``min_tokens`` tokens).
        include_stop_str: the text keeps the stop string that ends it (vLLM's
            ``include_stop_str_in_output``); nothing is held back then.

    Attributes:
        text: the decoded output, cut before a stop string once one is found (after it with
            ``include_stop_str``), including a tail that may still become a stop string (see
            :meth:`emitted`).
        include_stop_str: as given.
    """

    __slots__ = ("_detok", "_stop", "_min_tokens", "_num_tokens", "include_stop_str", "text")

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] | None,
                 skip_special_tokens: bool = True, *, min_tokens: int = 0, include_stop_str: bool = False) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stop = list(stop or ())
        self._min_tokens = int(min_tokens)
        self._num_tokens = 0
        self.include_stop_str = bool(include_stop_str)
        self.text = ""

    @classmethod
    def for_params(cls, tokenizer, prompt_token_ids: Sequence[int], params) -> "OutputText":
        """The text state of a completion with these ``SamplingParams`` (stop strings, special tokens,
        ``min_tokens``, ``include_stop_str_in_output``): the engine's and the server front's, alike."""
        return cls(tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens,
                   min_tokens=params.min_tokens, include_stop_str=params.include_stop_str_in_output)

    def add_token(self, token_id: int, final: bool) -> str | None:
        """Decode one more output token (``final``: it is the last one; flush the decoder).

        Returns:
            the stop string the new text completed (``text`` is then cut right before it, or right
            after it with ``include_stop_str``), or ``None``.
        """
        self._num_tokens += 1
        delta = self._detok.add_token(token_id)
        if final:
            delta += self._detok.flush()
        if not delta:
            return None
        self.text += delta
        if self._stop and self._num_tokens > self._min_tokens:
            hit = find_stop_string(self.text, self._stop, len(delta))
            if hit is not None:
                idx, s = hit
                self.text = self.text[:idx + len(s) if self.include_stop_str else idx]
                return s
        return None

    def emitted(self, finished: bool) -> str:
        """Text that may be shown: everything once ``finished``, else without a tail that could be the
        start of a stop string (nothing is held back with ``include_stop_str``: the text before a stop
        string is output either way)."""
        if finished or not self._stop or self.include_stop_str:
            return self.text
        hold = stop_holdback_len(self.text, self._stop)
        return self.text[:len(self.text) - hold] if hold else self.text


class DeltaTracker:
    """How much of a completion its previous output reported; builds the next
    :class:`~vmkv.engine.outputs.CompletionOutput` with the delta since then in O(new tokens)."""

    __slots__ = ("num_tokens", "num_chars")

    def __init__(self) -> None:
        self.num_tokens = 0
        self.num_chars = 0

    def output(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
               stop_reason: str | int | None) -> CompletionOutput:
        """The completion's output now; ``token_ids`` is the append-only list of its output ids (the
        output holds a :class:`ListPrefix` of it, not a copy)."""
        num_tokens = len(token_ids)
        assert len(text) >= self.num_chars, f"emitted text shrank from {self.num_chars} to {len(text)} chars"
        delta_text = text[self.num_chars:]
        delta_ids = token_ids[self.num_tokens:]
        self.num_tokens, self.num_chars = num_tokens, len(text)
        return CompletionOutput(index=index, text=text, token_ids=ListPrefix(token_ids, num_tokens),
                                finish_reason=finish_reason, stop_reason=stop_reason,
                                delta_text=delta_text, delta_token_ids=delta_ids)
