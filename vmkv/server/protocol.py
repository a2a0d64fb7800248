"""Pydantic models of the OpenAI completions and chat-completions wire format.

Follows the OpenAI API reference (``POST /v1/completions``, ``POST /v1/chat/completions``, the
``chat.completion.chunk`` streaming object and the error object) with the vLLM extensions
``ignore_eos``, ``top_k``, ``stop_token_ids`` and ``skip_special_tokens``.

Requests are validated in pydantic *strict* mode, so a wrong JSON type (``"temperature": "0.5"``,
``"stream": "yes"``) is rejected instead of coerced; the server turns every validation error into an
HTTP 400 with an :class:`ErrorResponse` body.  Unknown request fields are ignored, as OpenAI does for
fields it does not know.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "MAX_N",
    "MAX_STOP_SEQUENCES",
    "ErrorInfo",
    "ErrorResponse",
    "StreamOptions",
    "SamplingRequestFields",
    "CompletionRequest",
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
#: upper bound of any token count field; anything above is rejected by validation
_MAX_TOKENS_LIMIT = 1 << 31


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


# ---------------------------------------------------------------------------- requests
class _StrictRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_StrictRequest):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and empty ``choices``."""

    include_usage: bool = False


class SamplingRequestFields(_StrictRequest):
    """Fields shared by both endpoints.  Ranges follow the OpenAI API reference."""

    model: str | None = Field(None, description="served model name; null means the served model")
    n: int = Field(1, ge=1, le=MAX_N, description="completions per prompt")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy; null = 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="nucleus mass; null = 1")
    top_k: int | None = Field(None, ge=-1, description="extension: -1 or null = off")
    seed: int | None = Field(None, ge=0, lt=1 << 63, description="per-request sampling seed")
    stop: str | list[str] | None = Field(None, description="up to MAX_STOP_SEQUENCES strings")
    stop_token_ids: list[int] | None = Field(None, description="extension")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="extension: keep generating past EOS")
    skip_special_tokens: bool = Field(True, description="extension")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stop

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _check_penalty(cls, value: float | None) -> float | None:
        if value not in (None, 0, 0.0):
            raise ValueError(f"only 0 is supported by this server, got {value}")
        return value

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


class CompletionRequest(SamplingRequestFields):
    """``POST /v1/completions``.

    ``prompt`` is a string, a list of strings (a batch), a list of token ids, or a list of token-id
    lists; each prompt yields ``n`` choices, numbered ``prompt_index * n + i``.  ``max_tokens``
    defaults to 16 (OpenAI's default) and is capped at the room left in the context.
    """

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1, le=_MAX_TOKENS_LIMIT)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

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
        elif isinstance(p[0], str) and any(s == "" for s in p):
            raise ValueError("every prompt in the list must be a non-empty string")
        elif isinstance(p[0], list) and any(len(ids) == 0 for ids in p):
            raise ValueError("every token-id list must be non-empty")
        elif isinstance(p[0], int) and any(t < 0 for t in p):
            raise ValueError("token ids must be >= 0")
        return p

    @field_validator("logprobs", "suffix")
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("not supported by this server; omit it")
        return value

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
    """One chat message.  Content may be a string or a list of text parts (joined with newlines)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

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

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequestFields):
    """``POST /v1/chat/completions``.

    ``max_completion_tokens`` (the newer name) wins over ``max_tokens``; when both are null the
    completion may use all the room left in the context.
    """

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=_MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=_MAX_TOKENS_LIMIT)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None

    @field_validator("logprobs", "top_logprobs", "tools")
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        if value not in (None, False, []):
            raise ValueError("not supported by this server; omit it")
        return value

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


class CompletionChoice(BaseModel):
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


class CompletionStreamChoice(BaseModel):
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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
