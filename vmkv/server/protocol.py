"""Pydantic models of the OpenAI completions and chat-completions wire format.

Follows the OpenAI API reference (``POST /v1/completions``, ``POST /v1/chat/completions``, the
``chat.completion.chunk`` streaming object and the error object) with vLLM's extensions under vLLM's
names (``top_k``, ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``cache_salt``, ...).

Requests are validated in pydantic *strict* mode, so a wrong JSON type (``"temperature": "0.5"``,
``"stream": "yes"``) is rejected instead of coerced; the server turns every validation error into an
HTTP 400 with an :class:`ErrorResponse` body.  Three rules hold for every request model, each
enforced in one place:

- every number is range-checked here, at the HTTP edge (:func:`_within`), so no value that the engine
  cannot take ever reaches it; the message names the allowed range and the error the value;
- every string, wherever it sits in the request, is checked for lone UTF-16 surrogates (``"\ud800"``
  is valid JSON but not Unicode text, and would fail deep in the tokenizer);
- a field that would change the result but is not implemented (:class:`Unsupported`) is rejected
  unless it has its neutral value, instead of being silently ignored.

Unknown fields, and known ones that do not change the result (``user``, ``metadata``, ``store``,
``parallel_tool_calls`` without tools, ...), are ignored, as OpenAI does for fields it does not know.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

__all__ = [
    "MAX_N",
    "MAX_STOP_SEQUENCES",
    "MAX_STOP_SEQUENCE_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_CACHE_SALT_CHARS",
    "MAX_LOGIT_BIAS_ENTRIES",
    "INT32_MAX",
    "Unsupported",
    "ErrorInfo",
    "ErrorResponse",
    "StreamOptions",
    "SamplingRequestFields",
    "CompletionRequest",
    "TextContentPart",
    "ChatMessage",
    "ChatCompletionRequest",
    "UsageInfo",
    "CompletionChoice",
    "CompletionResponse",
    "CompletionStreamChoice",
    "CompletionStreamResponse",
    "ChatResponseMessage",
    "ChatCompletionChoice",
    "ChatCompletionResponse",
    "DeltaMessage",
    "ChatCompletionStreamChoice",
    "ChatCompletionChunk",
    "ModelCard",
    "ModelList",
    "random_id",
]

#: most completions per prompt (``n``) one request may ask for
MAX_N = 64
#: most stop strings one request may give (OpenAI allows 4; vLLM allows more)
MAX_STOP_SEQUENCES = 16
#: longest stop string (characters); each is searched for in the output after every token
MAX_STOP_SEQUENCE_CHARS = 1024
#: most ``stop_token_ids`` one request may give
MAX_STOP_TOKEN_IDS = 1024
#: longest ``cache_salt`` (characters): a tenant id, not a payload
MAX_CACHE_SALT_CHARS = 4096
#: most ``logit_bias`` entries one request may give (each is applied to its logits every step)
MAX_LOGIT_BIAS_ENTRIES = 1024
#: upper bound of every token count and token id field
INT32_MAX = (1 << 31) - 1
#: upper bound of ``seed`` (a signed 64-bit integer)
_INT64_MAX = (1 << 63) - 1


def random_id(prefix: str) -> str:
    """An OpenAI-style object id, e.g. ``chatcmpl-3f2a...`` (32 hex digits)."""
    return f"{prefix}-{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    """The ``error`` member of an OpenAI error body.

    ``type`` is ``invalid_request_error`` for 4xx and ``internal_error`` / ``service_unavailable`` for
    5xx; ``param`` names the offending request field (dotted path) or is null; ``code`` is a short
    machine-readable reason (``invalid_value``, ``invalid_type``, ``invalid_json``,
    ``context_length_exceeded``, ``model_not_found``, ...) or null.
    """

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Body of every non-2xx reply: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ---------------------------------------------------------------------------- field rules
def _within(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False, also: tuple[int, ...] = (),
            note: str = "") -> AfterValidator:
    """Range check of a number field: ``None``, one of ``also``, or ``lo <= value <= hi`` (``lo < value``
    when ``lo_open``, ``value < hi`` when ``hi_open``).  NaN is out of every range.  The message names the
    range; the error handler adds the value (so it is never printed twice)."""
    interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    allowed = f"{' or '.join(map(str, also))}{note} or in {interval}" if also else f"in {interval}{note}"

    def check(value: Any) -> Any:
        if value is None or (also and value in also):
            return value
        if not ((lo < value) if lo_open else (lo <= value)) or not ((value < hi) if hi_open else (value <= hi)):
            raise ValueError(f"must be {allowed}")
        return value

    return AfterValidator(check)


class Unsupported:
    """Marks a request field (``Annotated[T, Unsupported(...)]``) that would change the result but is
    not implemented by this server: the request is rejected (HTTP 400, "not supported") unless the
    field is absent or has one of the ``neutral`` values, which change nothing.

    Args:
        neutral: the accepted values (compared with their JSON type: ``0`` is not ``false``).
    """

    def __init__(self, *neutral: Any) -> None:
        self.neutral = neutral if neutral else (None,)

    def accepts(self, value: Any) -> bool:
        return any(value == n and type(value) is type(n) for n in self.neutral)

    def message(self) -> str:
        shown = [json.dumps(n) for n in self.neutral if n is not None]
        return "not supported by this server; omit it" + (f" or send {' or '.join(shown)}" if shown else "")


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _surrogate_at(value: Any, path: str = "") -> str | None:
    """Where in ``value`` (a str, or lists/dicts of them) a lone UTF-16 surrogate sits: ``""`` for
    ``value`` itself, ``"[3]"`` / ``"['key']"`` inside it; None if there is none.  Nested models are
    skipped: they run this check on their own fields."""
    if isinstance(value, str):
        return path if _LONE_SURROGATE.search(value) else None
    if isinstance(value, (list, tuple)):
        items: Any = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and _LONE_SURROGATE.search(key):
            return f"{path}[{key!r}]"
        found = _surrogate_at(item, f"{path}[{key!r}]")
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------------------- requests
class _StrictRequest(BaseModel):
    """Base of every request model: strict types, unknown fields ignored, and one check that runs on
    every field of every request model (nested ones included): no lone surrogates in any string,
    and an :class:`Unsupported` field only at a neutral value."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """An explicit ``null`` for a field with a non-null default means that default, as OpenAI
        documents for its nullable fields (``"n": null``, ``"stream": null``, ...).  Required fields
        and fields whose default is null keep the null and are checked as usual."""
        if not isinstance(data, dict):
            return data
        drop = [name for name, value in data.items() if value is None and (field := cls.model_fields.get(name))
                is not None and not field.is_required() and field.default is not None]
        return {k: v for k, v in data.items() if k not in drop} if drop else data

    @field_validator("*", mode="after")
    @classmethod
    def _check_every_field(cls, value: Any, info: ValidationInfo) -> Any:
        where = _surrogate_at(value)
        if where is not None:
            raise ValueError(f"contains a lone UTF-16 surrogate{f' (at {where})' if where else ''}, which "
                             "is not Unicode text; send valid UTF-8 (a JSON \\ud800-\\udfff escape must be "
                             "half of a surrogate pair)")
        field = cls.model_fields.get(info.field_name or "")
        for rule in field.metadata if field is not None else ():
            if isinstance(rule, Unsupported) and not rule.accepts(value):
                raise ValueError(rule.message())
        return value


class StreamOptions(_StrictRequest):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and empty ``choices``;
    with it, ``continuous_usage_stats`` (vLLM) puts a ``usage`` object on every chunk too (the choice's
    prompt tokens and its completion tokens so far)."""

    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM extension: usage on every chunk "
                                                            "(with include_usage)")


_Count = Annotated[int | None, _within(1, INT32_MAX)]
_TokenId = Annotated[int, _within(0, INT32_MAX)]
_Penalty = Annotated[float | None, _within(-2, 2)]


class SamplingRequestFields(_StrictRequest):
    """Fields shared by both endpoints.  Ranges follow the OpenAI API reference and vLLM."""

    model: str | None = Field(None, description="served model name; null means the served model")
    n: Annotated[int, _within(1, MAX_N)] = Field(1, description="completions per prompt")
    temperature: Annotated[float | None, _within(0, 2)] = Field(None, description="0 = greedy; null = 1")
    top_p: Annotated[float | None, _within(0, 1, lo_open=True)] = Field(
        None, description="nucleus mass; null = 1")
    top_k: Annotated[int | None, _within(1, INT32_MAX, also=(-1, 0), note=" (off)")] = Field(
        None, description="extension: -1, 0 or null = off")
    seed: Annotated[int | None, _within(0, _INT64_MAX)] = Field(None, description="per-request sampling seed")
    stop: str | list[str] | None = Field(None, description="up to MAX_STOP_SEQUENCES strings")
    stop_token_ids: list[_TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS, description="extension")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="extension: keep generating past EOS")
    skip_special_tokens: bool = Field(True, description="extension")
    cache_salt: str | None = Field(None, description="extension (vLLM): prompts with different salts never "
                                                     "share prefix-cache entries (tenant isolation)")
    user: str | None = None
    presence_penalty: _Penalty = Field(None, description="in [-2, 2]; null = 0")
    frequency_penalty: _Penalty = Field(None, description="in [-2, 2]; null = 0")
    repetition_penalty: Annotated[float | None, _within(0, math.inf, lo_open=True, hi_open=True)] = Field(
        None, description="extension (vLLM): > 0; null = 1 (off)")
    min_p: Annotated[float | None, _within(0, 1)] = Field(None, description="extension (vLLM); null = 0 (off)")
    min_tokens: Annotated[int | None, _within(0, INT32_MAX)] = Field(
        None, description="extension (vLLM): no EOS, stop token id or stop string before this many tokens")
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (a decimal string) -> bias in [-100, 100] added to its logit")
    include_stop_str_in_output: bool = Field(False, description="extension (vLLM): keep the stop string")
    # would change the result, not implemented: accepted only at their neutral values
    response_format: Annotated[dict[str, Any] | None, Unsupported(None, {"type": "text"})] = None
    use_beam_search: Annotated[bool, Unsupported(False)] = False
    spaces_between_special_tokens: Annotated[bool, Unsupported(True)] = True
    prompt_logprobs: Annotated[int | None, Unsupported()] = None
    truncate_prompt_tokens: Annotated[int | None, Unsupported()] = None
    allowed_token_ids: Annotated[list[int] | None, Unsupported()] = None
    bad_words: Annotated[list[str] | None, Unsupported(None, [])] = None
    logits_processors: Annotated[list[Any] | None, Unsupported(None, [])] = None
    structured_outputs: Annotated[dict[str, Any] | None, Unsupported()] = None
    guided_json: Annotated[Any, Unsupported()] = None
    guided_regex: Annotated[str | None, Unsupported()] = None
    guided_choice: Annotated[list[str] | None, Unsupported()] = None
    guided_grammar: Annotated[str | None, Unsupported()] = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_SEQUENCE_CHARS:
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_SEQUENCE_CHARS} characters, "
                             f"one has {longest}")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is None:
            return bias
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries are allowed, got {len(bias)}")
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit()) or int(key) > INT32_MAX:
                raise ValueError(f"keys must be token ids in [0, {INT32_MAX}] written as decimal strings, "
                                 f"got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {value!r} for token {key}")
        return bias

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, salt: str | None) -> str | None:
        if salt is not None and salt == "":
            raise ValueError("must be a non-empty string (or omitted)")
        if salt is not None and len(salt) > MAX_CACHE_SALT_CHARS:
            raise ValueError(f"may have at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}; use a "
                             "short tenant id (or a hash of a longer one)")
        return salt

    @model_validator(mode="after")
    def _check_common(self) -> "SamplingRequestFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> list[str] | None:
        """``stop`` as a list (or None)."""
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """``usage`` on every streamed chunk (vLLM: ``continuous_usage_stats`` with ``include_usage``)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    @property
    def logit_bias_ids(self) -> dict[int, float] | None:
        """``logit_bias`` with int keys (the engine's form), or None when empty."""
        return {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None


class CompletionRequest(SamplingRequestFields):
    """``POST /v1/completions``.

    ``prompt`` is a string, a list of strings (a batch), a list of token ids, or a list of token-id
    lists; each prompt yields ``n`` choices, numbered ``prompt_index * n + i``.  ``max_tokens``
    defaults to 16 (OpenAI's default) and is capped at the room left in the context.
    """

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: _Count = 16
    echo: bool = False
    return_token_ids: bool = Field(False, description="extension (vLLM): each choice's generated token ids "
                                                      "(streaming: each chunk's new ones), e.g. for models "
                                                      "without a tokenizer")
    best_of: Annotated[int | None, _within(1, MAX_N)] = None
    logprobs: Annotated[int | None, Unsupported()] = None
    suffix: Annotated[str | None, Unsupported()] = None
    prompt_embeds: Annotated[Any, Unsupported()] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, p: Any) -> Any:
        if isinstance(p, list) and p:
            kinds = {"str" if isinstance(x, str) else "int" if isinstance(x, int) and not isinstance(x, bool)
                     else "list" if isinstance(x, list) else type(x).__name__ for x in p}
            if len(kinds) > 1 or not kinds <= {"str", "int", "list"}:
                raise ValueError("must be a string, a list of strings, a list of token ids or a list of "
                                 f"token-id lists; got a list of {' and '.join(sorted(kinds))}")
        return p

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, p: Any) -> Any:
        if isinstance(p, str):
            if p == "":
                raise ValueError("must be a non-empty string")
        elif len(p) == 0:
            raise ValueError("must be non-empty")
        elif isinstance(p[0], str):  # a batch of strings (the before-validator made the list uniform)
            if any(s == "" for s in p):
                raise ValueError("every prompt in the list must be a non-empty string")
        else:  # token ids, or a batch of token-id lists
            if isinstance(p[0], list) and any(len(ids) == 0 for ids in p):
                raise ValueError("every token-id list must be non-empty")
            ids = p if isinstance(p[0], int) else [t for ids in p for t in ids]
            if any(not 0 <= t <= INT32_MAX for t in ids):
                raise ValueError(f"token ids must be in [0, {INT32_MAX}] (and in the model's vocabulary)")
        return p

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of == n ({self.n}) is supported, got {self.best_of}")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: each element is a prompt string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextContentPart(_StrictRequest):
    """A ``{"type": "text", "text": ...}`` part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(_StrictRequest):
    """One chat message.  Content is a string or a list of text parts (joined with newlines); it may
    not be null: OpenAI allows null only in an assistant message with ``tool_calls``, and tools are
    not supported."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: Annotated[list[Any] | None, Unsupported(None, [])] = None
    function_call: Annotated[dict[str, Any] | None, Unsupported()] = None

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, content: Any) -> Any:
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"only text content parts ({{'type': 'text', 'text': ...}}) are "
                                     f"supported by this text-only model, got a {kind!r} part")
        return content

    @field_validator("content", mode="after")
    @classmethod
    def _content_not_null(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None:
            if info.data.get("role") == "assistant":
                raise ValueError("an assistant message needs content; null content is only valid with "
                                 "tool_calls, which this server does not support")
            raise ValueError("expected a string or array of objects, but got null")
        return content

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content or ())


class ChatCompletionRequest(SamplingRequestFields):
    """``POST /v1/chat/completions``.

    ``max_completion_tokens`` (the newer name) wins over ``max_tokens``; when both are null the
    completion may use all the room left in the context.
    """

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: _Count = None
    max_completion_tokens: _Count = None
    logprobs: Annotated[bool | None, Unsupported(None, False)] = None
    top_logprobs: Annotated[int | None, _within(0, 20), Unsupported(None, 0)] = None
    tools: Annotated[list[Any] | None, Unsupported(None, [])] = None
    tool_choice: Annotated[str | dict[str, Any] | None, Unsupported(None, "none")] = None
    functions: Annotated[list[Any] | None, Unsupported(None, [])] = None
    function_call: Annotated[str | dict[str, Any] | None, Unsupported(None, "none")] = None
    audio: Annotated[dict[str, Any] | None, Unsupported()] = None
    modalities: Annotated[list[str] | None, Unsupported(None, ["text"])] = None
    web_search_options: Annotated[dict[str, Any] | None, Unsupported()] = None
    reasoning_effort: Annotated[str | None, Unsupported()] = None
    verbosity: Annotated[str | None, Unsupported()] = None
    echo: Annotated[bool, Unsupported(False)] = Field(False, description="vLLM extension")
    add_generation_prompt: Annotated[bool, Unsupported(True)] = True
    continue_final_message: Annotated[bool, Unsupported(False)] = False
    chat_template: Annotated[str | None, Unsupported()] = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, Unsupported(None, {})] = None
    documents: Annotated[list[Any] | None, Unsupported()] = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict[str, str]]:
        """Messages as ``{"role", "content"}`` dicts for the chat template."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# ---------------------------------------------------------------------------- responses
class UsageInfo(BaseModel):
    """Token counts: prompt tokens counted once per prompt (not once per choice)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


FinishReason = Literal["stop", "length", "abort"]


class _TokenIds(BaseModel):
    """``token_ids`` (``return_token_ids``), left out of the JSON unless asked for."""

    token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler):
        data = handler(self)
        if isinstance(data, dict) and data.get("token_ids") is None:
            data.pop("token_ids", None)
        return data


class CompletionChoice(_TokenIds):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = Field(None, description="extension: the stop string or token id hit")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChoice(_TokenIds):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vmkv"
    root: str | None = None
    max_model_len: int | None = None
    #: the model's vocabulary size (token ids are in ``[0, vocab_size)``): load clients sending token-id
    #: prompts read it here (a vmkv extension; OpenAI clients ignore unknown fields)
    vocab_size: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
