"""uvicorn, set up for serving: a header-read timeout, and a shutdown that answers what is still running.

- :class:`HeaderTimeoutH11Protocol`: uvicorn's h11 protocol with a deadline for the request head and
  one for the request body.  uvicorn has neither: a client that connects and never finishes its
  headers (slowloris), or declares a body and sends it slowly or never (slow POST, a ``GET`` with a
  huge ``Content-Length``), holds a connection for good.  The head deadline runs from the moment the
  connection can take a request head (it opened, or the previous response ended) until the head has
  been parsed; on expiry the connection is closed.  The body deadline runs from then until the whole
  body has arrived; on expiry the client gets HTTP 408 (``code="request_timeout"``, if no reply has
  started yet) and the connection is closed.  Trickling bytes extend neither.  A malformed body
  (invalid chunked framing) gets uvicorn's 400 and a close, or only the close when a reply has
  already started.
- :class:`Server`: on SIGINT/SIGTERM uvicorn stops accepting connections and waits for running requests;
  after ``graceful_timeout_s`` this server calls ``end_requests`` (the engine's shutdown), which ends every
  open request through the normal reply path: HTTP 503 with an OpenAI error body, or a stream's final
  error event and ``data: [DONE]``.  uvicorn itself would cancel the request tasks instead (a 499 with
  an empty body, streams cut without ``[DONE]``, a ``CancelledError`` traceback each); it does so here
  only for a task still running :data:`FORCE_MARGIN_S` later.

:func:`build_server` puts both together; ``vmkv serve`` and the server tests use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from typing import Any, Awaitable, Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HeaderTimeoutH11Protocol", "Server", "build_server", "DEFAULT_HEADER_TIMEOUT_S",
           "DEFAULT_BODY_TIMEOUT_S", "FORCE_MARGIN_S"]

logger = logging.getLogger(__name__)

#: default deadline for a request head (seconds); nginx and Node use 60, Apache 20-40
DEFAULT_HEADER_TIMEOUT_S = 30.0
#: default deadline for a request body, from the end of its head (seconds); 8 MiB (the default
#: ``--max-request-bytes``) in 60 s needs ~140 KB/s
DEFAULT_BODY_TIMEOUT_S = 60.0
#: how long after ``end_requests`` a request task may still run before uvicorn cancels it (seconds)
FORCE_MARGIN_S = 5.0


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is not complete within
    ``header_timeout_s`` seconds, and answering 408 and closing one whose request body is not complete
    within ``body_timeout_s`` seconds of its head (a subclass sets both; see :func:`build_server`)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        try:
            super().handle_events()
        except h11.LocalProtocolError:  # uvicorn's 400 for a malformed body after a reply had started
            logger.info("closing a connection from %s: malformed request body", self._peer())
            self.transport.close()
        if self.transport.is_closing() and self.cycle is not None and not self.cycle.response_complete:
            # uvicorn answered a malformed request (400) while the app was already running for it: the
            # app's receive() gets http.disconnect and its reply goes nowhere (h11 would refuse it)
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        state = self.conn.their_state
        if state is not h11.IDLE:  # a request head has been parsed (or the peer erred)
            self._cancel_header_timer()
        if state is h11.SEND_BODY and not self.transport.is_closing():
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.body_timeout_s, self._on_body_timeout)
        else:
            self._cancel_body_timer()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():  # keep-alive: the next head has a deadline too
            self._arm_header_timer()
        super().on_response_complete()  # may parse a pipelined head at once (handle_events disarms)

    def _peer(self) -> str:
        return "%s:%d" % self.client if self.client else "?"

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.info("closing a connection from %s: no complete request head within %.1f s",
                        self._peer(), self.header_timeout_s)
            self.transport.close()

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        logger.info("closing a connection from %s: request body not complete within %.1f s of its head",
                    self._peer(), self.body_timeout_s)
        if self.conn.our_state is h11.SEND_RESPONSE and (self.cycle is None or not self.cycle.response_started):
            body = json.dumps({"error": {
                "message": f"request body not received within {self.body_timeout_s:g} s of the request head "
                           "(the server's --body-timeout); send the whole body at once",
                "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
            with contextlib.suppress(h11.LocalProtocolError):
                self.transport.write(self.conn.send(h11.Response(status_code=408, reason=b"Request Timeout", headers=[
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")])))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
        if self.cycle is not None:  # the app's receive() gets http.disconnect; its reply goes nowhere
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.close()


class Server(uvicorn.Server):
    """uvicorn's server, with two changes:

    - after ``graceful_timeout_s`` of a graceful shutdown, ``end_requests()`` ends what still runs
      with a reply (see the module docstring);
    - a SIGINT/SIGTERM that led to a graceful shutdown ends with exit status 0 instead of being
      re-raised (uvicorn re-raises it after shutting down); a second SIGINT still forces the exit.

    Args:
        config: its ``timeout_graceful_shutdown`` is the hard limit after which uvicorn cancels tasks;
            :func:`build_server` sets it to ``graceful_timeout_s + FORCE_MARGIN_S``.
        graceful_timeout_s: how long running requests may take to finish after the signal.
        end_requests: awaited once the graceful timeout has passed with requests still running.
    """

    received_signal: int | None = None

    def __init__(self, config: uvicorn.Config, *, graceful_timeout_s: float,
                 end_requests: Callable[[], Awaitable[Any]] | None = None) -> None:
        super().__init__(config)
        self.graceful_timeout_s = float(graceful_timeout_s)
        self.end_requests = end_requests

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.received_signal = sig
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def shutdown(self, sockets: Any = None) -> None:
        if self.end_requests is None:
            await super().shutdown(sockets)
            return

        async def _end_after_grace() -> None:
            await asyncio.sleep(self.graceful_timeout_s)
            logger.warning("%d request(s) still running after the graceful timeout of %.1f s; ending them "
                           "(HTTP 503, or a final error event on a stream)", len(self.server_state.tasks),
                           self.graceful_timeout_s)
            await self.end_requests()  # type: ignore[misc]

        watchdog = asyncio.create_task(_end_after_grace())
        try:
            await super().shutdown(sockets)  # returns as soon as no request task is left
        finally:
            watchdog.cancel()


def build_server(app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                 graceful_timeout_s: float = 10.0, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                 end_requests: Callable[[], Awaitable[Any]] | None = None, **config_kwargs: Any) -> Server:
    """A :class:`Server` for ``app`` on ``host:port``.

    Args:
        end_requests: what ends the open requests after the graceful timeout; default the shutdown of
            the app's engine (``app.state.async_engine``), which answers each of them.
        header_timeout_s: deadline for a request head (> 0).
        body_timeout_s: deadline for a request body, from the end of its head (> 0).
        config_kwargs: more ``uvicorn.Config`` arguments.
    Raises:
        ValueError: ``header_timeout_s`` or ``body_timeout_s`` <= 0, or ``graceful_timeout_s`` < 0.
    """
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0 seconds, got {header_timeout_s!r}")
    if not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s must be > 0 seconds, got {body_timeout_s!r}")
    if not graceful_timeout_s >= 0:
        raise ValueError(f"graceful_timeout_s must be >= 0 seconds, got {graceful_timeout_s!r}")
    if end_requests is None:
        engine = getattr(getattr(app, "state", None), "async_engine", None)
        end_requests = engine.shutdown if engine is not None else None
    protocol = type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,),
                    {"header_timeout_s": float(header_timeout_s), "body_timeout_s": float(body_timeout_s)})
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                            timeout_graceful_shutdown=graceful_timeout_s + FORCE_MARGIN_S, **config_kwargs)
    return Server(config, graceful_timeout_s=graceful_timeout_s, end_requests=end_requests)
