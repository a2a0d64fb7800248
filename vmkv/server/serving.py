"""Request handling of ``/v1/completions`` and ``/v1/chat/completions`` on top of :class:`AsyncEngine`.

A request becomes one engine request per prompt (``n`` completions each, forked by the engine).
Tokenization, the chat template and the context-length check run in this (the front) process inside
the ``prepare`` callable of :meth:`AsyncEngine.add_request`, with the engine's own
:class:`~vmkv.engine.input_processor.InputProcessor`, so a bad request is rejected (HTTP 400) before
anything is streamed or sent to the engine core.

Streaming replies are Server-Sent Events: ``data: <chunk JSON>\\n\\n`` per chunk, whose text is the
engine output's ``delta_text`` (O(new tokens) per step, not the whole text), a final usage chunk with
empty ``choices`` when ``stream_options.include_usage``, then ``data: [DONE]\\n\\n``.

A request that cannot finish gets an OpenAI error (:func:`engine_error`): a non-streamed one as its
HTTP reply, a streamed one as a last ``data: {"error": ...}`` event before ``[DONE]``: 503 when the
server shuts down (after its graceful timeout) or the engine failed, 500 when this request failed in
the engine (the engine and the other requests run on).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import msgspec

from vmkv.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineShutdownError,
    RequestFailedError,
    RequestStream,
)
from vmkv.server.errors import OpenAIError, error_body
from vmkv.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    SamplingRequestFields,
    UsageInfo,
)

if TYPE_CHECKING:
    from vmkv.engine.outputs import RequestOutput

__all__ = ["OpenAIServing", "engine_error", "sse", "SSE_DONE"]

logger = logging.getLogger(__name__)

#: the last event of every stream
SSE_DONE = "data: [DONE]\n\n"

#: default ``max_tokens`` of /v1/completions (OpenAI's documented default)
COMPLETION_DEFAULT_MAX_TOKENS = 16


def sse(payload: Any) -> str:
    """One Server-Sent Event carrying a pydantic model or a dict as JSON."""
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json()}\n\n"
    import json

    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


_JSON = msgspec.json.Encoder()


class StreamChunks:
    """The per-token SSE events of one streamed response, encoded with msgspec from a prefix built once:
    byte for byte what ``sse(CompletionStreamResponse(...))`` / ``sse(ChatCompletionChunk(...))`` give
    (``tests/server/test_server_stream_chunks.py`` checks it), about 6x cheaper than building the pydantic
    models for every chunk (the front's work per token at 256 streams).

    Args:
        request_id, created, model: the response's ``id``, ``created`` and ``model``.
        chat: ``chat.completion.chunk`` choices (``delta``) instead of ``text_completion`` ones.
    """

    __slots__ = ("_prefix", "_chat")

    def __init__(self, request_id: str, created: int, model: str, *, chat: bool) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._prefix = (f'data: {{"id":{_JSON.encode(request_id).decode()},"object":"{obj}",'
                        f'"created":{int(created)},"model":{_JSON.encode(model).decode()},"choices":[')
        self._chat = chat

    def event(self, index: int, text: str, finish_reason: str | None, stop_reason: str | int | None,
              token_ids: list[int] | None = None, usage: UsageInfo | None = None) -> str:
        """One event with one choice: its new ``text`` (a chat choice's ``delta.content``)."""
        if self._chat:
            choice = {"index": index, "delta": {"role": None, "content": text}, "logprobs": None,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
        else:            # token_ids first, as the pydantic model (it inherits the field) writes it
            choice = {} if token_ids is None else {"token_ids": token_ids}
            choice.update(index=index, text=text, logprobs=None, finish_reason=finish_reason,
                          stop_reason=stop_reason)
        tail = "null" if usage is None else usage.model_dump_json()
        return f'{self._prefix}{_JSON.encode(choice).decode()}],"usage":{tail}}}\n\n'


def engine_error(exc: BaseException) -> OpenAIError:
    """The OpenAI error for an exception out of adding a request or iterating its stream."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineShutdownError):
        return OpenAIError(503, f"the server is shutting down and did not finish this request ({exc}); "
                                "retry it", code="engine_unavailable")
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"the engine failed and cannot serve requests: {exc}", code="engine_unavailable")
    if isinstance(exc, ValueError):       # the engine core refused the request (its own validation)
        return OpenAIError(400, str(exc), param=getattr(exc, "param", None), code="invalid_value")
    if isinstance(exc, RequestFailedError):
        return OpenAIError(500, f"this request failed in the engine: {exc.message}", code="internal_error")
    logger.error("request failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
    return OpenAIError(500, f"internal server error: {type(exc).__name__}: {exc}", code="internal_error")


def _finish_reason(reason: str | None) -> str | None:
    return reason if reason in (None, "stop", "length", "abort") else "stop"


@dataclass
class _Prepared:
    """What ``prepare`` found out about one prompt (its text for ``echo``, its length)."""

    prompt_text: str | None = None
    prompt_len: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class OpenAIServing:
    """Turns validated OpenAI requests into engine requests and engine outputs into replies.

    Args:
        engine: the running :class:`AsyncEngine`.
        served_model_name: the name clients must send as ``model`` (the engine's model name is accepted
            too); ``model`` may also be omitted.
    """

    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self._aliases = {served_model_name, engine.model_name}

    # ------------------------------------------------------------------ checks
    def check_model(self, model: str | None) -> None:
        """Raises OpenAIError(404) for a model this server does not serve."""
        if model is not None and model not in self._aliases:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                                   f"`{self.served_model_name}` (see GET /v1/models)",
                              param="model", code="model_not_found")

    @staticmethod
    def _max_tokens(prompt_len: int, requested: int | None, default: int | None, max_model_len: int,
                    prompt_param: str, tokens_param: str) -> int:
        """Completion budget: ``requested`` must fit in the context; otherwise ``default`` capped to the
        room left (all of it when ``default`` is None).

        Raises:
            OpenAIError(400, code=context_length_exceeded): the prompt leaves no room, or
                ``prompt_len + requested > max_model_len``.
        """
        room = max_model_len - prompt_len
        if room <= 0:
            raise OpenAIError(
                400, f"This model's maximum context length is {max_model_len} tokens, but the prompt "
                     f"has {prompt_len} tokens, leaving no room for the completion; shorten the prompt "
                     f"to at most {max_model_len - 1} tokens",
                param=prompt_param, code="context_length_exceeded")
        if requested is not None:
            if prompt_len + requested > max_model_len:
                raise OpenAIError(
                    400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                         f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                         f"{requested} for the completion); reduce {tokens_param} to at most {room} "
                         f"or shorten the prompt",
                    param=tokens_param, code="context_length_exceeded")
            return requested
        return room if default is None else min(default, room)

    def _check_num_seqs(self, num_prompts: int, n: int) -> None:
        """One request may ask for at most ``max_num_seqs`` sequences (prompts x ``n``): the engine runs
        that many at once, and a request beyond it (``[[1]] * 1000`` with ``n`` 64: 64,000 sequences
        from 5 KB) would hold every other request back for minutes.  ``n`` alone is checked against
        the same limit when the request is prepared (:meth:`_sampling_params`).

        Raises:
            OpenAIError(400): ``num_prompts * n > max_num_seqs``; ``param`` is ``prompt`` (or ``n``
                for a single prompt).
        """
        limit = self.engine.max_num_seqs
        if limit is None or num_prompts * n <= limit:
            return
        if num_prompts == 1:
            raise OpenAIError(400, f"n={n} exceeds this server's max_num_seqs={limit}; ask for at most "
                                   f"{limit} completions per prompt", param="n", code="invalid_value")
        raise OpenAIError(400, f"prompt: {num_prompts} prompts x n={n} = {num_prompts * n} sequences exceeds "
                               f"this server's max_num_seqs={limit}: a request may ask for at most {limit} "
                               "sequences (prompts x n) in [1, max_num_seqs]; split the batch over several "
                               "requests", param="prompt", code="invalid_value")

    @staticmethod
    def _sampling_params(req: SamplingRequestFields, max_tokens: int, processor: Any) -> Any:
        """Engine ``SamplingParams`` of a request (``processor``: the engine's InputProcessor).

        Raises:
            OpenAIError(400): ``n`` above the engine's ``max_num_seqs`` (all ``n`` completions run
                together), or a value the engine rejects.
        """
        from vmkv.engine.sampling_params import SamplingParams

        max_num_seqs = processor.max_num_seqs
        if max_num_seqs is not None and req.n > max_num_seqs:
            raise OpenAIError(400, f"n={req.n} exceeds this server's max_num_seqs={max_num_seqs}; ask for "
                                   f"at most {max_num_seqs} completions per prompt",
                              param="n", code="invalid_value")

        vocab = int(processor.vocab_size or 0)
        bad = [t for t in req.stop_token_ids or () if vocab and t >= vocab]
        if bad:
            raise OpenAIError(400, f"stop_token_ids: token id {bad[0]} is out of range [0, {vocab - 1}] of the "
                                   "vocabulary", param="stop_token_ids", code="invalid_value")
        try:
            return SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else float(req.temperature),
                top_p=1.0 if req.top_p is None else float(req.top_p),
                top_k=-1 if req.top_k in (None, 0) else int(req.top_k),
                seed=req.seed,
                max_tokens=max_tokens,
                stop=req.stop_list,
                stop_token_ids=list(req.stop_token_ids) if req.stop_token_ids else None,
                ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens or 0,
                min_p=0.0 if req.min_p is None else float(req.min_p),
                repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
                frequency_penalty=0.0 if req.frequency_penalty is None else float(req.frequency_penalty),
                presence_penalty=0.0 if req.presence_penalty is None else float(req.presence_penalty),
                logit_bias=req.logit_bias_ids,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
            )
        except ValueError as exc:
            first = str(exc).split(maxsplit=1)[0] if str(exc) else ""
            raise OpenAIError(400, str(exc), param=first if first in type(req).model_fields else None,
                              code="invalid_value") from exc

    async def _add(self, request_id: str, prepare: Callable[[Any], tuple], prompt_param: str,
                   arrival: float, cache_salt: str | None) -> RequestStream:
        """Add one engine request; map engine errors to OpenAI errors."""
        try:
            return await self.engine.add_request(request_id, prepare=prepare, arrival_time=arrival,
                                                 cache_salt=cache_salt)
        except OpenAIError:
            raise
        except (EngineDeadError, EngineShutdownError) as exc:
            raise engine_error(exc) from exc
        except ValueError as exc:  # PromptTooLongError, empty prompt, bad messages, bad token ids
            code = "context_length_exceeded" if hasattr(exc, "max_model_len") else "invalid_value"
            # a field the engine names (InvalidRequestError.param), else the prompt (or messages)
            raise OpenAIError(400, str(exc), param=getattr(exc, "param", None) or prompt_param,
                              code=code) from exc

    # ------------------------------------------------------------------ completions
    async def completion_streams(self, req: CompletionRequest, request_id: str, arrival: float
                                 ) -> tuple[list[RequestStream], list[_Prepared]]:
        prompts = req.prompts()
        self._check_num_seqs(len(prompts), req.n)
        explicit = "max_tokens" in req.model_fields_set and req.max_tokens is not None
        streams: list[RequestStream] = []
        infos: list[_Prepared] = []
        try:
            for i, prompt in enumerate(prompts):
                info = _Prepared()

                def prepare(processor: Any, prompt: str | list[int] = prompt, info: _Prepared = info) -> tuple:
                    if isinstance(prompt, str):
                        ids = list(processor.encode(prompt))
                        info.prompt_text = prompt
                    else:
                        ids = list(prompt)
                        vocab = int(processor.vocab_size)
                        bad = [t for t in ids if t >= vocab]
                        if bad:
                            raise OpenAIError(400, f"prompt: token id {bad[0]} is out of range "
                                                   f"[0, {vocab - 1}] of the vocabulary",
                                              param="prompt", code="invalid_value")
                        info.prompt_text = processor.tokenizer.decode(ids) if req.echo and \
                            processor.tokenizer is not None else None
                    info.prompt_len = len(ids)
                    max_tokens = self._max_tokens(len(ids), req.max_tokens if explicit else None,
                                                  COMPLETION_DEFAULT_MAX_TOKENS, processor.max_model_len,
                                                  "prompt", "max_tokens")
                    return (prompt if isinstance(prompt, str) else None, ids,
                            self._sampling_params(req, max_tokens, processor))

                streams.append(await self._add(f"{request_id}-{i}", prepare, "prompt", arrival, req.cache_salt))
                infos.append(info)
        except BaseException:
            for s in streams:
                self.engine.abort(s.request_id)
            raise
        return streams, infos

    def completion_response(self, req: CompletionRequest, request_id: str, created: int,
                            finals: list["RequestOutput"], infos: list[_Prepared]) -> CompletionResponse:
        choices = []
        for pi, (out, info) in enumerate(zip(finals, infos)):
            for c in out.outputs:
                text = (info.prompt_text or "") + c.text if req.echo else c.text
                choices.append(CompletionChoice(index=pi * req.n + c.index, text=text,
                                                finish_reason=_finish_reason(c.finish_reason),
                                                stop_reason=c.stop_reason,
                                                token_ids=list(c.token_ids) if req.return_token_ids else None))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=request_id, created=created, model=self.served_model_name,
                                  choices=choices, usage=_usage(finals))

    async def completion_sse(self, req: CompletionRequest, request_id: str, created: int,
                             streams: list[RequestStream], infos: list[_Prepared]) -> AsyncIterator[str]:
        model = self.served_model_name
        done: set[int] = set()

        continuous = req.continuous_usage
        fast = StreamChunks(request_id, created, model, chat=False)

        def chunk(choices: list[CompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(CompletionStreamResponse(id=request_id, created=created, model=model,
                                                choices=choices, usage=usage))
        try:
            if req.echo:
                for pi, info in enumerate(infos):
                    for j in range(req.n):
                        yield chunk([CompletionStreamChoice(index=pi * req.n + j, text=info.prompt_text or "")],
                                    _running_usage(info.prompt_len, 0) if continuous else None)
            finals: dict[int, RequestOutput] = {}
            async for pi, out in merge_streams(streams):
                for c in out.outputs:
                    idx = pi * req.n + c.index
                    if idx in done:
                        continue
                    delta = c.delta_text                # new since this request's previous output
                    ids = list(c.delta_token_ids) if req.return_token_ids else None
                    reason = _finish_reason(c.finish_reason)
                    if delta or ids or reason is not None:
                        if reason is not None:
                            done.add(idx)
                        yield fast.event(idx, delta, reason, c.stop_reason, ids,
                                         _running_usage(len(out.prompt_token_ids), len(c.token_ids))
                                         if continuous else None)
                if out.finished:
                    finals[pi] = out
            if req.include_usage:
                yield chunk([], _usage([finals[i] for i in sorted(finals)]))
        except Exception as exc:  # noqa: BLE001 - every failure ends the stream with an error event
            yield sse(error_body(engine_error(exc)))
        yield SSE_DONE

    # ------------------------------------------------------------------ chat
    async def chat_stream(self, req: ChatCompletionRequest, request_id: str, arrival: float
                          ) -> tuple[RequestStream, _Prepared]:
        messages = req.message_dicts()
        info = _Prepared()

        def prepare(processor: Any) -> tuple:
            ids = list(processor.apply_chat_template(messages))
            info.prompt_len = len(ids)
            max_tokens = self._max_tokens(len(ids), req.requested_max_tokens, None, processor.max_model_len,
                                          "messages", "max_completion_tokens"
                                          if req.max_completion_tokens is not None else "max_tokens")
            return None, ids, self._sampling_params(req, max_tokens, processor)

        return await self._add(request_id, prepare, "messages", arrival, req.cache_salt), info

    def chat_response(self, request_id: str, created: int, final: "RequestOutput") -> ChatCompletionResponse:
        choices = [ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                        finish_reason=_finish_reason(c.finish_reason), stop_reason=c.stop_reason)
                   for c in sorted(final.outputs, key=lambda c: c.index)]
        return ChatCompletionResponse(id=request_id, created=created, model=self.served_model_name,
                                      choices=choices, usage=_usage([final]))

    async def chat_sse(self, req: ChatCompletionRequest, request_id: str, created: int,
                       stream: RequestStream, info: _Prepared | None = None) -> AsyncIterator[str]:
        model = self.served_model_name

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                           usage=usage))
        done: set[int] = set()
        continuous = req.continuous_usage
        fast = StreamChunks(request_id, created, model, chat=True)
        try:
            # the first chunk of every choice carries the role (OpenAI sends it before any content)
            for i in range(req.n):
                yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))],
                            _running_usage(info.prompt_len if info else 0, 0) if continuous else None)
            final = None
            async for out in stream:
                for c in out.outputs:
                    if c.index in done:
                        continue
                    delta = c.delta_text                # new since this request's previous output
                    reason = _finish_reason(c.finish_reason)
                    if delta or reason is not None:
                        if reason is not None:
                            done.add(c.index)
                        yield fast.event(c.index, delta, reason, c.stop_reason, None,
                                         _running_usage(len(out.prompt_token_ids), len(c.token_ids))
                                         if continuous else None)
                final = out
            if req.include_usage and final is not None:
                yield chunk([], _usage([final]))
        except Exception as exc:  # noqa: BLE001 - every failure ends the stream with an error event
            yield sse(error_body(engine_error(exc)))
        yield SSE_DONE


def _running_usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """The ``usage`` of one streamed chunk (``continuous_usage_stats``, as vLLM reports it): the choice's
    prompt tokens and the tokens it has generated so far."""
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def _usage(finals: list["RequestOutput"]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in finals)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details={"cached_tokens": cached})


_STREAM_END = object()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, "RequestOutput"]]:
    """Interleave several request streams as ``(stream_index, output)``; closing the merged iterator
    (or an error in one stream) aborts every unfinished one."""
    if len(streams) == 1:
        it = streams[0].__aiter__()
        try:
            async for out in it:
                yield 0, out
        finally:
            await it.aclose()  # type: ignore[attr-defined]
        return
    q: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            q.put_nowait((i, exc))
        finally:
            q.put_nowait((i, _STREAM_END))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is _STREAM_END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(streams: list[RequestStream]) -> list["RequestOutput"]:
    """Wait for every stream to finish; their final outputs in order."""
    finals: dict[int, Any] = {}
    async for i, out in merge_streams(streams):
        if out.finished:
            finals[i] = out
    return [finals[i] for i in range(len(streams))]


def now() -> tuple[float, int]:
    """``(time.perf_counter(), unix seconds)`` of a request's arrival."""
    return time.perf_counter(), int(time.time())
