"""The server's engine front: :class:`AsyncEngine` runs the engine core in a process of its own and
streams each request's outputs to asyncio.

Two processes, as vLLM v1 and SGLang run a server (``DESIGN.md``, "Server"):

- the **engine core** (:mod:`vmkv.server.engine_core`): scheduler, KV cache, model runner, TP workers;
  it steps the engine and sends one message per step with every request's new token ids;
- the **front** (this process): HTTP, tokenization and validation (the engine's own
  :class:`~vmkv.engine.input_processor.InputProcessor`, built from the tokenizer and vocabulary size the
  core sends once it is ready), detokenization and stop strings (:mod:`vmkv.server.output_processor`), SSE.

Threads of the front: the asyncio loop does everything that touches request state; the process, its
sockets and the receiver thread that hands each message from the core to the loop are
:class:`~vmkv.server.core_client.CoreClient`'s.

Lifecycle: :meth:`AsyncEngine.start_core` (blocking, before the event loop: the model loads, and a bad
option fails the server before it listens), then :meth:`AsyncEngine.start` inside the loop,
:meth:`AsyncEngine.add_request` / :meth:`AsyncEngine.call`, and :meth:`AsyncEngine.shutdown`, which
stops the core (a message, then SIGKILL) so that nothing outlives the server.

Aborts: leaving a :class:`RequestStream` early (client disconnect, cancellation, ``aclose()``) sends an
abort; the core frees the request's KV before its next step.

Failures: a request that failed in the engine makes its stream raise :class:`RequestFailedError`; the
engine and the other requests run on.  A fatal error in the core (a CUDA error that poisons the context,
or repeated step failures), or the core process dying (``kill -9``, the OOM killer), makes every open
stream raise :class:`EngineDeadError`; :attr:`AsyncEngine.error` holds the cause and new requests are
refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import pickle
import time
import types
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from vmkv.engine.errors import InvalidRequestError, RequestFailedError
from vmkv.engine.outputs import merge_outputs
from vmkv.engine.sampling_params import RequestOutputKind
from vmkv.server import core_protocol as proto
from vmkv.server.core_client import CoreClient, EngineStartupError, exit_text
from vmkv.server.output_processor import RequestState

if TYPE_CHECKING:
    from vmkv.engine.outputs import RequestOutput
    from vmkv.engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "RequestStream", "EngineDeadError", "EngineShutdownError", "RequestFailedError",
           "EngineStartupError"]

logger = logging.getLogger(__name__)

#: sentinel put in a request's queue when the engine shut down
_CLOSED = object()
_NOTHING = object()
#: seconds the core may take to stop after a Shutdown message, before SIGTERM (then SIGKILL)
CORE_STOP_TIMEOUT_S = 10.0


def _is_output(item: Any) -> bool:
    """A request's queue holds outputs, then maybe an exception or :data:`_CLOSED`."""
    return item is not _CLOSED and not isinstance(item, BaseException)


class EngineDeadError(RuntimeError):
    """The engine core hit a fatal error or its process died; every open request failed."""


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
        EngineDeadError: the engine core process failed or died.
        EngineShutdownError: the engine was shut down before the request finished.
    """

    def __init__(self, request_id: str, owner: "AsyncEngine") -> None:
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False
        self.last: RequestOutput | None = None

    # called on the event loop's thread
    def _put(self, item: Any) -> None:
        self._queue.put_nowait(item)

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
    """The front's handle on an engine core process (see the module docstring).

    Args:
        engine_kwargs: ``LLMEngine.from_args`` keywords (:func:`vmkv.engine.args.engine_kwargs`).
        engine_factory: a picklable callable building the engine from ``engine_kwargs`` in the core
            (default ``LLMEngine.from_args``); tests wrap the engine with it.
        on_finished: optional ``f(output)`` run on the event loop for every request that finishes
            (aborted ones included); used for metrics.  Exceptions in it are logged.
        log_level: the core process's logging level.
        torch_threads: ``torch.set_num_threads`` in the core (``--threads``), or None.
        startup_timeout_s: longest wait for the core to build the engine (seconds).

    Attributes (after :meth:`start_core`): ``model_name``, ``max_model_len``, ``max_num_seqs``,
    ``vocab_size``, ``backend``, ``kv_capacity_bytes``, ``tokenizer``, ``processor`` (the
    :class:`~vmkv.engine.input_processor.InputProcessor` requests are validated with), ``core_pid``.
    """

    def __init__(self, engine_kwargs: dict[str, Any], *, engine_factory: Callable[..., Any] | None = None,
                 on_finished: Callable[["RequestOutput"], None] | None = None, log_level: str = "info",
                 torch_threads: int | None = None, startup_timeout_s: float = 3600.0) -> None:
        self.engine_kwargs = dict(engine_kwargs)
        self.engine_factory = engine_factory
        self.on_finished = on_finished
        self.log_level = log_level
        self.torch_threads = torch_threads
        self.startup_timeout_s = float(startup_timeout_s)
        self._core = CoreClient(self.engine_kwargs, engine_factory, log_level, torch_threads)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._receiving = False
        self._requests: dict[str, tuple[RequestState, RequestStream]] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._stopping = False
        self._stopped = False
        self._shutdown_task: asyncio.Future | None = None
        self._ping_id: int | None = None
        self._ping_sent: float | None = None
        self._dead: BaseException | None = None
        self.model_name = "model"
        self.max_model_len = 0
        self.max_num_seqs: int | None = None
        self.vocab_size = 0
        self.backend = "unknown"
        self.kv_capacity_bytes = 0
        self.tokenizer: Any = None
        self.processor: Any = None
        self.core_pid: int | None = None

    # ------------------------------------------------------------------ lifecycle
    def spawn_core(self) -> None:
        """Start the core process without waiting for it (idempotent); :meth:`start_core` waits.  Call
        it first so that the model loads while this process imports the HTTP stack."""
        self._core.spawn()
        self.core_pid = self._core.pid

    def start_core(self) -> None:
        """Start the core process and wait until its engine is built (blocking; idempotent).

        Raises:
            EngineStartupError: building the engine failed (``kind="config"`` for a bad option), the
                core died while starting, or it took longer than ``startup_timeout_s``.
        """
        self.spawn_core()
        if self.processor is not None:
            return
        # while the core loads the model: the imports this process needs (the tokenizer it sends is
        # a transformers object; importing transformers takes about a second)
        from vmkv.engine.input_processor import InputProcessor
        try:
            import transformers.tokenization_utils_fast  # noqa: F401
        except ImportError:
            pass

        info = self._core.wait_ready(self.startup_timeout_s)
        self.model_name = str(info["model_name"])
        self.max_model_len = int(info["max_model_len"])
        self.max_num_seqs = int(info["max_num_seqs"])
        self.vocab_size = int(info["vocab_size"])
        self.backend = str(info["backend"])
        self.kv_capacity_bytes = int(info["kv_capacity_bytes"])
        self.tokenizer = info["tokenizer"]
        self.processor = InputProcessor(self.tokenizer, types.SimpleNamespace(vocab_size=self.vocab_size),
                                        self.max_model_len, max_num_seqs=self.max_num_seqs,
                                        model_name=self.model_name)

    @property
    def is_running(self) -> bool:
        return self._receiving and self._dead is None and not self._stopping and not self._stopped

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop :meth:`start` ran on (outputs are delivered there); None before."""
        return self._loop

    @property
    def error(self) -> BaseException | None:
        """Why the engine core failed or died, if it did."""
        return self._dead

    def start(self) -> None:
        """Start receiving outputs on the running event loop (starts the core first if needed)."""
        if self._receiving:
            return
        self.start_core()
        self._loop = asyncio.get_running_loop()
        self._core.start_receiver(self._loop, self._on_message, self._on_core_exit)
        self._receiving = True

    async def shutdown(self, timeout_s: float = CORE_STOP_TIMEOUT_S) -> None:
        """End every open request (:class:`EngineShutdownError`), stop the core (Shutdown message, then
        SIGKILL after ``timeout_s``) and wait for it.  Idempotent: a second call waits for the first."""
        if self._core.proc is None or self._stopped:
            return
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown(timeout_s))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, timeout_s: float) -> None:
        self._stopping = True
        for state, stream in list(self._requests.values()):
            stream._put(_CLOSED)
        self._requests.clear()
        self._fail_calls(EngineShutdownError("engine shut down"))
        if self._dead is None:
            self._send(proto.Shutdown())
        await asyncio.get_running_loop().run_in_executor(None, self._core.stop, timeout_s)
        self._stopped = True

    def close_sync(self) -> None:
        """Stop the core without an event loop (after the loop ended, or when it never ran)."""
        if self._core.proc is None or self._stopped or self._shutdown_task is not None:
            return
        if self._dead is None:
            self._send(proto.Shutdown())
        self._core.stop(CORE_STOP_TIMEOUT_S)
        self._stopped = True

    # ------------------------------------------------------------------ sending
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine core failed: {self._dead}") from self._dead
        if not self._receiving or self._stopping or self._stopped:
            raise EngineShutdownError("the engine is not running (shut down or not started)")

    def _send(self, msg: Any) -> None:
        """Send one message to the core (event loop thread only)."""
        self._core.send(msg)

    async def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """Run ``fn(engine, *args)`` in the core between two steps and return its result.  ``fn`` and
        ``args`` must pickle (a module-level function): they cross the process boundary.

        Args:
            timeout_s: give up after this many seconds (``None``: wait as long as the core runs; a
                core stopped by SIGSTOP, or inside a very long step, answers late).
        Raises:
            whatever ``fn`` raises; EngineShutdownError / EngineDeadError when the core is gone;
            TimeoutError after ``timeout_s`` (the late answer is dropped).
        """
        self._check_alive()
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._send(proto.Utility(call_id, pickle.dumps((fn, args))))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    def ping(self) -> None:
        """Ask the core for a sign of life (non-blocking; one outstanding at a time): it answers between two
        steps, so :meth:`stalled_s` grows only while the core is stuck (stopped, hung in a driver call) or
        inside one very long step."""
        if self._ping_id is not None or not self.is_running:
            return
        self._ping_id, self._ping_sent = next(self._call_ids), time.monotonic()
        self._send(proto.Utility(self._ping_id, pickle.dumps((_alive, ()))))

    def stalled_s(self) -> float:
        """Seconds the oldest unanswered :meth:`ping` has waited (0 when none is outstanding)."""
        return 0.0 if self._ping_sent is None else time.monotonic() - self._ping_sent

    async def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: "SamplingParams | None" = None,
        prompt_token_ids: list[int] | None = None,
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        prepare: Callable[[Any], tuple[str | None, list[int] | None, "SamplingParams"]] | None = None,
    ) -> RequestStream:
        """Validate and tokenize a request here, send it to the core and return its stream.

        Either give ``params`` (and ``prompt`` and/or ``prompt_token_ids``), or ``prepare``: a callable
        ``prepare(processor) -> (prompt, prompt_token_ids, params)`` run first with :attr:`processor`
        (tokenize, apply a chat template, check limits).  ``cache_salt`` isolates prefix caches.

        Raises:
            ValueError (incl. PromptTooLongError, InvalidRequestError) from ``prepare`` or the
            validation; nothing is sent then.  EngineShutdownError / EngineDeadError when the core is
            not running.
        """
        if prepare is None and params is None:
            raise ValueError("add_request needs params or prepare")
        self._check_alive()
        if prepare is not None:
            prompt, prompt_token_ids, params = prepare(self.processor)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running; use a unique id")
        req = self.processor.process(prompt, params, prompt_token_ids, cache_salt)
        arrival = time.perf_counter() if arrival_time is None else float(arrival_time)
        state = RequestState(request_id, req.prompt, req.prompt_token_ids, req.params, self.tokenizer, arrival)
        stream = RequestStream(request_id, self)
        core_params = dataclasses.replace(req.params, stop=None, detokenize=False,
                                          output_kind=RequestOutputKind.DELTA)
        self._requests[request_id] = (state, stream)
        self._send(proto.AddRequest(request_id, req.prompt_token_ids, core_params, arrival, req.cache_salt))
        return stream

    async def generate(self, request_id: str, prompt: str | None, params: "SamplingParams",
                       prompt_token_ids: list[int] | None = None) -> AsyncIterator["RequestOutput"]:
        """Add a request and yield its outputs until it finishes (see :class:`RequestStream`)."""
        stream = await self.add_request(request_id, prompt, params, prompt_token_ids)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` (non-blocking, idempotent; from any thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._abort(request_id)
        else:
            loop.call_soon_threadsafe(self._abort, request_id)

    def _abort(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        if self._dead is None and not self._stopped:
            self._send(proto.Abort([request_id]))
        self._finished(entry[0].abort())

    def _finished(self, out: "RequestOutput") -> None:
        if self.on_finished is not None:
            try:
                self.on_finished(out)
            except Exception:  # noqa: BLE001 - metrics must never stop the front
                logger.exception("on_finished callback failed for %s", out.request_id)

    async def get_stats(self) -> Any:
        """``engine.get_stats()`` read in the core (a consistent snapshot between two steps)."""
        return await self.call(_get_stats)

    # ------------------------------------------------------------------ receiving (event loop)
    def _on_message(self, msg: Any) -> None:
        if isinstance(msg, proto.StepOutputs):
            self._on_outputs(msg.outputs)
        elif isinstance(msg, proto.UtilityResult):
            if msg.call_id == self._ping_id:
                self._ping_id = self._ping_sent = None
                return
            fut = self._calls.get(msg.call_id)
            if fut is not None and not fut.done():
                value = pickle.loads(msg.payload)
                if msg.ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
        elif isinstance(msg, proto.Rejected):
            entry = self._requests.pop(msg.request_id, None)
            if entry is not None:
                entry[1]._put(InvalidRequestError(msg.message, param=msg.param))
        elif isinstance(msg, proto.EngineFailed):
            self._die(EngineDeadError(f"engine core failed: {msg.message}"))

    def _on_outputs(self, deltas: list[Any]) -> None:
        stops: list[tuple[str, int, str]] = []
        for delta in deltas:
            entry = self._requests.get(delta.request_id)
            if entry is None:
                continue                         # aborted here, or finished here by a stop string
            state, stream = entry
            try:
                out, hits = state.update(delta)
            except Exception as exc:  # noqa: BLE001 - this request's failure (detokenization, stop strings)
                logger.warning("output processing of request %s failed: %r", delta.request_id, exc)
                del self._requests[delta.request_id]
                self._send(proto.Abort([delta.request_id]))
                stream._put(RequestFailedError(delta.request_id, f"request {delta.request_id} failed in output "
                                               f"processing (detokenization, stop strings): "
                                               f"{type(exc).__name__}: {exc}"))
                continue
            stops.extend((delta.request_id, index, s) for index, s in hits)
            if out is None:
                continue
            if out.finished:
                del self._requests[delta.request_id]
                self._finished(out)
            stream._put(RequestFailedError(out.request_id, out.error, out) if out.finished and out.error else out)
        if stops:
            self._send(proto.FinishSequences(stops))

    def _on_core_exit(self, exitcode: int | None) -> None:
        if self._stopping or self._stopped:
            return
        self._die(EngineDeadError(f"the engine core process exited unexpectedly ({exit_text(exitcode)})"))

    def _die(self, err: EngineDeadError) -> None:
        if self._dead is not None:
            return
        logger.error("%s; failing %d open request(s)", err, len(self._requests))
        self._dead = err
        for _state, stream in self._requests.values():
            stream._put(err)
        self._requests.clear()
        self._fail_calls(err)

    def _fail_calls(self, err: BaseException) -> None:
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()


def _alive(engine: Any) -> bool:
    return True


def _get_stats(engine: Any) -> Any:
    return engine.get_stats()
