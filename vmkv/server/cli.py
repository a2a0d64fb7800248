"""``vmkv serve``: the OpenAI-compatible HTTP server on the engine.

    vmkv serve [--model PATH] [--backend paged|vmem] [--host 127.0.0.1] [--port 8000] [engine knobs]

The engine knobs are the ones ``vmkv generate`` takes too (:mod:`vmkv.engine.args`); their defaults
come from :mod:`vmkv.engine.config`.  uvicorn handles SIGINT/SIGTERM: it stops accepting
connections, lets running requests finish for ``--graceful-timeout`` seconds (then cancels them, which
aborts their engine requests), and the app's lifespan stops the engine thread.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

from vmkv.engine.args import add_engine_args, apply_threads, engine_kwargs, parse_size

__all__ = ["add_arguments", "run", "engine_kwargs"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options: the server group and the shared engine options of
    :func:`vmkv.engine.args.add_engine_args` (defaults from the engine config dataclasses)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients send and /v1/models lists (default: the model's name)")
    g.add_argument("--graceful-timeout", type=float, default=10.0,
                   help="seconds running requests may take to finish after SIGINT/SIGTERM "
                        "(default: %(default)s)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--max-request-bytes", type=parse_size, default=8 << 20, metavar="SIZE",
                   help="larger request bodies get HTTP 413 (default: 8MiB)")

    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    """Load the model, build the engine and serve until SIGINT/SIGTERM.  Returns the exit code."""
    import uvicorn

    from vmkv.engine.llm_engine import LLMEngine
    from vmkv.server.app import build_app
    from vmkv.server.async_engine import AsyncEngine

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    apply_threads(args)
    try:
        engine = LLMEngine.from_args(**engine_kwargs(args))
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"vmkv serve: cannot start the engine: {exc}", file=sys.stderr)
        return 2
    served = args.served_model_name or engine.model_name
    app = build_app(AsyncEngine(engine), served, backend=args.backend,
                    max_request_bytes=args.max_request_bytes)
    u = engine.kv_cache.usage()
    print(f"vmkv serve: model {served} ({engine.model_name}), backend {args.backend}, "
          f"max_model_len {engine.max_model_len}, KV capacity {u.capacity_bytes / 2**20:.1f} MiB; "
          f"listening on http://{args.host}:{args.port}/v1", flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.graceful_timeout, access_log=False)
    server = _server_class()(config)
    server.run()  # SIGINT/SIGTERM: graceful shutdown, then the app's lifespan stops the engine thread
    if server.received_signal is not None:
        print(f"vmkv serve: stopped ({signal.Signals(server.received_signal).name})", flush=True)
    else:
        print("vmkv serve: stopped", flush=True)
    return 0 if server.started else 1


def _server_class() -> type:
    import uvicorn

    class _GracefulServer(uvicorn.Server):
        """uvicorn's server, but a SIGINT/SIGTERM that led to a graceful shutdown ends with exit status 0
        instead of being re-raised (uvicorn re-raises it after shutting down); a second SIGINT still
        forces the exit."""

        received_signal: int | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.received_signal = sig
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    return _GracefulServer
