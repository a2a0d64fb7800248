"""Tensor parallelism of the engine: rank 0 is the engine's process, ranks ``1 .. N-1`` are worker
processes it starts (``torch.multiprocessing``, spawn), joined in one ``torch.distributed`` group
(gloo on CPU, NCCL on CUDA; ``NCCL_*`` variables such as ``NCCL_NVLS_ENABLE`` are left as the
environment sets them).

The engine itself is unchanged: :func:`load_engine_model` gives it a model whose ``forward`` is
:meth:`TensorParallelExecutor.forward`, and :func:`kv_cache_factory` a cache that is rank 0's cache
plus a record of the calls the scheduler makes on it (:class:`~vmkv.engine.tp_cache.ReplicatedKVCache`).
One step across ranks::

    rank 0 (engine)                                     rank r (vmkv.engine.tp_worker)
    schedule: allocate/extend/free... on rank 0's cache,
      recorded
    prepare(batch) on rank 0's cache, recorded
    forward: send ("step", recorded calls, input ids) -> replay the calls in order (same layout),
                                                         the last one prepare(batch): meta
             rank 0's shard forward  <-- all-reduce per layer, all-gather of the logits -->  rank r's
    sample on the full logits; prefetch/release_idle recorded for the next step

Scheduling, sampling and detokenization happen once, on rank 0.  A worker that fails or dies makes the
next (or current) step raise :class:`TensorParallelError`, a :class:`~vmkv.engine.errors.FatalEngineError`:
the engine stops (the server's ``/health`` answers 503).  Workers are daemon processes that exit when
rank 0 closes the engine, and by themselves when rank 0's process is gone (their pipe reaches EOF).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import multiprocessing.process
import shutil
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist

from vmkv.engine.errors import FatalEngineError
from vmkv.engine.tp_cache import ReplicatedKVCache
from vmkv.kvcache import KVCache, KVCacheSpec, create_kv_cache
from vmkv.model.parallel import TensorParallel

__all__ = ["TensorParallelExecutor", "TensorParallelError", "load_engine_model", "load_shard",
           "kv_cache_factory", "rank_devices", "COLLECTIVE_TIMEOUT_S"]

logger = logging.getLogger(__name__)

#: seconds a collective (or the group's start-up) waits for the other ranks before it fails
COLLECTIVE_TIMEOUT_S = 300.0
#: seconds rank 0 waits for the workers to load their shards, or to build their caches
START_TIMEOUT_S = 1800.0
#: seconds a worker gets to exit after being told to, before it is terminated
SHUTDOWN_TIMEOUT_S = 10.0


class TensorParallelError(FatalEngineError):
    """A tensor-parallel worker failed or died, or the ranks' caches diverged: the engine stops."""


def check_main_reimportable(what: str) -> None:
    """Raise ``ValueError`` when a spawned process could not re-import this process's main module.

    ``multiprocessing``'s spawn start method makes every new process run the parent's ``__main__`` again
    from its file (``__main__.__file__``), unless it was run as a module (``python -m``).  A script read
    from standard input (``python - < script.py``) has ``__file__ == "<stdin>"``: each rank would die at
    start-up on a missing file, long before it says why.  ``what`` names the caller in the message.
    """
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return                                  # python -m pkg.mod: re-imported by name
    path = getattr(main, "__file__", None)
    if path is None:
        return                                  # python -c or the REPL: spawn does not re-import it
    if not os.path.isabs(path):
        path = os.path.join(multiprocessing.process.ORIGINAL_DIR or os.getcwd(), path)
    if not os.path.isfile(path):
        source = ("standard input (`python - < script.py`)" if main.__file__ == "<stdin>"
                  else f"{main.__file__!r}, which is no file")
        raise ValueError(f"{what} starts one process per rank, and each rank re-imports the main module: "
                         f"the ranks cannot re-import a main module read from {source}; "
                         "save the script to a file and run `python script.py` (with the "
                         "`if __name__ == \"__main__\":` guard), or use `vmkv generate` / `vmkv serve`")


def load_shard(config, device: torch.device, dtype: torch.dtype, tp: TensorParallel, progress=None):
    """One rank's :class:`~vmkv.model.LoadedModel`: ``config.random_weights`` (seeded) or
    ``config.model``, holding rank ``tp.rank``'s shard.  Raises what ``vmkv.model`` raises."""
    from vmkv import model as model_pkg  # noqa: PLC0415  (heavy; imported on demand)

    if config.random_weights:
        return model_pkg.random_model(config.random_weights, device=str(device), dtype=dtype,
                                      seed=config.seed, tp=tp)
    return model_pkg.load_model(config.model, device=str(device), dtype=dtype, progress=progress, tp=tp)


def load_engine_model(config, device: torch.device, dtype: torch.dtype, progress=None):
    """The engine's model: the whole model (``tensor_parallel_size == 1``), or rank 0's shard behind a
    :class:`TensorParallelExecutor` with the workers started and the group formed."""
    if config.tensor_parallel_size == 1:
        return load_shard(config, device, dtype, TensorParallel(), progress)
    return TensorParallelExecutor.start(config, device, dtype, progress)


def kv_cache_factory(config, model, default=create_kv_cache):
    """``default`` (``create_kv_cache``), or under tensor parallelism the executor's (every rank builds
    its cache, rank 0's is returned).

    Raises:
        ValueError: ``tensor_parallel_size > 1`` with a model not started by :func:`load_engine_model`
            (an already loaded one: the workers must load their shards themselves).
    """
    if isinstance(model, TensorParallelExecutor):
        return model.create_kv_cache
    if config.tensor_parallel_size > 1:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} needs the engine to load the "
                         f"model in every rank; pass model= or random_weights=, not an already loaded model")
    return default


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """Each rank's device: ``device`` on CPU; on CUDA GPUs ``index .. index + size - 1``.

    Raises:
        ValueError: fewer visible GPUs than that.
    """
    if device.type != "cuda":
        return [device] * size
    base = 0 if device.index is None else device.index
    count = torch.cuda.device_count()
    if base + size > count:
        raise ValueError(f"tensor_parallel_size={size} on {device} needs GPUs {base}..{base + size - 1}, and "
                         f"{count} are visible; lower --tensor-parallel-size to at most {count - base}")
    return [torch.device("cuda", base + r) for r in range(size)]


@dataclass
class _Worker:
    rank: int
    process: object     # the spawned multiprocessing.Process
    conn: object        # rank 0's end of its pipe


def _stop(workers: list[_Worker], store_dir: str, failed: list[bool]) -> None:
    """Tell the workers to exit, wait, terminate the stragglers; leave the group; remove the store."""
    for w in workers:
        if not failed[0]:
            try:
                w.conn.send(("close",))
            except OSError:
                pass
    deadline = time.monotonic() + (0.0 if failed[0] else SHUTDOWN_TIMEOUT_S)
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
        if w.process.is_alive():
            w.process.terminate()
            w.process.join(5.0)
        if w.process.is_alive():
            w.process.kill()
            w.process.join(5.0)
        w.conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    shutil.rmtree(store_dir, ignore_errors=True)


class TensorParallelExecutor:
    """Rank 0's model under tensor parallelism: ``forward`` runs a step on every rank (see the module
    docstring).  Built by :meth:`start`; stopped by :meth:`shutdown` (the cache's ``close`` calls it,
    and so does garbage collection and interpreter exit).

    Attributes:
        model: rank 0's :class:`~vmkv.model.LlamaForCausalLM` shard.
        size: ranks.
        backend: the ``torch.distributed`` backend (``gloo`` on CPU, ``nccl`` on CUDA).
        devices: each rank's device.
    """

    def __init__(self, size: int, workers: list[_Worker], store_dir: str, backend: str = "gloo",
                 devices: list[torch.device] | None = None) -> None:
        self.size = size
        self.backend = backend
        self.devices = list(devices or ())
        self.model = None
        self.workers = workers
        self._failed = [False]          # shared with the finalizer: a failed group is not asked to close
        self._finalizer = weakref.finalize(self, _stop, workers, store_dir, self._failed)

    @classmethod
    def start(cls, config, device: torch.device, dtype: torch.dtype, progress=None):
        """Spawn ranks ``1..N-1``, load rank 0's shard meanwhile, form the group; returns rank 0's
        :class:`~vmkv.model.LoadedModel` with ``model`` replaced by the executor.

        Raises:
            ValueError: the model does not divide by ``N``, too few GPUs, or a process group exists.
            TensorParallelError: a worker failed to start (its traceback in the message).
        """
        size = config.tensor_parallel_size
        if dist.is_initialized():
            raise ValueError("a torch.distributed process group already exists in this process; one "
                             "tensor-parallel engine per process (close the other engine first)")
        check_main_reimportable(f"tensor_parallel_size={size}")
        devices = rank_devices(device, size)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(devices[0])
        store_dir = tempfile.mkdtemp(prefix="vmkv-tp-")
        init_method = "file://" + os.path.join(store_dir, "store")
        ctx = torch.multiprocessing.get_context("spawn")
        workers: list[_Worker] = []
        executor = cls(size, workers, store_dir, backend, devices)
        logger.info("tensor parallel: %d ranks (%s, %s); every step runs eagerly (no CUDA graphs)", size,
                    backend, ", ".join(map(str, devices)))
        try:
            from vmkv.engine.tp_worker import WorkerArgs, worker_main  # noqa: PLC0415  (imports this module)

            for rank in range(1, size):
                parent, child = ctx.Pipe()
                args = WorkerArgs(config, rank, size, str(devices[rank]), dtype, backend, init_method,
                                  torch.get_num_threads(), os.getpid())
                proc = ctx.Process(target=worker_main, args=(args, child), daemon=True, name=f"vmkv-tp{rank}")
                proc.start()
                child.close()
                workers.append(_Worker(rank, proc, parent))
            loaded = load_shard(config, devices[0], dtype, TensorParallel(0, size), progress)
            executor._wait_all("loaded", "loading its shard")
            dist.init_process_group(backend, init_method=init_method, rank=0, world_size=size,
                                    timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        except BaseException:
            executor._failed[0] = True
            executor.shutdown()
            raise
        executor.model = loaded.model
        return dataclasses.replace(loaded, model=executor)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def description(self) -> str:
        """``"2 ranks (gloo; cpu, cpu)"``: what ``vmkv generate`` reports."""
        return f"{self.size} ranks ({self.backend}; {', '.join(map(str, self.devices))})"

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    # ------------------------------------------------------------------ the KV caches
    def create_kv_cache(self, backend: str, spec: KVCacheSpec, *, max_num_seqs: int, max_model_len: int,
                        memory_bytes: int, options=None) -> ReplicatedKVCache:
        """Build every rank's cache: ``num_kv_heads / N`` heads, ``memory_bytes / N`` bytes, the same
        limits and options; returns rank 0's as a :class:`ReplicatedKVCache` of the whole model.

        Raises:
            ValueError: ``spec.num_kv_heads`` does not divide by ``N``; what ``create_kv_cache`` raises.
            TensorParallelError: a worker's cache differs from rank 0's (or failed to build).
        """
        if spec.num_kv_heads % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} does not divide num_kv_heads={spec.num_kv_heads}")
        shard = dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // self.size)
        kwargs = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      memory_bytes=memory_bytes // self.size, options=options)
        self._send(("cache", backend, shard, kwargs))
        inner = create_kv_cache(backend, shard, **kwargs)
        try:
            free_tokens = inner.usage().free_tokens
            for rank, got in self._wait_all("cache", "building its KV cache"):
                if got != free_tokens:
                    raise TensorParallelError(f"rank {rank}'s KV cache holds {got} tokens, rank 0's {free_tokens}: "
                                              f"the ranks would not make the same allocation decisions")
        except BaseException:
            inner.close()
            self.shutdown()
            raise
        return ReplicatedKVCache(inner, spec, self.size, flush=self._flush, shutdown=self.shutdown,
                                 max_num_seqs=max_num_seqs, max_model_len=max_model_len, memory_bytes=memory_bytes)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta) -> torch.Tensor:
        """One step on every rank: the recorded cache calls and ``input_ids`` go to the workers, rank 0
        runs its shard; the all-gathered logits come back.

        Args:
            input_ids: ``int64 [num_tokens]``; positions: ``int64 [num_tokens]``.
            kv_cache: the :class:`ReplicatedKVCache` whose last recorded call prepared ``meta``.
            meta: rank 0's :class:`~vmkv.kvcache.AttentionMetadata` of the step.
        Returns:
            ``float32 [num_seqs, vocab_size]``: the whole vocabulary's logits at each last new token.
        Raises:
            TensorParallelError: a worker failed or died (the engine stops).
        """
        self._check_workers()
        self._send(("step", kv_cache.take_ops(), input_ids.tolist()))
        try:
            return self.model.forward(input_ids, positions, kv_cache.inner, meta)
        except Exception as exc:    # the ranks are out of step now: nothing can run after this
            raise self._failure(f"rank 0's forward raised {exc!r}") from exc
        except BaseException:       # interrupted mid-step (SIGINT/SIGTERM): the workers wait in a
            self._failed[0] = True  # collective and cannot read "close"; shutdown terminates them
            raise

    def _flush(self, ops: list) -> None:
        """Send recorded cache calls now, without a forward."""
        self._check_workers()
        self._send(("step", ops, None))

    def rank_usages(self, kv_cache: ReplicatedKVCache) -> list:
        """Every rank's ``usage()`` after the calls recorded so far, rank 0's first: all equal while
        the ranks' caches agree (tests, debugging)."""
        self._flush(kv_cache.take_ops())
        self._send(("usage",))
        return [kv_cache.inner.usage()] + [u for _, u in self._wait_all("usage", "reporting its KV usage")]

    # ------------------------------------------------------------------ workers
    def _send(self, msg) -> None:
        data = bytes(ForkingPickler.dumps(msg))     # pickled once for every worker
        for w in self.workers:
            try:
                w.conn.send_bytes(data)
            except OSError as exc:
                raise self._failure(f"rank {w.rank} is gone ({exc!r})") from exc

    def _check_workers(self) -> None:
        """Raise :class:`TensorParallelError` when a worker reported an error or exited."""
        if self._failed[0]:
            raise TensorParallelError("a tensor-parallel worker failed earlier; the engine is stopped")
        for w in self.workers:
            if w.conn.poll() or not w.process.is_alive():
                raise self._failure(f"rank {w.rank} stopped")

    def _wait_all(self, what: str, doing: str) -> list[tuple[int, object]]:
        """Each worker's reply ``(what, value)``, by rank; a worker that reports an error or exits
        meanwhile (or takes longer than :data:`START_TIMEOUT_S`) raises :class:`TensorParallelError`."""
        out = []
        deadline = time.monotonic() + START_TIMEOUT_S
        for w in self.workers:
            while not w.conn.poll(0.05):
                if not w.process.is_alive():
                    raise self._failure(f"rank {w.rank} exited while {doing}")
                if time.monotonic() > deadline:
                    raise self._failure(f"rank {w.rank} took more than {START_TIMEOUT_S:.0f} s {doing}")
            try:
                msg = w.conn.recv()
            except (EOFError, OSError) as exc:
                raise self._failure(f"rank {w.rank} exited while {doing}") from exc
            if msg[0] != what:
                raise self._failure(f"rank {w.rank} failed while {doing}", msg)
            out.append((w.rank, msg[1] if len(msg) > 1 else None))
        return out

    def _failure(self, what: str, msg=None) -> TensorParallelError:
        """Mark the group failed and build the error: ``what`` plus every worker's report (its
        traceback) or exit code, read within a second."""
        self._failed[0] = True
        reports = []
        for w in self.workers:
            got = msg if msg is not None and msg[1] == w.rank else None
            try:
                if got is None and w.conn.poll(1.0):
                    got = w.conn.recv()
            except (EOFError, OSError):
                pass
            if got is not None and got[0] == "error":
                reports.append(f"rank {w.rank}: {got[2]}")
            elif not w.process.is_alive():
                reports.append(f"rank {w.rank} exited with code {w.process.exitcode} (its stderr says why; a "
                               f"script that builds the engine at import time needs `if __name__ == "
                               f"\"__main__\":`, since each rank's process re-imports the main module)")
        detail = ("\n" + "\n".join(reports)) if reports else ""
        return TensorParallelError(f"tensor parallelism failed: {what}{detail}")

    def shutdown(self) -> None:
        """Stop the workers (told to exit; terminated after :data:`SHUTDOWN_TIMEOUT_S`, at once when
        the group failed), leave the process group.  Idempotent."""
        self._finalizer()
