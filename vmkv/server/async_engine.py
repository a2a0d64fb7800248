"""An asyncio front for :class:`~vmkv.engine.llm_engine.LLMEngine`: continuous batching across HTTP requests.

The engine is not thread-safe, so exactly one background thread (``vmkv-engine``) owns it.  That thread
loops: run the queued commands (add a request, abort one, read stats, any callable), then, while any
request is unfinished, run one ``engine.step()`` and hand every :class:`RequestOutput` to the asyncio
queue of its request with ``loop.call_soon_threadsafe``.  Requests added while a step runs join the
batch at the next step (iteration-level scheduling, Orca, OSDI'22, section 3.1).

Everything that touches the engine or its tokenizer runs on that thread (HF fast tokenizers raise
"Already borrowed" when used from two threads at once), so callers pass a callable to :meth:`call`.

Aborts: when the consumer of a :class:`RequestStream` stops early (client disconnect, task cancelled,
``aclose()``), the stream submits ``engine.abort_request`` to the engine thread, which frees the
request's KV before the next step.

Failures: a request that failed in the engine (``RequestOutput.error`` set, see
:mod:`vmkv.engine.llm_engine`) makes its stream raise :class:`RequestFailedError`; the engine and the
other requests run on.  Only a fatal error (:func:`vmkv.engine.errors.is_fatal_error`: a CUDA error
that poisons the context) stops the engine thread: every open stream raises :class:`EngineDeadError`,
:attr:`AsyncEngine.error` holds the cause, and new requests are refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, TypeVar

from vmkv.engine.errors import RequestFailedError, is_fatal_error
from vmkv.engine.outputs import merge_outputs

if TYPE_CHECKING:  # the engine imports torch; keep this module importable without it
    from vmkv.engine.llm_engine import LLMEngine
    from vmkv.engine.outputs import RequestOutput
    from vmkv.engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "RequestStream", "EngineDeadError", "EngineShutdownError", "RequestFailedError"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: sentinel put in a request's queue when the engine thread died or shut down
_CLOSED = object()
_NOTHING = object()


def _is_output(item: Any) -> bool:
    """A request's queue holds outputs, then maybe an exception or :data:`_CLOSED`."""
    return item is not _CLOSED and not isinstance(item, BaseException)
#: consecutive non-fatal exceptions out of ``engine.step()`` (an engine that cannot make progress)
#: after which the engine thread stops as if the error were fatal
MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDeadError(RuntimeError):
    """``engine.step()`` raised a fatal error (or kept raising); the engine thread stopped and every
    open request failed."""


class EngineShutdownError(RuntimeError):
    """The :class:`AsyncEngine` was shut down (or never started); no new requests are accepted."""


class RequestStream:
    """Async iterator over the :class:`RequestOutput` snapshots of one request.

    Each output carries what is new since the previous one (``delta_text``, ``delta_token_ids``)
    next to the cumulative fields.  When the consumer falls behind, the outputs waiting in the queue
    are merged into one (:func:`~vmkv.engine.outputs.merge_outputs`: the newest, with the skipped
    deltas concatenated), so streaming the deltas never loses text.  The last item has
    ``finished=True``.  Leaving the iteration early (``break``, cancellation, ``aclose()``) aborts the
    request on the engine.

    Raises (while iterating):
        RequestFailedError: this request failed in the engine (``.message`` says where and why,
            ``.output`` is its last :class:`RequestOutput`, ``finish_reason="error"``); the engine
            and every other request are unaffected.
        EngineDeadError: the engine thread failed.
        EngineShutdownError: the engine was shut down before the request finished.
    """

    def __init__(self, request_id: str, owner: "AsyncEngine", loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False
        self.last: RequestOutput | None = None

    # called on the engine thread
    def _put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def __aiter__(self) -> AsyncIterator["RequestOutput"]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator["RequestOutput"]:
        behind: Any = _NOTHING  # an end-of-stream item found while merging; handled after the merged output
        try:
            while not self.finished:
                if behind is not _NOTHING:
                    item, behind = behind, _NOTHING
                else:
                    item = await self._queue.get()
                if _is_output(item) and not self._queue.empty():
                    batch = [item]          # the consumer fell behind: merge the waiting outputs
                    while not self._queue.empty():
                        nxt = self._queue.get_nowait()
                        if not _is_output(nxt):
                            behind = nxt
                            break
                        batch.append(nxt)
                    item = merge_outputs(batch)
                if item is _CLOSED:
                    raise EngineShutdownError(f"engine shut down before request {self.request_id} finished")
                if isinstance(item, BaseException):
                    if isinstance(item, RequestFailedError):
                        self.finished = True            # finished in the engine: nothing to abort
                        self.last = item.output
                    raise item
                self.last = item
                self.finished = bool(item.finished)
                yield item
        finally:
            if not self.finished:
                self.finished = True
                self._owner.abort(self.request_id)

    async def result(self) -> "RequestOutput":
        """Wait for the request to finish and return its final output."""
        async for _ in self:
            pass
        assert self.last is not None, "a finished stream always saw at least one output"
        return self.last


class AsyncEngine:
    """Owns an :class:`LLMEngine` and drives ``step()`` in one background thread.

    Args:
        engine: the engine; after :meth:`start` only the engine thread touches it.
        on_finished: optional callback ``f(output)`` run on the engine thread for every request that
            finishes (including aborted ones); used for metrics.  Exceptions in it are logged.
        close_engine_on_shutdown: call ``engine.close()`` (releases the KV memory) when the engine
            thread stops.

    Use :meth:`start` inside a running event loop, then :meth:`add_request` / :meth:`generate`, and
    :meth:`shutdown` at the end.
    """

    def __init__(self, engine: "LLMEngine", *, on_finished: Callable[["RequestOutput"], None] | None = None,
                 close_engine_on_shutdown: bool = True) -> None:
        self.engine = engine
        self.close_engine_on_shutdown = close_engine_on_shutdown
        self.on_finished = on_finished
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future | None]] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._submit_lock = threading.Lock()
        self.model_name: str = str(getattr(engine, "model_name", "model"))
        self.max_model_len: int = int(getattr(engine, "max_model_len", 0))
        #: sequences the engine runs at once (None: unknown); also the most one request may ask for
        self.max_num_seqs: int | None = _max_num_seqs(engine)

    # ------------------------------------------------------------------ lifecycle
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def error(self) -> BaseException | None:
        """The exception that killed the engine thread, if any."""
        return self._dead

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="vmkv-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort every open request, stop the engine thread and wait for it (at most ``timeout_s``)."""
        if self._thread is None:
            return
        with self._submit_lock:
            self._stopping = True
        self._commands.put((lambda: None, None))  # wake the thread if it is idle
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout_s)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.1f s", timeout_s)

    # ------------------------------------------------------------------ commands
    async def call(self, fn: Callable[["LLMEngine"], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result.

        Raises:
            whatever ``fn`` raises; EngineShutdownError / EngineDeadError when the thread is gone.
        """
        return await asyncio.wrap_future(self._submit(lambda: fn(self.engine)))

    def _submit(self, fn: Callable[[], T]) -> "concurrent.futures.Future[T]":
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        # under the lock, so no command slips in after the thread's last drain (it would never run)
        with self._submit_lock:
            self._check_alive()
            self._commands.put((fn, fut))
        return fut

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine thread failed: {self._dead!r}") from self._dead
        if self._thread is None or self._stopping or not self._thread.is_alive():
            raise EngineShutdownError("the engine is not running (shut down or not started)")

    async def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: "SamplingParams | None" = None,
        prompt_token_ids: list[int] | None = None,
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        prepare: Callable[["LLMEngine"], tuple[str | None, list[int] | None, "SamplingParams"]] | None = None,
    ) -> RequestStream:
        """Add a request to the engine and return its stream.

        Either give ``params`` (and ``prompt`` and/or ``prompt_token_ids``), or ``prepare``: a callable run
        on the engine thread right before ``engine.add_request`` that returns ``(prompt,
        prompt_token_ids, params)`` (use it to tokenize or apply a chat template without a second hop).
        ``cache_salt`` is passed to ``engine.add_request`` (prefix-cache isolation between tenants).

        Raises:
            ValueError (incl. PromptTooLongError) from ``prepare`` or ``engine.add_request``; nothing is
            added then.  EngineShutdownError / EngineDeadError when the engine is not running.
        """
        if prepare is None and params is None:
            raise ValueError("add_request needs params or prepare")
        stream = RequestStream(request_id, self, asyncio.get_running_loop())

        def _add() -> None:
            if prepare is not None:
                p, ids, sp = prepare(self.engine)
            else:
                p, ids, sp = prompt, prompt_token_ids, params
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running; use a unique id")
            self.engine.add_request(request_id, p, sp, prompt_token_ids=ids, arrival_time=arrival_time,
                                    cache_salt=cache_salt)
            self._streams[request_id] = stream

        fut = self._submit(_add)
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            # the caller went away while the add was queued or running: undo it if it happened
            if not fut.cancelled():
                self.abort(request_id)
            raise
        return stream

    async def generate(self, request_id: str, prompt: str | None, params: "SamplingParams",
                       prompt_token_ids: list[int] | None = None) -> AsyncIterator["RequestOutput"]:
        """Add a request and yield its outputs until it finishes (see :class:`RequestStream`)."""
        stream = await self.add_request(request_id, prompt, params, prompt_token_ids)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` on the engine thread (non-blocking, idempotent, safe from any thread)."""
        if self._thread is None or not self._thread.is_alive():
            return

        def _abort() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

        self._commands.put((_abort, None))

    async def get_stats(self) -> Any:
        """``engine.get_stats()`` read on the engine thread (a consistent snapshot)."""
        return await self.call(lambda e: e.get_stats())

    # ------------------------------------------------------------------ engine thread
    def _run_command(self, fn: Callable[[], Any], fut: concurrent.futures.Future | None) -> None:
        if fut is not None and not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            if fut is not None:
                fut.set_exception(exc)
            else:
                logger.exception("engine command failed")
        else:
            if fut is not None:
                fut.set_result(result)

    def _idle(self) -> None:
        """No request: let the engine give idle KV memory back (vmem shrink), at most every
        ``_drain``'s 0.5 s wait; a failure there is logged, a fatal one stops the thread."""
        try:
            self.engine.idle()
        except Exception as exc:
            if is_fatal_error(exc):
                raise
            logger.warning("engine.idle() failed (ignored): %r", exc)

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run_command(*item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _dispatch(self, outputs: list["RequestOutput"]) -> None:
        for out in outputs:
            if out.finished:
                stream = self._streams.pop(out.request_id, None)
                if self.on_finished is not None:
                    try:
                        self.on_finished(out)
                    except Exception:  # noqa: BLE001 - metrics must never stop the engine
                        logger.exception("on_finished callback failed for %s", out.request_id)
            else:
                stream = self._streams.get(out.request_id)
            if stream is not None:
                stream._put(RequestFailedError(out.request_id, out.error, out)
                            if out.finished and getattr(out, "error", None) else out)

    def _run(self) -> None:
        logger.info("engine thread started")
        num_failed_steps = 0
        try:
            while not self._stopping:
                busy = self.engine.has_unfinished_requests()
                self._drain(block=not busy)
                if self._stopping:
                    break
                if not busy and not self.engine.has_unfinished_requests():
                    self._idle()
                if self.engine.has_unfinished_requests():
                    try:
                        outputs = self.engine.step()
                    except Exception as exc:
                        num_failed_steps += 1
                        if is_fatal_error(exc) or num_failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
                            raise
                        self._fail_open_requests(exc)
                        continue
                    num_failed_steps = 0
                    self._dispatch(outputs)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            logger.exception("engine thread failed; failing all open requests")
            with self._submit_lock:
                self._dead = exc
            err = EngineDeadError(f"engine step failed: {exc!r}")
            for stream in self._streams.values():
                stream._put(err)
            self._streams.clear()
            self._fail_pending(err)
        else:
            # graceful stop: abort what is left so the KV is freed, and end every stream
            for request_id, stream in list(self._streams.items()):
                try:
                    self.engine.abort_request(request_id)
                except Exception:  # noqa: BLE001
                    logger.exception("abort of %s during shutdown failed", request_id)
                stream._put(_CLOSED)
            self._streams.clear()
            self._fail_pending(EngineShutdownError("engine shut down"))
        if self.close_engine_on_shutdown and hasattr(self.engine, "close"):
            try:
                self.engine.close()
            except Exception:  # noqa: BLE001
                logger.exception("engine.close() failed")
        logger.info("engine thread stopped")

    def _fail_open_requests(self, exc: Exception) -> None:
        """``engine.step()`` raised a non-fatal error it did not attribute (``LLMEngine.step`` does
        that itself; this covers other engines): fail and abort every open request, keep running."""
        logger.error("engine step failed (%r); failing the %d open request(s)", exc, len(self._streams),
                     exc_info=exc)
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s after a failed step failed", request_id)
            stream._put(RequestFailedError(request_id, f"request {request_id} failed: engine step "
                                                       f"raised {type(exc).__name__}: {exc}"))
        self._streams.clear()

    def _fail_pending(self, err: BaseException) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(err)


def _max_num_seqs(engine: Any) -> int | None:
    """The engine's ``max_num_seqs`` (its scheduler config), or None if it has none."""
    value = getattr(getattr(getattr(engine, "config", None), "scheduler", None), "max_num_seqs", None)
    return int(value) if isinstance(value, int) else None
