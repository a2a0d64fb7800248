"""The OpenAI-compatible FastAPI app: ``build_app(async_engine, served_model_name)``.

Routes: ``GET``/``HEAD /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as SSE or
not), ``GET``/``HEAD /health`` (503 saying why when the engine cannot serve), ``GET /metrics``
(Prometheus text format, own registry per app).  Errors are OpenAI error bodies (see
:mod:`vmkv.server.errors`); a client that disconnects, streamed or not, aborts its engine request so its
KV is freed at once.  A body larger than ``max_request_bytes`` gets 413 and the connection is closed.

The app's lifespan starts receiving from the engine core process (:class:`AsyncEngine`; it starts the
core too if the caller did not) and, at shutdown, ends what is left and stops the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from vmkv.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineShutdownError,
    RequestFailedError,
    RequestStream,
)
from vmkv.server.errors import OpenAIError, error_response, install_error_handlers
from vmkv.server.metrics import CONTENT_TYPE, ServerMetrics, read_engine_state
from vmkv.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    random_id,
)
from vmkv.server.serving import OpenAIServing, collect, engine_error, now

__all__ = ["build_app", "SSEResponse", "DEFAULT_MAX_REQUEST_BYTES"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}, 413: {"model": ErrorResponse},
    503: {"model": ErrorResponse}}

#: largest request body accepted (bytes).  Tokenization runs on the front's event loop, so a huge prompt
#: would stall every other stream while it is tokenized (30 MB of text: ~40 s on one CPU core).
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
#: how long ``/metrics`` waits for the engine core's stats (seconds) before answering without them
METRICS_ENGINE_TIMEOUT_S = 5.0
#: ``/health`` answers 503 once the engine core has left a liveness ping unanswered this long (seconds): far
#: beyond any step (the core answers between steps), so only a stuck core reaches it
HEALTH_STALL_S = 60.0


class SSEResponse(StreamingResponse):
    """``text/event-stream`` response that stops (and closes its iterator, which aborts the engine
    request) as soon as the client disconnects, even while no token is being sent."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], None] | None = None,
                 **kwargs: Any) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, headers=headers, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def _stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                async def _watch() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(_stream)
                tg.start_soon(_watch)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            if self.on_close is not None:  # also covers an iterator that never started
                self.on_close()


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work``; if the client disconnects first, cancel it (which aborts its engine requests) and
    return None."""
    task = asyncio.ensure_future(work)

    async def _watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(_watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            logger.info("client disconnected from %s; request aborted", request.url.path)
            return None
    return task.result()


class _BodyLimit:
    """Pure ASGI middleware: a request body over ``max_bytes`` gets HTTP 413, and the connection is closed.

    A declared ``Content-Length`` over the limit is answered from the header alone, before any of the body
    is read (a client that declares a huge body and sends nothing gets its 413 at once); a body without
    one (chunked) is counted as it streams in.  The reply carries ``Connection: close`` and the server
    closes the connection after it, so the rest of the body is never read.  The body read is replayed
    to the app, and later ``receive`` calls (disconnect detection) pass through.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = int(max_bytes)

    async def _reject(self, send: Send, size: str | None) -> None:
        what = f"is {size} bytes, more than" if size else "exceeds"
        err = OpenAIError(413, f"request body {what} this server's limit of "
                               f"{self.max_bytes} bytes; send a shorter prompt or fewer prompts per request "
                               "(the server's --max-request-bytes)", code="request_too_large")
        await error_response(err, headers={"connection": "close"})({"type": "http"}, _no_receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._reject(send, length.decode())
            return
        chunks: list[bytes] = []
        total = 0
        first: dict[str, Any] | None = None
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                first = message
                break
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > self.max_bytes:
                await self._reject(send, None)
                return
            if not message.get("more_body", False):
                break
        pending = [first or {"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def _replay() -> Any:
            return pending.pop() if pending else await receive()

        await self.app(scope, _replay, send)


async def _no_receive() -> Any:  # pragma: no cover - a JSONResponse never reads
    return {"type": "http.disconnect"}


class _StatusCounter:
    """Pure ASGI middleware counting HTTP replies by route and status (keeps streaming intact)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def _send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            path = scope.get("path", "")
            self.metrics.http_requests.labels(endpoint=path if path in self.routes else "other",
                                              status=str(status[0])).inc()


def build_app(async_engine: AsyncEngine, served_model_name: str | None = None, *,
              backend: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """Build the app around ``async_engine`` (started by the app's lifespan if not yet running).

    Args:
        async_engine: the engine front; the app sets its ``on_finished`` to record request metrics.
        served_model_name: the ``model`` name clients send; default ``async_engine.model_name``.
        backend: KV backend name for ``vmkv_server_info``; default the one the engine core reports.
        max_request_bytes: a larger request body gets HTTP 413 (``code="request_too_large"``).
    Raises:
        ValueError: ``max_request_bytes`` < 1.
    """
    if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be an int >= 1, got {max_request_bytes!r}")
    served = served_model_name or async_engine.model_name
    backend = backend or async_engine.backend
    metrics = ServerMetrics(backend=backend, model=served)
    async_engine.on_finished = metrics.observe_finished
    serving = OpenAIServing(async_engine, served)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("serving %s (%s backend, max_model_len %d)", served, backend, async_engine.max_model_len)
        try:
            yield
        finally:
            await async_engine.shutdown()

    app = FastAPI(title="vmkv OpenAI-compatible server", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.serving = serving
    install_error_handlers(app)

    def _abort_unfinished(streams: list[RequestStream]) -> None:
        """Safety net for every exit path: abort what did not finish (idempotent)."""
        for s in streams:
            if not s.finished:
                async_engine.abort(s.request_id)

    async def _collect(request: Request, streams: list[RequestStream]) -> list[Any] | None:
        try:
            return await _until_disconnect(request, collect(streams))
        except (EngineDeadError, EngineShutdownError, RequestFailedError) as exc:
            raise engine_error(exc) from exc
        finally:
            _abort_unfinished(streams)

    async def health() -> Response:
        """200 ``{"status": "ok"}`` while the engine serves; 503 with the reason when it cannot (the engine
        core failed, e.g. a CUDA error poisoned the device, or its process died; it has not answered a
        liveness ping for :data:`HEALTH_STALL_S`, e.g. stopped or hung; or it is shutting down).  Each call
        sends a ping if none is outstanding, so the stall is noticed from the second call on.  HEAD answers
        the same, bodiless."""
        err = async_engine.error
        if err is not None:
            return error_response(OpenAIError(
                503, f"the engine failed and cannot serve requests: {type(err).__name__}: {err}; restart the "
                     "server", code="engine_unavailable"))
        if not async_engine.is_running:
            return error_response(OpenAIError(503, "the engine is not running (shutting down or not started)",
                                              code="engine_unavailable"))
        stalled = async_engine.stalled_s()
        async_engine.ping()          # answered between two steps; a stuck core leaves it waiting
        if stalled > HEALTH_STALL_S:
            return error_response(OpenAIError(
                503, f"the engine core has not answered for {stalled:.0f} s (stopped or hung; a step takes far "
                     f"less); its process {async_engine.core_pid} is alive", code="engine_unavailable"))
        return JSONResponse({"status": "ok"})

    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served, root=async_engine.model_name,
                                         max_model_len=async_engine.max_model_len,
                                         vocab_size=async_engine.vocab_size)])

    # GET and HEAD (bodiless, same status) as two routes, each with its own OpenAPI operation id: one
    # api_route with both methods gives both operations one id, and FastAPI warns "Duplicate Operation
    # ID" when /openapi.json is built
    app.add_api_route("/health", health, methods=["GET"], operation_id="health")
    app.add_api_route("/health", health, methods=["HEAD"], operation_id="health_head")
    app.add_api_route("/v1/models", models, methods=["GET"], response_model=ModelList, operation_id="list_models")
    app.add_api_route("/v1/models", models, methods=["HEAD"], response_model=ModelList,
                      operation_id="list_models_head")

    @app.get("/metrics")
    async def prometheus() -> Response:
        """The front's metrics, and the engine's read in the core; a core that does not answer within
        :data:`METRICS_ENGINE_TIMEOUT_S` (stopped, or in a very long step) leaves its gauges out of this
        scrape instead of stalling it."""
        try:
            metrics.set_engine_stats(*await async_engine.call(read_engine_state, timeout_s=METRICS_ENGINE_TIMEOUT_S))
        except (EngineDeadError, EngineShutdownError):
            metrics.set_engine_stats(None)
        except asyncio.TimeoutError:
            logger.warning("/metrics: the engine core did not answer within %.0f s; its gauges are left out",
                           METRICS_ENGINE_TIMEOUT_S)
            metrics.set_engine_stats(None)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        serving.check_model(req.model)
        request_id = random_id("cmpl")
        arrival, created = now()
        streams, infos = await serving.completion_streams(req, request_id, arrival)
        if req.stream:
            return SSEResponse(serving.completion_sse(req, request_id, created, streams, infos),
                               on_close=lambda: _abort_unfinished(streams))
        finals = await _collect(request, streams)
        if finals is None:
            return Response(status_code=499)
        return JSONResponse(serving.completion_response(req, request_id, created, finals, infos).model_dump())

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        serving.check_model(req.model)
        request_id = random_id("chatcmpl")
        arrival, created = now()
        stream, info = await serving.chat_stream(req, request_id, arrival)
        if req.stream:
            return SSEResponse(serving.chat_sse(req, request_id, created, stream, info),
                               on_close=lambda: _abort_unfinished([stream]))
        finals = await _collect(request, [stream])
        if finals is None:
            return Response(status_code=499)
        return JSONResponse(serving.chat_response(request_id, created, finals[0]).model_dump())

    routes = {"/health", "/v1/models", "/metrics", "/v1/completions", "/v1/chat/completions"}
    app.add_middleware(_BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(_StatusCounter, metrics=metrics, routes=routes)  # outermost: counts the 413s too
    return app
