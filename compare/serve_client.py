"""The load client of ``vmkv compare serve`` in a process of its own:
``python -m vmkv.compare.serve_client CONFIG.json OUT.json``.

It sends the requests it is given (token-id prompts, exact output lengths with ``ignore_eos``) through
``vmkv bench serve``'s client (:func:`vmkv.compare.bench_cli.run_benchmark`), phase after phase (the
warm-up sets, then the measured run), and measures itself, so a result can show the client is not what
limits the served rows:

- ``cpu_s`` / ``wall_s`` / ``cores``: this process's CPU time (``time.process_time``, all its threads)
  over the phase's wall time; a client near 1.0 core is saturated (asyncio runs on one thread);
- ``loop_lag_ms``: how late a 10 ms ``asyncio.sleep`` wakes up, sampled through the phase: the delay any
  chunk's timestamp can carry;
- ``send_lag_ms``: how late each request was sent against its scheduled arrival.

A phase may start at an agreed ``start_at`` (``time.perf_counter``, ``CLOCK_MONOTONIC`` on Linux, shared
by the host's processes) so that several client processes split one workload (``--client-processes``).

Config: ``{"base_url", "model", "endpoint", "temperature", "timeout_s", "http_client", "phases": [{"name", "requests":
[[id, prompt_token_ids, output_len, arrival_s], ...], "start_at": float | null}]}``.  Progress goes to
stdout as JSON lines (``{"event": "progress", "phase", "done", "total"}``); the result (every phase's
records with absolute ``perf_counter`` times, and the measures above) is written to ``OUT.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import sys
import time

from vmkv.compare.metrics import summarize
from vmkv.compare.worker_proc import worker_main
from vmkv.compare.workloads import Request

__all__ = ["run_client", "encode_requests", "decode_requests", "LAG_PROBE_S"]

#: the loop-lag probe's sleep (seconds)
LAG_PROBE_S = 0.01


def encode_requests(requests: list[Request]) -> list[list]:
    """``[[id, prompt_token_ids, output_len, arrival_s], ...]`` (a phase's ``requests``)."""
    return [[r.request_id, list(r.prompt_token_ids), r.output_len, r.arrival_s] for r in requests]


def decode_requests(rows: list[list]) -> list[Request]:
    """The inverse of :func:`encode_requests`, with the ``meta`` the client sends."""
    from vmkv.compare.bench_cli import for_sending

    return for_sending([Request(str(i), list(ids), int(n), float(t)) for i, ids, n, t in rows])


def _emit(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def _phase(requests: list[Request], args, model: str, start_at: float | None, name: str, progress) -> dict:
    from vmkv.compare.bench_cli import make_client, run_benchmark

    lags: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(LAG_PROBE_S)
            lags.append(time.perf_counter() - t - LAG_PROBE_S)

    finished, last = [0], [0.0]

    def on_done(_rec) -> None:
        finished[0] += 1
        now = time.perf_counter()
        if finished[0] == len(requests) or now - last[0] > 0.2:
            last[0] = now
            progress({"event": "progress", "phase": name, "done": finished[0], "total": len(requests)})

    async with make_client(args, len(requests)) as client:    # its set-up (SSL context) is not timed
        ready = time.perf_counter()
        late_s = max(0.0, ready - start_at) if start_at is not None else 0.0
        start = ready if start_at is None else start_at
        cpu0, wall0 = time.process_time(), time.perf_counter()
        task = asyncio.create_task(probe())
        records, duration = await run_benchmark(requests, args, model, on_done=on_done, start_at=start,
                                                client=client)
        done.set()
        await task
        cpu1, wall1 = time.process_time(), time.perf_counter()
    send_lag = [r.arrival_time - (start + q.arrival_s) for r, q in zip(records, requests)]
    return {"name": name, "start": start, "duration_s": duration, "late_start_s": late_s,
            "cpu_s": cpu1 - cpu0, "wall_s": wall1 - wall0, "cores": (cpu1 - cpu0) / max(wall1 - wall0, 1e-9),
            "loop_lag_ms": summarize(lags, 1e3), "send_lag_ms": summarize(send_lag, 1e3),
            "records": [r.to_dict() for r in records]}


def _peak_rss_bytes() -> int | None:
    """This process's peak resident memory (``VmHWM``; ``getrusage``'s maximum carries the parent's over
    the fork), None where ``/proc`` has none."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_client(cfg: dict, progress=_emit) -> dict:
    """Run the phases of ``cfg`` (module docstring) in order; returns the result dict."""
    logging.getLogger("httpx").setLevel(logging.WARNING)      # a log line per request costs client CPU
    args = argparse.Namespace(base_url=cfg["base_url"], endpoint=cfg.get("endpoint", "/v1/completions"),
                              temperature=float(cfg.get("temperature", 1.0)), no_ignore_eos=False,
                              api_key=cfg.get("api_key"), max_concurrency=cfg.get("max_concurrency"),
                              timeout_s=float(cfg.get("timeout_s", 600.0)),
                              http_client=cfg.get("http_client", "raw"))
    phases = [(p["name"], decode_requests(p["requests"]), p.get("start_at")) for p in cfg["phases"]]
    progress({"event": "loaded", "load_s": 0.0, "total": sum(len(r) for _, r, _ in phases)})

    async def main() -> list[dict]:
        return [await _phase(reqs, args, cfg["model"], start_at, name, progress) for name, reqs, start_at in phases]

    out = asyncio.run(main())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"phases": out, "max_rss_bytes": _peak_rss_bytes(), "cpu_user_s": usage.ru_utime,
            "cpu_system_s": usage.ru_stime}


def main(argv: list[str] | None = None) -> int:
    return worker_main(argv, "vmkv.compare.serve_client", run_client, indent=None)


if __name__ == "__main__":
    sys.exit(main())
