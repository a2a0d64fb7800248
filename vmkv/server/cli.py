"""``vmkv serve``: the OpenAI-compatible HTTP server on the engine.

    vmkv serve [--model PATH] [--backend paged|vmem] [--host 127.0.0.1] [--port 8000] [engine knobs]

The engine knobs are the ones ``vmkv generate`` takes too (:mod:`vmkv.engine.args`); their defaults
come from :mod:`vmkv.engine.config`.  The engine (scheduler, KV cache, model runner, TP workers) runs in
a process of its own, the engine core (:mod:`vmkv.server.engine_core`); this process serves HTTP,
tokenizes, detokenizes and applies stop strings (:mod:`vmkv.server.async_engine`).  On SIGINT/SIGTERM the server stops accepting connections and
lets running requests finish for ``--graceful-timeout`` seconds; then it stops the engine, which ends
what is still running with HTTP 503 (an error event and ``[DONE]`` on a stream), and exits
(:mod:`vmkv.server.http_server`).  A client that does not send a complete request head within
``--header-timeout`` seconds is disconnected; one whose request body is not complete within
``--body-timeout`` seconds of its head gets HTTP 408 and is disconnected.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys

from vmkv.engine.args import add_engine_args, engine_kwargs, parse_size
from vmkv.server.http_server import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, build_server

__all__ = ["add_arguments", "run", "engine_kwargs"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options: the server group and the shared engine options of
    :func:`vmkv.engine.args.add_engine_args` (defaults from the engine config dataclasses)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    g.add_argument("--port", type=_port, default=8000, help="TCP port, 0..65535 (0: any free port; default: "
                                                            "%(default)s)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients send and /v1/models lists (default: the model's name)")
    g.add_argument("--graceful-timeout", type=_seconds(0.0), default=10.0, metavar="SECONDS",
                   help="seconds running requests may take to finish after SIGINT/SIGTERM; then they get "
                        "HTTP 503 (default: %(default)s)")
    g.add_argument("--header-timeout", type=_seconds(None), default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                   help="a client must send a complete request head within this many seconds of connecting "
                        "(or of the previous response), or it is disconnected (default: %(default)s)")
    g.add_argument("--body-timeout", type=_seconds(None), default=DEFAULT_BODY_TIMEOUT_S, metavar="SECONDS",
                   help="a client must send the whole request body within this many seconds of its head, or "
                        "it gets HTTP 408 and is disconnected (default: %(default)s)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--max-request-bytes", type=parse_size, default=8 << 20, metavar="SIZE",
                   help="larger request bodies get HTTP 413 (default: 8MiB)")

    add_engine_args(parser)


def _port(text: str) -> int:
    """``argparse`` type: a TCP port in [0, 65535] (checked before the model loads)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [0, 65535], got {text!r}")
    return value


def _seconds(minimum: float | None):
    """``argparse`` type: a finite number of seconds, ``>= minimum`` (``> 0`` when ``minimum`` is None)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        ok = value >= minimum if minimum is not None else value > 0
        if not ok or value == float("inf"):
            bound = f">= {minimum:g}" if minimum is not None else "> 0"
            raise argparse.ArgumentTypeError(f"expected a number of seconds {bound}, got {text!r}")
        return value
    return parse


def _listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port`` 0: any free one), made before the model loads so that a
    port in use fails at once instead of after the load (vLLM binds first too); uvicorn listens on it.

    Raises:
        OSError: the address cannot be bound (in use, not this host's, ...).
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def run(args: argparse.Namespace) -> int:
    """Bind the port, start the engine core process, then serve until SIGINT/SIGTERM.  Returns the exit code."""
    from vmkv.server.async_engine import AsyncEngine, EngineStartupError

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = _listen_socket(args.host, args.port)
    except OSError as exc:
        print(f"vmkv serve: cannot listen on {args.host}:{args.port}: {exc} (choose another --port or --host)",
              file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    engine = AsyncEngine(engine_kwargs(args), log_level=args.log_level, torch_threads=getattr(args, "threads", None))
    engine.spawn_core()                      # the model loads while this process imports the HTTP stack
    from vmkv.server.app import build_app
    try:
        engine.start_core()
    except EngineStartupError as exc:
        sock.close()
        print(f"vmkv serve: cannot start the engine: {exc}", file=sys.stderr)
        return 2 if exc.kind == "config" else 1
    except KeyboardInterrupt:                # Ctrl-C while the model loads: the core is stopped already
        sock.close()
        print("vmkv serve: interrupted while starting", file=sys.stderr)
        return 130
    try:
        served = args.served_model_name or engine.model_name
        app = build_app(engine, served, backend=args.backend, max_request_bytes=args.max_request_bytes)
        print(f"vmkv serve: model {served} ({engine.model_name}), backend {args.backend}, "
              f"max_model_len {engine.max_model_len}, KV capacity {engine.kv_capacity_bytes / 2**20:.1f} MiB, "
              f"engine core pid {engine.core_pid}; listening on http://{args.host}:{port}/v1", flush=True)
        server = build_server(app, host=args.host, port=port, log_level=args.log_level,
                              graceful_timeout_s=args.graceful_timeout, header_timeout_s=args.header_timeout,
                              body_timeout_s=args.body_timeout, access_log=False)
        server.run(sockets=[sock])  # SIGINT/SIGTERM: graceful shutdown, then the lifespan stops the core
    finally:
        engine.close_sync()   # the core never outlives this process (a no-op after the lifespan's shutdown)
        sock.close()
    if server.received_signal is not None:
        print(f"vmkv serve: stopped ({signal.Signals(server.received_signal).name})", flush=True)
    else:
        print("vmkv serve: stopped", flush=True)
    return 0 if server.started else 1
