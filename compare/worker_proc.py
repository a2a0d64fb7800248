"""Run a benchmark worker in a fresh Python process (one per backend and scenario, so each measures a
clean CUDA context and allocator): config in, JSON events on stdout, result file out, a wall-clock limit.

Used by ``vmkv compare engine`` (:mod:`vmkv.compare.engine_worker`) and ``vmkv compare step``
(:mod:`vmkv.compare.step_worker`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from vmkv.compare import report

__all__ = ["run_worker_process", "worker_main"]


def run_worker_process(module: str, cfg: dict, out_dir: Path, name: str, timeout_s: float,
                       threads: int | None, on_event: Callable[[dict], None],
                       error_fields: dict) -> dict:
    """Write ``raw/<name>.config.json``, run ``python -m <module> CONFIG RESULT`` with stderr in
    ``raw/<name>.log``, pass every JSON line it prints to ``on_event``, and return its result.

    Args:
        module: the worker module (its ``main(argv)`` takes the config and result paths).
        cfg: the worker's configuration (JSON-serialisable).
        out_dir: the benchmark's output directory (``raw/`` is created under it).
        name: file stem of this run's config, result and log.
        timeout_s: wall-clock limit in seconds; the worker is killed past it.
        threads: ``OMP_NUM_THREADS`` for the worker (``None``: inherited).
        on_event: called with each event dict the worker prints (progress).
        error_fields: fields of the returned dict when the worker fails (e.g. backend, scenario).
    Returns:
        The worker's result with ``raw_file`` (relative to ``out_dir``), or ``error_fields`` plus an
        ``error`` string (timed out, or the exit code and the log's last 15 lines).
    """
    raw = out_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    cfg_path, res_path, log_path = raw / f"{name}.config.json", raw / f"{name}.json", raw / f"{name}.log"
    report.write_json(cfg_path, cfg, strict=False)     # inf stays inf (e.g. --kv-shrink-grace-s inf)
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", module, str(cfg_path), str(res_path)]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            for line in proc.stdout:
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(ev, dict):
                    on_event(ev)
                if time.perf_counter() - t0 > timeout_s:
                    raise subprocess.TimeoutExpired(cmd, timeout_s)
            proc.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {**error_fields, "error": f"timed out after {timeout_s} s"}
    if proc.returncode != 0 or not res_path.exists():
        lines = log_path.read_text().strip().splitlines()
        # the lines that name the failure (a Python exception, a C++ abort's what()), then the tail:
        # a native abort's stack frames alone would push them out of a 15-line tail
        cause = [ln for ln in lines if _CAUSE.search(ln)][:8]
        return {**error_fields, "error": f"worker exited with {proc.returncode}: "
                + "\n".join(cause + (["..."] if cause else []) + lines[-15:])}
    result = json.loads(res_path.read_text())
    result["raw_file"] = str(res_path.relative_to(out_dir))
    return result


_CAUSE = re.compile(r"Error\b|Exception\b|what\(\)|Traceback|terminate called|Fatal Python error|Aborted")


def worker_main(argv: list[str] | None, module: str, run_worker: Callable[[dict], dict],
                indent: int | None = 1) -> int:
    """The worker side: ``python -m <module> CONFIG.json OUT.json`` runs ``run_worker(config)`` with
    logging on stderr and writes its result as JSON.  Returns the exit status (2: bad usage)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.stderr.write(f"usage: python -m {module} CONFIG.json OUT.json\n")
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    with open(argv[0]) as f:
        cfg = json.load(f)
    report.write_json(argv[1], run_worker(cfg), indent=indent)
    return 0
