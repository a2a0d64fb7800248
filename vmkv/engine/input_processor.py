"""Requests in, validated token ids out: tokenization, chat templates and every input check.

:class:`InputProcessor` is what :meth:`LLMEngine.add_request <vmkv.engine.llm_engine.LLMEngine.add_request>`
calls once per request; it owns the tokenizer's use on the request path, so the engine itself never
tokenizes.  Checks, in order: ``cache_salt``, the sampling parameters, the prompt (a str of valid
Unicode, short enough to tokenize, non-empty; or integer token ids inside the vocabulary), its length
against ``max_model_len``, ``n`` against ``max_num_seqs``, stop strings against the tokenizer.
Every failure is a ``ValueError`` (:class:`~vmkv.engine.sequence.PromptTooLongError` for length)
that names the field.  Not thread-safe (HF fast tokenizers are not): the engine's thread uses it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from vmkv.engine.errors import InvalidRequestError, PromptTooLongError
from vmkv.engine.sampling_params import SamplingParams

__all__ = ["InputProcessor", "ProcessedRequest", "check_cache_salt", "check_unicode", "to_token_ids"]


@dataclass(frozen=True)
class ProcessedRequest:
    """A request that passed every input check.

    Attributes:
        prompt: the prompt text, or ``None`` when it came as token ids only.
        prompt_token_ids: the prompt's token ids: non-empty, inside the vocabulary, fewer than
            ``max_model_len``.
        params: the (validated) sampling parameters.
        cache_salt: ``None`` or a non-empty str (prefix-cache isolation).
    """

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None


class InputProcessor:
    """Tokenizes prompts, renders chat templates and validates requests for one engine.

    Args:
        tokenizer: the model's tokenizer (``encode``, ``apply_chat_template``, ``get_vocab``), or
            ``None`` (then only token-id prompts are accepted).
        model_config: anything with ``vocab_size``.
        max_model_len: positions per sequence (the resolved value).
        max_num_seqs: sequences at once (``n`` may not exceed it); ``None``: unchecked.
        model_name: for messages.
    """

    def __init__(self, tokenizer, model_config, max_model_len: int, *, max_num_seqs: int | None = None,
                 model_name: str = "the model") -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(model_config.vocab_size)
        self.max_model_len = int(max_model_len)
        self.max_num_seqs = max_num_seqs
        self.model_name = model_name
        self._max_token_chars: int | None = None     # longest vocabulary entry, for check_text_len

    def process(self, prompt: str | None, params: SamplingParams, prompt_token_ids: Any = None,
                cache_salt: str | None = None) -> ProcessedRequest:
        """Validate one request and tokenize its prompt (the ids win when both are given).

        Raises:
            PromptTooLongError: the prompt has ``>= max_model_len`` tokens (or its text certainly does).
            ValueError: empty prompt, token ids that are not ints or are outside the vocabulary,
                ``n > max_num_seqs``, stop strings without a tokenizer, ``logit_bias`` ids outside
                the vocabulary, a bad ``cache_salt``, a sampling parameter out of range, text with a
                lone surrogate.
        """
        check_cache_salt(cache_salt)
        params.validate()
        if prompt_token_ids is None:
            if prompt is None or prompt == "":
                raise ValueError("prompt is empty: give a non-empty prompt or prompt_token_ids")
            prompt_token_ids = self.encode(prompt)
        ids = self.check_token_ids(prompt_token_ids)
        if self.max_num_seqs is not None and params.n > self.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}; "
                                      "lower n or raise max_num_seqs", param="n")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(f"stop strings need a tokenizer and this model has none (got "
                                      f"{params.stop[0]!r}); use stop_token_ids", param="stop")
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                                      f"[0, {self.vocab_size})", param="logit_bias")
        return ProcessedRequest(prompt, ids, params, cache_salt)

    def check_token_ids(self, prompt_token_ids: Any) -> list[int]:
        """``prompt_token_ids`` as a list of ints, checked: non-empty, inside ``[0, vocab_size)``,
        fewer than ``max_model_len``.

        Raises:
            ValueError / PromptTooLongError: as :meth:`process`.
        """
        ids = to_token_ids(prompt_token_ids)
        if not ids:
            raise ValueError("prompt is empty: prompt_token_ids must hold at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        return ids

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt (the tokenizer's special tokens included, e.g. BOS).

        Raises:
            ValueError: the model has no tokenizer, or ``prompt`` is not a str of valid Unicode (a
                lone UTF-16 surrogate such as ``"\\ud800"``).
            PromptTooLongError: the text is so long that it cannot fit ``max_model_len`` tokens
                (decided from its length before tokenizing, see :meth:`check_text_len`).
        """
        if self.tokenizer is None:
            # one message for both APIs (offline: {"prompt_token_ids": [...]}, HTTP: "prompt": [...])
            raise ValueError("this model has no tokenizer; send the prompt as a list of token ids")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
        check_unicode(prompt, "prompt")
        self.check_text_len(len(prompt))
        return list(self.tokenizer.encode(prompt))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` rendered with the tokenizer's chat template, ending with the
        assistant generation prompt.

        Raises:
            ValueError: empty or malformed messages (each needs string ``role`` and ``content``),
                text with a lone UTF-16 surrogate (names the message), or a tokenizer without a
                chat template.
            PromptTooLongError: the messages' text is certainly too long (see :meth:`check_text_len`).
        """
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts",
                                      param="messages")
        messages = [_text_message(i, m) for i, m in enumerate(messages)]
        for i, m in enumerate(messages):
            check_unicode(m["role"], f"messages[{i}].role")
            check_unicode(m["content"], f"messages[{i}].content")
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise InvalidRequestError(f"the tokenizer of {self.model_name} has no chat template; send a plain "
                                      "prompt", param="messages")
        self.check_text_len(sum(len(m["content"]) for m in messages))
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))

    def check_text_len(self, num_chars: int) -> None:
        """Reject text that is certainly too long without tokenizing it (tokenizing megabytes takes
        seconds and blocks the engine).  A token covers at most ``L`` characters, ``L`` the longest
        vocabulary entry, so text of ``num_chars`` has at least ``num_chars / L`` tokens; a factor of
        4 leaves room for normalizers that shrink text (Unicode composition).

        Raises:
            PromptTooLongError: with ``at_least=True`` and the lower bound on the token count.
        """
        if self._max_token_chars is None:
            try:
                self._max_token_chars = max(1, max(len(t) for t in self.tokenizer.get_vocab()))
            except (AttributeError, TypeError, ValueError):
                self._max_token_chars = 0                    # unknown vocabulary: no early check
        if self._max_token_chars and num_chars > 4 * self._max_token_chars * self.max_model_len:
            raise PromptTooLongError(-(-num_chars // (4 * self._max_token_chars)), self.max_model_len,
                                     at_least=True)


def check_unicode(text: str, field: str) -> None:
    """Raise ``ValueError`` naming ``field`` when ``text`` holds a lone UTF-16 surrogate (the
    tokenizer would raise a TypeError or UnicodeEncodeError deep inside)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{field} contains a lone UTF-16 surrogate {text[e.start]!r} at index "
                                  f"{e.start}; send valid Unicode text", param=field) from None


def check_cache_salt(cache_salt: Any) -> None:
    """Raise ``ValueError`` unless ``cache_salt`` is ``None`` or a non-empty ``str`` of Unicode text
    (no lone surrogate: the server answers such a salt with a 400 too)."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidRequestError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}",
                                  param="cache_salt")
    if cache_salt is not None:
        check_unicode(cache_salt, "cache_salt")


def to_token_ids(ids: Any) -> list[int]:
    """``ids`` as a list of ints; raises ValueError for anything but integers (no silent ``int(1.5)``)."""
    out = []
    try:
        items = iter(ids)
    except TypeError:
        raise ValueError(f"prompt_token_ids must be a list of integers, got {ids!r}") from None
    for t in items:
        if isinstance(t, bool):
            raise ValueError(f"prompt_token_ids must be integers, got {t!r}")
        try:
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt_token_ids must be integers, got {t!r}") from None
    return out


def _text_message(i: int, m: Any) -> dict:
    """A chat message with string content: OpenAI text parts ``[{"type": "text", "text": ...}]`` are
    joined with newlines (as the server does); raises ValueError for anything else."""
    if isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), list) \
            and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                    for p in m["content"]):
        return {**m, "content": "\n".join(p["text"] for p in m["content"])}
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
        raise ValueError(f"messages[{i}] must be a dict with str 'role' and 'content' (a string or a list "
                         f"of {{'type': 'text', 'text': str}} parts), got {m!r}")
    return m
