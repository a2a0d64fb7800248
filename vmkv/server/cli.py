"""``vmkv serve``: the OpenAI-compatible HTTP server on the engine.

    vmkv serve [--model PATH] [--backend paged|vmem] [--host 127.0.0.1] [--port 8000] [engine knobs]

Engine knob defaults come from :class:`~vmkv.engine.config.CacheConfig` and
:class:`~vmkv.engine.config.SchedulerConfig`.  uvicorn handles SIGINT/SIGTERM: it stops accepting
connections, lets running requests finish for ``--graceful-timeout`` seconds (then cancels them, which
aborts their engine requests), and the app's lifespan stops the engine thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import signal
import sys
from typing import Any

__all__ = ["add_arguments", "run", "parse_bytes", "engine_kwargs"]

logger = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
          "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """``"512MiB"`` -> 536870912; accepts plain integers and k/M/G/T with or without ``i``/``B``.

    Raises:
        argparse.ArgumentTypeError: not a positive size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}; use e.g. 268435456, 256MiB or 4GiB")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def _defaults() -> dict[str, Any]:
    from vmkv.engine.config import CacheConfig, EngineConfig, SchedulerConfig

    out: dict[str, Any] = {}
    for cls in (CacheConfig, SchedulerConfig, EngineConfig):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out.setdefault(f.name, f.default)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options (defaults from the engine config dataclasses)."""
    d = _defaults()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients send and /v1/models lists (default: the model's name)")
    g.add_argument("--graceful-timeout", type=float, default=10.0,
                   help="seconds running requests may take to finish after SIGINT/SIGTERM "
                        "(default: %(default)s)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--max-request-bytes", type=parse_bytes, default=8 << 20,
                   help="larger request bodies get HTTP 413 (default: 8MiB)")

    e = parser.add_argument_group("engine")
    e.add_argument("--model", default=d["model"],
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    e.add_argument("--backend", choices=["paged", "vmem"], default=d["backend"],
                   help="KV-cache backend (default: %(default)s)")
    e.add_argument("--device", default=d["device"], help="cpu, cuda, cuda:N (default: cuda if available)")
    e.add_argument("--dtype", default=d["dtype"], help="float32, float16, bfloat16 (default: bf16 on "
                                                       "CUDA, fp32 on CPU)")
    e.add_argument("--seed", type=int, default=d["seed"], help="engine seed (default: %(default)s)")
    e.add_argument("--random-weights", default=d["random_weights"],
                   help="serve a named random-weight shape (tiny, smollm2-135m, llama3-8b, ...)")
    e.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"],
                   help="sequences running at once (default: %(default)s)")
    e.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"],
                   help="token budget per step (default: %(default)s)")
    e.add_argument("--max-model-len", type=int, default=d["max_model_len"],
                   help="context length, prompt + output (default: min(model context, 4096))")
    mem = e.add_mutually_exclusive_group()
    mem.add_argument("--memory-bytes", type=parse_bytes, default=d["memory_bytes"],
                     help="KV memory budget, e.g. 512MiB (default: 256 MiB on CPU, "
                          "--gpu-memory-utilization of free memory on CUDA)")
    mem.add_argument("--gpu-memory-utilization", type=float, default=d["gpu_memory_utilization"],
                     help="fraction of free GPU memory for KV (default: %(default)s)")
    e.add_argument("--block-size", type=int, default=d["block_size"],
                   help="paged: tokens per block (default: %(default)s)")
    e.add_argument("--page-size-bytes", type=parse_bytes, default=d["page_size_bytes"],
                   help="vmem: bytes per page, e.g. 2MiB (default: the driver's)")
    e.add_argument("--layout", choices=["megacache", "per_layer"], default=d["layout"],
                   help="vmem: virtual layout (default: %(default)s)")
    e.add_argument("--driver", choices=["auto", "cuda", "host"], default=d["driver"],
                   help="vmem: page driver (default: %(default)s)")
    e.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=d["enable_prefix_caching"], help="disable prefix caching")
    e.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   default=d["enable_chunked_prefill"], help="disable chunked prefill")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of ``LLMEngine.from_args`` from parsed ``serve`` options."""
    return dict(
        model=args.model, kv_backend=args.backend, device=args.device, dtype=args.dtype,
        seed=args.seed, random_weights=args.random_weights, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        memory_bytes=args.memory_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size, page_size_bytes=args.page_size_bytes, layout=args.layout,
        driver=args.driver, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
    )


def run(args: argparse.Namespace) -> int:
    """Load the model, build the engine and serve until SIGINT/SIGTERM.  Returns the exit code."""
    import uvicorn

    from vmkv.engine.llm_engine import LLMEngine
    from vmkv.server.app import build_app
    from vmkv.server.async_engine import AsyncEngine

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
