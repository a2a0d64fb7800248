"""A tensor-parallel worker process (ranks ``1 .. N-1``; :mod:`vmkv.engine.tensor_parallel` starts it).

It loads its shard, joins the process group, then serves rank 0's messages in order, over its pipe:

- ``("cache", backend, spec, kwargs)``: build its KV cache; reply ``("cache", free_tokens)``;
- ``("step", ops, input_ids | None)``: replay rank 0's recorded cache calls in order (checking that
  ``allocate`` finds what rank 0 found), then, with ``input_ids``, run its shard's forward on the
  metadata of the last ``prepare`` (the collectives pair with rank 0's);
- ``("usage",)``: reply ``("usage", cache.usage())``;
- ``("close",)``: close the cache, leave the group, exit.

Anything that raises is reported as ``("error", rank, traceback)`` and ends the process (rank 0 then
stops the engine).  When rank 0's process is gone (EOF on the pipe, or a new parent) it exits quietly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from vmkv.engine.host_copy import to_device
from vmkv.engine.tensor_parallel import COLLECTIVE_TIMEOUT_S, TensorParallelError, load_shard
from vmkv.kvcache import create_kv_cache
from vmkv.model.parallel import TensorParallel

__all__ = ["WorkerArgs", "worker_main", "replay"]

logger = logging.getLogger(__name__)

#: seconds between checks that rank 0's process still exists while waiting for a message
PARENT_POLL_S = 1.0


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker process needs (pickled to it at spawn)."""

    config: object          # the EngineConfig
    rank: int
    size: int
    device: str
    dtype: torch.dtype
    backend: str            # "gloo" or "nccl"
    init_method: str        # "file://...": the group's rendezvous
    num_threads: int        # torch intra-op threads (rank 0's)
    parent_pid: int


def worker_main(args: WorkerArgs, conn) -> None:
    """Entry point of the spawned process (see the module docstring)."""
    try:
        torch.set_num_threads(args.num_threads)
        device = torch.device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        loaded = load_shard(args.config, device, args.dtype, TensorParallel(args.rank, args.size))
        conn.send(("loaded",))
        dist.init_process_group(args.backend, init_method=args.init_method, rank=args.rank,
                                world_size=args.size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        _serve(args, conn, loaded.model, device)
    except BaseException:  # noqa: BLE001  (reported to rank 0, then the process ends)
        text = traceback.format_exc()
        try:
            conn.send(("error", args.rank, text))
        except OSError:
            pass                                # rank 0 is gone: nobody to tell
        raise SystemExit(1) from None


def _recv(conn, parent_pid: int):
    """The next message, or ``None`` when rank 0's process is gone."""
    while True:
        try:
            if conn.poll(PARENT_POLL_S):
                return conn.recv()
        except (EOFError, OSError):
            return None
        if os.getppid() != parent_pid:
            return None


def _serve(args: WorkerArgs, conn, model, device: torch.device) -> None:
    cache, meta = None, None
    try:
        while True:
            msg = _recv(conn, args.parent_pid)
            if msg is None or msg[0] == "close":
                return
            if msg[0] == "cache":
                _, backend, spec, kwargs = msg
                cache = create_kv_cache(backend, dataclasses.replace(spec, device=str(device)), **kwargs)
                conn.send(("cache", cache.usage().free_tokens))
            elif msg[0] == "usage":
                conn.send(("usage", cache.usage()))
            elif msg[0] == "step":
                _, ops, input_ids = msg
                meta = replay(cache, ops, meta, args.rank)
                if input_ids is not None:
                    with torch.inference_mode():
                        ids = to_device(input_ids, torch.int64, device)
                        model.forward(ids, meta.positions, cache, meta)
            else:
                raise TensorParallelError(f"rank {args.rank}: unknown message {msg[0]!r}")
    finally:
        if cache is not None:
            cache.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def replay(cache, ops: list, meta, rank: int):
    """Apply rank 0's recorded calls ``ops`` to ``cache`` in order; returns the metadata of the last
    ``prepare`` among them (else ``meta``).

    Raises:
        TensorParallelError: a call's result differs from rank 0's (the caches diverged).
    """
    for name, args, kwargs, expected in ops:
        got = getattr(cache, name)(*args, **kwargs)
        if name == "prepare":
            meta = got
        elif expected is not None and got != expected:
            raise TensorParallelError(f"rank {rank}: {name}{args} returned {got!r}, rank 0's {expected!r}: "
                                      f"the ranks' KV caches diverged")
    return meta
