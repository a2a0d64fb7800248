"""The engine core process of ``vmkv serve``: scheduler, KV cache, model runner (and TP workers) in a
process of their own, as vLLM v1 (``vllm/v1/engine/core.py``) and SGLang run them.

The HTTP front (:class:`~vmkv.server.async_engine.AsyncEngine`) starts :func:`run_engine_core` in a
spawned child.  The core builds the :class:`~vmkv.engine.llm_engine.LLMEngine`, sends
:class:`~vmkv.server.core_protocol.Ready`, then loops::

    handle every queued message (add, abort, finish sequences, utility, shutdown)
    if requests are unfinished: deltas = engine.step_deltas(); send them as one StepOutputs message
    else: wait for a message (at most IDLE_POLL_S), engine.idle() (vmem gives idle KV memory back)

so the GPU never waits on HTTP parsing, SSE encoding or detokenization: those run in the front, on
the token ids this process sends.  Requests arrive with ``SamplingParams.detokenize=False``.

Failures: a request the engine refuses gets :class:`~vmkv.server.core_protocol.Rejected`; a request
that fails in a step is reported with its ``error`` (the engine's failure isolation); a fatal error
(:func:`~vmkv.engine.errors.is_fatal_error`), or :data:`MAX_CONSECUTIVE_STEP_FAILURES` failed steps in a
row, sends :class:`~vmkv.server.core_protocol.EngineFailed` and exits with status 1.  The core never
outlives its front: it asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``) and
checks ``os.getppid()`` between steps.  SIGINT and SIGTERM are ignored: Ctrl-C, ``timeout`` and systemd
signal the whole process group, and the front, which lets running requests finish first, decides when
the core stops (a Shutdown message, or SIGKILL after its timeout).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import pickle
import signal
import sys
from typing import Any, Callable

import zmq

from vmkv.engine.errors import is_fatal_error
from vmkv.server import core_protocol as proto

__all__ = ["run_engine_core", "EngineCore", "engine_info", "MAX_CONSECUTIVE_STEP_FAILURES", "IDLE_POLL_S"]

logger = logging.getLogger(__name__)

#: consecutive non-fatal exceptions out of ``engine.step()`` after which the core gives up
MAX_CONSECUTIVE_STEP_FAILURES = 3
#: longest wait for a message while no request is unfinished (seconds); ``engine.idle()`` runs after it
IDLE_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


def engine_info(engine: Any) -> dict[str, Any]:
    """What the front needs from a built engine: its tokenizer and vocabulary size (to tokenize and
    validate in the front), its limits and names.  Nothing in it needs torch to unpickle: the front
    process never imports torch."""
    usage = engine.kv_cache.usage()
    return {
        "model_name": engine.model_name,
        "tokenizer": engine.tokenizer,
        "max_model_len": int(engine.max_model_len),
        "max_num_seqs": int(engine.resolved.max_num_seqs),
        "vocab_size": int(engine.model_config.vocab_size),
        "backend": str(getattr(engine.kv_cache, "backend", engine.config.cache.backend)),
        "kv_capacity_bytes": int(usage.capacity_bytes),
        "device": str(engine.device),
        "pid": os.getpid(),
    }


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux; elsewhere the ``getppid`` check remains)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def run_engine_core(engine_kwargs: dict[str, Any], input_addr: str, output_addr: str, parent_pid: int,
                    engine_factory: Callable[..., Any] | None = None, log_level: str = "INFO",
                    torch_threads: int | None = None) -> None:
    """The core process's entry point (a ``multiprocessing`` spawn target).

    Args:
        engine_kwargs: ``LLMEngine.from_args`` keywords (``vmkv.engine.args.engine_kwargs``).
        input_addr, output_addr: the front's ZMQ endpoints (it binds, the core connects).
        parent_pid: the front's pid; the core exits when its parent changes.
        engine_factory: builds the engine from ``engine_kwargs`` (picklable; default
            ``LLMEngine.from_args``).  Tests pass one that wraps the engine.
        log_level: logging level of this process.
        torch_threads: ``torch.set_num_threads`` in this process (``--threads``), or None.
    """
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.setsockopt(zmq.LINGER, 5000)
    out.connect(output_addr)
    status = 0
    try:
        if torch_threads:
            import torch

            torch.set_num_threads(int(torch_threads))
        try:
            if engine_factory is None:
                from vmkv.engine.llm_engine import LLMEngine

                engine_factory = LLMEngine.from_args
            engine = engine_factory(**engine_kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported to the front, which prints it
            kind = "config" if isinstance(exc, (ValueError, TypeError, FileNotFoundError)) else "error"
            if kind == "error":
                logger.exception("engine core: building the engine failed")
            out.send(proto.encoder.encode(proto.StartupFailed(f"{type(exc).__name__}: {exc}" if kind == "error"
                                                              else str(exc), kind)))
            status = 2
            return
        out.send(proto.encoder.encode(proto.Ready(pickle.dumps(engine_info(engine)))))
        gc.collect()
        gc.freeze()     # the model, the cache and the config stay: keep them out of every collection
        status = EngineCore(engine, inp, out, parent_pid).run()
    finally:
        inp.close(linger=0)
        out.close()
        ctx.term()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # the engine is closed and the sockets flushed: skip the interpreter's teardown (seconds with
        # CUDA and Triton loaded, and extensions' leak reports on stderr); the exit code still tells
        os._exit(status)


class EngineCore:
    """The core's loop over one engine (see the module docstring).

    Args:
        engine: a built :class:`~vmkv.engine.llm_engine.LLMEngine` (closed when the loop ends).
        inp: PULL socket of :data:`~vmkv.server.core_protocol.ToCore` messages.
        out: PUSH socket for :data:`~vmkv.server.core_protocol.FromCore` messages.
        parent_pid: exit when ``os.getppid()`` is no longer this.
    """

    def __init__(self, engine: Any, inp: zmq.Socket, out: zmq.Socket, parent_pid: int) -> None:
        self.engine = engine
        self.inp = inp
        self.out = out
        self.parent_pid = parent_pid
        self._stopping = False
        self._poller = zmq.Poller()
        self._poller.register(inp, zmq.POLLIN)

    def _send(self, msg: Any) -> None:
        self.out.send(proto.encoder.encode(msg))     # copied: zero-copy costs more below ~64 KiB

    def run(self) -> int:
        """Serve until :class:`~vmkv.server.core_protocol.Shutdown` (returns 0), a fatal error (1) or the
        parent's death (0)."""
        engine = self.engine
        num_failed_steps = 0
        status = 0
        logger.info("engine core ready (pid %d)", os.getpid())
        try:
            while not self._stopping:
                busy = engine.has_unfinished_requests()
                self._drain(block=not busy)
                if self._stopping:
                    break
                if os.getppid() != self.parent_pid:
                    logger.warning("engine core: the front process is gone; exiting")
                    break
                if not engine.has_unfinished_requests():
                    if not busy:
                        self._idle()     # at least every IDLE_POLL_S while nothing runs
                    continue
                try:
                    deltas = engine.step_deltas()
                except Exception as exc:
                    num_failed_steps += 1
                    if is_fatal_error(exc) or num_failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise
                    logger.exception("engine step failed; failing every open request")
                    self._fail_open_requests(exc)
                    continue
                num_failed_steps = 0
                if deltas:
                    self.out.send(proto.encode_step_outputs(deltas))
        except BaseException as exc:  # noqa: BLE001 - reported to the front before exiting
            logger.exception("engine core failed; exiting")
            try:
                self._send(proto.EngineFailed(f"{type(exc).__name__}: {exc}"))
            except Exception:  # noqa: BLE001
                pass
            status = 1
        else:
            for request_id in list(engine.requests.groups):   # graceful stop: free what is left
                engine.abort_request(request_id)
        try:
            engine.close()
        except Exception:  # noqa: BLE001
            logger.exception("engine.close() failed")
        logger.info("engine core stopped")
        return status

    def _idle(self) -> None:
        try:
            self.engine.idle()
        except Exception as exc:
            if is_fatal_error(exc):
                raise
            logger.warning("engine.idle() failed (ignored): %r", exc)

    def _drain(self, block: bool) -> None:
        """Handle every queued message (waiting up to :data:`IDLE_POLL_S` for the first when ``block``)."""
        if block and not self._poller.poll(IDLE_POLL_S * 1000):
            return
        while not self._stopping:
            try:
                frame = self.inp.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(proto.to_core_decoder.decode(frame.buffer))

    def _handle(self, msg: Any) -> None:
        engine = self.engine
        if isinstance(msg, proto.AddRequest):
            try:
                engine.add_request(msg.request_id, None, msg.params, prompt_token_ids=msg.prompt_token_ids,
                                   arrival_time=msg.arrival_time, cache_salt=msg.cache_salt)
            except ValueError as exc:
                self._send(proto.Rejected(msg.request_id, str(exc), getattr(exc, "param", None)))
        elif isinstance(msg, proto.Abort):
            for request_id in msg.request_ids:
                engine.abort_request(request_id)
        elif isinstance(msg, proto.FinishSequences):
            for request_id, index, stop in msg.items:
                engine.finish_sequence(request_id, index, stop)
        elif isinstance(msg, proto.Utility):
            self._utility(msg)
        elif isinstance(msg, proto.Shutdown):
            self._stopping = True

    def _utility(self, msg: Any) -> None:
        try:
            fn, args = pickle.loads(msg.payload)
            result = pickle.dumps(fn(self.engine, *args))
            ok = True
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            ok = False
            try:
                result = pickle.dumps(exc)
            except Exception:  # noqa: BLE001 - an exception that does not pickle
                result = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
        self._send(proto.UtilityResult(msg.call_id, ok, result))

    def _fail_open_requests(self, exc: Exception) -> None:
        """``engine.step()`` raised a non-fatal error it did not attribute (``LLMEngine.step`` does that
        itself; this covers other engines): fail and abort every open request, keep running."""
        deltas = []
        for request_id in list(self.engine.requests.groups):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s after a failed step failed", request_id)
            deltas.append(proto.RequestDelta(request_id, [], True, 0, f"request {request_id} failed: engine step "
                                                                     f"raised {type(exc).__name__}: {exc}"))
        self.engine.requests.take_unreported()
        if deltas:
            self._send(proto.StepOutputs(deltas))
