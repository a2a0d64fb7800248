"""The front's end of the engine core process: spawn it, wait for its engine, carry messages both ways, stop
it (vLLM v1's ``core_client.py``).  Request state lives in :class:`~vmkv.server.async_engine.AsyncEngine`.

- :meth:`CoreClient.spawn` binds two ZMQ sockets on ``ipc://`` paths in a private temporary directory (mode
  0700), one per direction, and starts :func:`~vmkv.server.engine_core.run_engine_core` in a spawned child
  (spawn, not fork: CUDA, and the child must not inherit the front's threads).
- :meth:`CoreClient.wait_ready` blocks until the core sends ``Ready`` (its engine is built) and returns the
  engine's description, or raises :class:`EngineStartupError`.
- :meth:`CoreClient.start_receiver` starts the receiver thread (``vmkv-core-output``): it blocks on the
  core's socket, on the core's process sentinel and on a wake-up pipe, decodes each message and hands it to
  the event loop with one ``call_soon_threadsafe`` per message; when the core exits it reports the exit
  code the same way.
- :meth:`CoreClient.send` (event loop thread only: ZMQ sockets are not thread-safe) never blocks.
- :meth:`CoreClient.stop` waits for the core (after a ``Shutdown`` message), SIGKILLs it after the
  timeout, stops the receiver thread and closes the sockets.  Reaping the child happens under one lock:
  the receiver thread and the stop both wait for it, and two threads reaping one child race (the loser's
  ``waitpid`` fails and ``multiprocessing`` then reports the exited process as alive).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from typing import Any, Callable

import zmq

from vmkv.server import core_protocol as proto

__all__ = ["CoreClient", "EngineStartupError", "exit_text"]

logger = logging.getLogger(__name__)


class EngineStartupError(RuntimeError):
    """The engine core could not build the engine.

    Attributes:
        kind: ``"config"`` (a bad option: the message says which) or ``"error"``.
    """

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.kind = kind


class CoreClient:
    """One engine core process and the two sockets to it (see the module docstring).

    Args:
        engine_kwargs: ``LLMEngine.from_args`` keywords.
        engine_factory: a picklable callable building the engine in the core (default
            ``LLMEngine.from_args``).
        log_level: the core's logging level.
        torch_threads: ``torch.set_num_threads`` in the core, or None.
    """

    def __init__(self, engine_kwargs: dict[str, Any], engine_factory: Callable[..., Any] | None = None,
                 log_level: str = "info", torch_threads: int | None = None) -> None:
        self.engine_kwargs = dict(engine_kwargs)
        self.engine_factory = engine_factory
        self.log_level = log_level
        self.torch_threads = torch_threads
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._ctx: zmq.Context | None = None
        self._to_core: zmq.Socket | None = None
        self._from_core: zmq.Socket | None = None
        self._ipc_dir: str | None = None
        self._receiver: threading.Thread | None = None
        self._wake_r = self._wake_w = -1
        self._reap_lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def exitcode(self) -> int | None:
        return None if self.proc is None else self.proc.exitcode

    # ------------------------------------------------------------------ start
    def spawn(self) -> None:
        """Bind the sockets and start the core process (returns at once; idempotent)."""
        if self.proc is not None:
            return
        from vmkv.server.engine_core import run_engine_core

        self._ipc_dir = tempfile.mkdtemp(prefix="vmkv-core-")   # mode 0700: this user's only
        to_addr = f"ipc://{self._ipc_dir}/to_core"
        from_addr = f"ipc://{self._ipc_dir}/from_core"
        self._ctx = zmq.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.bind(to_addr)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.RCVHWM, 0)
        self._from_core.bind(from_addr)
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(target=run_engine_core, name="vmkv-engine-core", daemon=False,
                               args=(self.engine_kwargs, to_addr, from_addr, os.getpid(), self.engine_factory,
                                     self.log_level, self.torch_threads))
        self.proc.start()

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """Wait for the core's engine; returns ``engine_core.engine_info``'s dict.

        Raises:
            EngineStartupError: building the engine failed, the core died while starting, or it took
                longer than ``timeout_s``; the core is stopped and the sockets closed then.
        """
        try:
            return self._wait_ready(timeout_s)
        except BaseException:
            self.kill()
            self._close()
            raise

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        poller = zmq.Poller()
        poller.register(self._from_core, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineStartupError(f"the engine core did not start within {timeout_s:g} s")
            events = dict(poller.poll(min(left, 1.0) * 1000))
            if self._from_core in events:
                msg = proto.from_core_decoder.decode(self._from_core.recv())
                if isinstance(msg, proto.Ready):
                    return pickle.loads(msg.info)
                if isinstance(msg, proto.StartupFailed):
                    raise EngineStartupError(msg.message, msg.kind)
                continue
            if self.proc.sentinel in events or not self.alive():
                self._join(1)
                raise EngineStartupError(f"the engine core process exited while starting "
                                         f"({exit_text(self.exitcode)})")

    def start_receiver(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[Any], None],
                       on_exit: Callable[[int | None], None]) -> None:
        """Start the receiver thread: ``on_message(msg)`` and, once, ``on_exit(exitcode)`` run on ``loop``."""
        self._wake_r, self._wake_w = os.pipe()
        self._receiver = threading.Thread(target=self._receive, args=(loop, on_message, on_exit),
                                          name="vmkv-core-output", daemon=True)
        self._receiver.start()

    # ------------------------------------------------------------------ traffic
    def send(self, msg: Any) -> None:
        """Send one message to the core (event loop thread only; never blocks; dropped once closed)."""
        if self._to_core is None:
            return
        try:
            self._to_core.send(proto.encoder.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("could not send %s to the engine core: %s", type(msg).__name__, exc)

    def _receive(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[Any], None],
                 on_exit: Callable[[int | None], None]) -> None:
        poller = zmq.Poller()
        poller.register(self._from_core, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._wake_r in events:
                return
            if self._from_core in events:
                while True:
                    try:
                        frame = self._from_core.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if not _post(loop, on_message, proto.from_core_decoder.decode(frame.buffer)):
                        return
                continue
            if self.proc.sentinel in events:
                self._join(1)
                _post(loop, on_exit, self.exitcode)
                return

    # ------------------------------------------------------------------ stop
    def _join(self, timeout_s: float) -> None:
        with self._reap_lock:
            self.proc.join(timeout_s)

    def alive(self) -> bool:
        with self._reap_lock:
            return self.proc is not None and self.proc.is_alive()

    def kill(self, timeout_s: float = 5.0) -> None:
        """SIGKILL the core (it ignores SIGTERM and SIGINT: the front decides when it stops)."""
        if self.proc is None or not self.alive():
            return
        self.proc.kill()
        self._join(timeout_s)

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the core to exit (send ``Shutdown`` first), SIGKILL it past that,
        then stop the receiver thread and close the sockets (blocking)."""
        if self.proc is None:
            return
        self._join(timeout_s)
        if self.alive():
            logger.warning("engine core did not stop within %.1f s; killing it", timeout_s)
            self.kill()
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")          # the receiver thread stops
        if self._receiver is not None:
            self._receiver.join(5)
        self._close()

    def _close(self) -> None:
        for sock in (self._to_core, self._from_core):
            if sock is not None:
                sock.close(linger=0)
        self._to_core = self._from_core = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
    """``loop.call_soon_threadsafe(fn, *args)``; False when the loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


def exit_text(exitcode: int | None) -> str:
    """``"killed by SIGKILL"``, ``"exit status 1"``, ...: how a process ended."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"
