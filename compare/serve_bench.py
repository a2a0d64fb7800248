"""``vmkv compare serve``: the same seeded workload through real ``vmkv serve`` processes and through the
in-process engine, per backend and rate, with served / in-process ratios (issue 22's targets table).

For every rate (``--request-rate``, a list as ``vmkv compare engine`` takes) and backend, in order:

1. **in-process**: the engine in a fresh ``python -m vmkv.compare.engine_worker`` process, exactly as
   ``vmkv compare engine`` runs it (its configuration from :func:`vmkv.compare.engine_bench.worker_config`);
2. **served**: ``vmkv serve`` started from that same configuration (:func:`vmkv.compare.serve_proc.serve_argv`)
   on a free port, waited for through ``GET /health``, warmed up with the worker's warm-up requests
   (:func:`vmkv.compare.engine_worker.warmup_sets`), driven by ``vmkv bench serve``'s client in
   ``--client-processes`` processes of its own (:mod:`vmkv.compare.serve_client`), then stopped with
   SIGTERM and checked to have exited with every process of its tree (the engine core too).

Both paths get one request list: :func:`vmkv.compare.workloads.generate` of the workload and the model's
vocabulary (from the ``vocab_size`` of ``GET /v1/models``, else the in-process run's model, else the
random-weight shape), token-id prompts, exact output lengths (``ignore_eos``), the same arrival offsets;
the result compares the two paths' workload fingerprints.  A fresh server per (rate, backend), as a fresh
worker: the prefix cache starts empty in both.

The client measures itself (CPU time / wall time, event-loop lag, send lag against the schedule) and a
sampler reads the CPU time of the server's process tree from ``/proc``, so the result shows whether the
client or the server's processes were busy.  Output: tables on the terminal, ``results.json`` (environment
with the commit, arguments, every run's summary, the ratios), ``raw/`` (each run's requests, the servers'
logs, the clients' results), ``summary.md`` and latency CDF plots.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time
from pathlib import Path

from vmkv.compare import engine_bench, report
from vmkv.compare.bench_cli import add_http_client_arg
from vmkv.compare.metrics import SLO, RequestRecord, compute_serving_metrics
from vmkv.compare.shapes import SHAPES
from vmkv.compare.worker_proc import run_worker_process
from vmkv.compare.workloads import Request, WorkloadSpec, fingerprint, generate

logger = logging.getLogger(__name__)

__all__ = ["add_arguments", "run", "parse_paths", "served_requests", "split_requests", "merge_client_phases",
           "PATHS"]

PATHS = ("inprocess", "served")
#: delay of the mixed warm-up set's later requests behind its first (the first decodes when they arrive)
MIXED_WARMUP_DELAY_S = 0.05


def add_arguments(p: argparse.ArgumentParser) -> None:
    engine_bench.add_arguments(p, sweep=False)
    s = p.add_argument_group("served path")
    s.add_argument("--random-weights", default=None, metavar="SHAPE",
                   help=f"a random-weight model shape ({', '.join(SHAPES)}): the same as --model SHAPE "
                        "(serve's flag name)")
    s.add_argument("--paths", default="inprocess,served",
                   help="which paths to run, in this order per backend: inprocess, served (default: both)")
    s.add_argument("--client-processes", type=int, default=1,
                   help="load-client processes sharing each served run's requests (round robin, one agreed "
                        "start): more when one client process is busy near a whole core")
    add_http_client_arg(s)
    s.add_argument("--start-timeout-s", type=float, default=900.0,
                   help="seconds a server may take to answer GET /health with 200 (model load, CUDA graphs)")
    s.add_argument("--graceful-timeout", type=float, default=10.0,
                   help="the servers' --graceful-timeout; the stop check waits this + 30 s for the exit")


def parse_paths(text: str) -> list[str]:
    """``"inprocess,served"`` -> ``["inprocess", "served"]``.  Raises ValueError naming a bad entry."""
    paths = [t.strip().lower().replace("-", "") for t in str(text).split(",") if t.strip()]
    bad = [t for t in paths if t not in PATHS]
    if bad or not paths or len(set(paths)) != len(paths):
        raise ValueError(f"--paths must list {' and/or '.join(PATHS)} once each, got {text!r}")
    return paths


def _check_args(args) -> None:
    """Raise ValueError for arguments the served path cannot run (and fold --random-weights into --model)."""
    if args.random_weights is not None:
        if args.model not in (None, args.random_weights):
            raise ValueError(f"--random-weights {args.random_weights} and --model {args.model} name two models; "
                             "give one")
        if args.random_weights not in SHAPES:
            raise ValueError(f"--random-weights {args.random_weights!r} is not a shape; choose from {list(SHAPES)}")
        args.model = args.random_weights
    if args.client_processes < 1:
        raise ValueError(f"--client-processes must be >= 1, got {args.client_processes}")
    if args.n != 1:
        raise ValueError("--n > 1 (the parallel workload) is not supported by compare serve: the load client "
                         "times one completion per request")
    if args.torch_threads is not None and args.torch_threads < 1:
        raise ValueError(f"--torch-threads must be >= 1, got {args.torch_threads}")


# ---------------------------------------------------------------------------------------- the workload
def served_requests(cfg: dict, vocab_size: int) -> list[Request]:
    """The requests of the served run of worker configuration ``cfg``: the list the in-process worker
    regenerates from the same workload and vocabulary (its fingerprint is in its result)."""
    return generate(WorkloadSpec.from_dict(cfg["workload"]), vocab_size)


def split_requests(requests: list[Request], num_parts: int) -> list[list[Request]]:
    """Round-robin parts of ``requests`` (arrival order kept within each), one per client process."""
    return [requests[i::num_parts] for i in range(num_parts) if requests[i::num_parts]]


def _warmup_phases(cfg: dict, requests: list[Request], max_model_len: int, vocab_size: int) -> list[dict]:
    from vmkv.compare.engine_worker import warmup_sets
    from vmkv.compare.serve_client import encode_requests

    phases = []
    spec = WorkloadSpec.from_dict(cfg["workload"])
    for i, (kind, reqs) in enumerate(warmup_sets(cfg, spec, requests, max_model_len, vocab_size)):
        for j, r in enumerate(reqs):
            r.arrival_s = MIXED_WARMUP_DELAY_S if kind == "mixed" and j else 0.0
        phases.append({"name": f"warmup-{i}-{kind}", "requests": encode_requests(reqs), "start_at": None})
    return phases


def merge_client_phases(phases: list[dict]) -> tuple[list[RequestRecord], float, float]:
    """One measured run from the client processes' phases (:mod:`vmkv.compare.serve_client` results):
    ``(records, start, duration_s)``, the start being the earliest phase start (they agree when the
    clients shared a ``start_at``) and the duration running to the last finish."""
    fields = RequestRecord.__dataclass_fields__
    records = [RequestRecord(**{k: v for k, v in d.items() if k in fields}) for p in phases for d in p["records"]]
    start = min(p["start"] for p in phases)
    ends = [r.finish_time for r in records if r.finish_time is not None]
    return records, start, max(max(ends, default=start) - start, 1e-9)


def _raw_requests(records: list[RequestRecord], start: float, by_id: dict[str, Request]) -> list[dict]:
    """Records as ``raw/*.json`` of the engine worker stores them (times relative to the run start)."""
    from vmkv.compare.engine_worker import _raw_record

    return [_raw_record(rec, start, by_id[rec.request_id]) for rec in records]


# ---------------------------------------------------------------------------------------- one served run
def _vocab(cards: list[dict], model: str, cfg: dict, runs: list[dict]) -> tuple[int, str]:
    from vmkv.compare.bench_cli import vocab_size_of

    v = vocab_size_of(cards, model)
    if v is not None:
        return v, "GET /v1/models"
    for r in runs:
        if r.get("path") == "inprocess" and r.get("backend") == cfg["backend"] and "model" in r:
            return int(r["model"]["vocab_size"]), "the in-process run's model"
    shape = cfg.get("knobs", {}).get("random_weights")
    if shape in SHAPES:
        return SHAPES[shape].vocab_size, f"the {shape} shape"
    raise RuntimeError("the model's vocabulary size is unknown: the server's /v1/models gives no vocab_size, "
                       "and no in-process run of this backend ran before (add inprocess to --paths)")


def _client_cfg(base_url: str, model: str, cfg: dict, args, phases: list[dict]) -> dict:
    return {"base_url": base_url, "model": model, "endpoint": "/v1/completions",
            "temperature": float(cfg.get("temperature", 1.0)), "timeout_s": args.timeout_s,
            "http_client": args.http_client, "phases": phases}


def _server_metrics(base_url: str) -> dict[str, float]:
    """Unlabelled ``vmkv_*`` samples of the server's ``/metrics`` ({} when unreadable)."""
    import httpx

    from vmkv.compare.colocate import parse_metrics

    try:
        return parse_metrics(httpx.get(base_url + "/metrics", timeout=10).text, ("vmkv_",))
    except httpx.HTTPError:
        return {}


def _run_clients(n: int, requests: list[Request], base_url: str, model: str, cfg: dict, args, out_dir: Path,
                 name: str, on_done) -> list[dict]:
    """The measured run: ``n`` client processes, each a round-robin part, one agreed start."""
    from vmkv.compare.serve_client import encode_requests

    parts = split_requests(requests, n)
    # one process starts when it is ready; several agree on an instant far enough ahead for all to import
    start_at = None if len(parts) == 1 else time.perf_counter() + 2.0 + 0.5 * len(parts)
    done = [0] * len(parts)
    results: list[dict | None] = [None] * len(parts)

    def one(i: int) -> None:
        def on_event(ev: dict) -> None:
            if ev.get("event") == "progress":
                done[i] = ev["done"]
                on_done(sum(done))

        ccfg = _client_cfg(base_url, model, cfg, args,
                           [{"name": "run", "requests": encode_requests(parts[i]), "start_at": start_at}])
        results[i] = run_worker_process("vmkv.compare.serve_client", ccfg, out_dir, f"{name}.client{i}",
                                        args.timeout_s, None, on_event, {"client": i})

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _client_summary(results: list[dict]) -> dict:
    procs = []
    for i, res in enumerate(results):
        ph = res["phases"][-1]
        procs.append({"client": i, "num_requests": len(ph["records"]), "cpu_s": ph["cpu_s"], "wall_s": ph["wall_s"],
                      "cores": ph["cores"], "loop_lag_ms": ph["loop_lag_ms"], "send_lag_ms": ph["send_lag_ms"],
                      "late_start_s": ph["late_start_s"], "max_rss_bytes": res.get("max_rss_bytes")})
    return {"num_processes": len(procs), "cpu_s": sum(p["cpu_s"] for p in procs),
            "cores": sum(p["cores"] for p in procs), "busiest_cores": max(p["cores"] for p in procs),
            "loop_lag_p99_ms": max(p["loop_lag_ms"]["p99"] for p in procs),
            "send_lag_p99_ms": max(p["send_lag_ms"]["p99"] for p in procs),
            "late_start_s": max(p["late_start_s"] for p in procs), "processes": procs}


def run_served(cfg: dict, args, out_dir: Path, runs: list[dict], on_progress) -> dict:
    """One served run of worker configuration ``cfg`` (module docstring, step 2); returns its result
    (``error`` set when it failed; ``server.stop.ok`` False when the server did not stop cleanly)."""
    from vmkv.compare import bench_cli
    from vmkv.compare.serve_proc import ProcessTreeSampler, ServeProcess, free_port, serve_argv, window_cpu

    name = f"{cfg['scenario']}-{cfg['backend']}-served"
    raw = out_dir / "raw"
    if (raw / f"{name}.json").exists():  # the same backend listed twice (an A/A check)
        name += f"-{sum(1 for _ in raw.glob(name + '*.server.log'))}"
    port = free_port()
    argv = serve_argv(cfg, port, graceful_timeout_s=args.graceful_timeout)
    res: dict = {"path": "served", "backend": cfg["backend"], "scenario": cfg["scenario"],
                 "rate_spec": cfg["rate_spec"], "config": cfg,
                 "server": {"command": ["vmkv", "serve", *argv], "log_file": f"raw/{name}.server.log"}}
    server = ServeProcess(argv, port, raw / f"{name}.server.log", threads=cfg.get("torch_threads"))
    sampler = ProcessTreeSampler(server.pid, 0.5, on_tree=server.remember)
    sampler.start()
    try:
        res["server"]["startup_s"] = server.wait_healthy(args.start_timeout_s)
        cards = asyncio.run(bench_cli.model_cards(server.base_url, None))
        model = cards[0]["id"]
        vocab, source = _vocab(cards, model, cfg, runs)
        max_model_len = cards[0].get("max_model_len") or cfg["knobs"]["max_model_len"]
        requests = served_requests(cfg, vocab)
        res.update(model={"served_name": model, "vocab_size": vocab, "vocab_size_from": source,
                          "card": cards[0]}, workload_fingerprint=fingerprint(requests))
        on_progress(0, len(requests), "warm-up")
        warm = _warmup_phases(cfg, requests, max_model_len, vocab)
        if warm:
            w = run_worker_process("vmkv.compare.serve_client", _client_cfg(server.base_url, model, cfg,
                                   args, warm), out_dir, f"{name}.warmup", args.timeout_s, None,
                                   lambda ev: None, {})
            if "error" in w:
                raise RuntimeError(f"warm-up client failed: {w['error']}")
            failed = [d for p in w["phases"] for d in p["records"] if not d["success"]]
            if failed:
                raise RuntimeError(f"{len(failed)} warm-up requests failed, the first: {failed[0]['error']}")
        on_progress(0, len(requests), "run")
        clients = _run_clients(args.client_processes, requests, server.base_url, model, cfg, args, out_dir, name,
                               lambda done: on_progress(done, len(requests), "run"))
        bad = [c for c in clients if "error" in c]
        if bad:
            raise RuntimeError(f"client {bad[0]['client']} failed: {bad[0]['error']}")
        records, start, duration = merge_client_phases([c["phases"][-1] for c in clients])
        by_id = {r.request_id: r for r in requests}
        records.sort(key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
        res["serving"] = compute_serving_metrics(records, duration, SLO.parse(cfg.get("slo")))
        res["output_len_mismatches"] = sum(1 for r in records if r.success and r.output_len != by_id[r.request_id].output_len)
        res["client"] = _client_summary(clients)
        sampler.sample()
        res["server"]["cpu"] = window_cpu(sampler.samples, sampler.names, start, start + duration)
        res["server"]["metrics_after"] = _server_metrics(server.base_url)
        res["timing"] = {"run_s": duration, "startup_s": res["server"]["startup_s"]}
        if not server.alive():
            raise RuntimeError(f"vmkv serve exited during the run:\n{server.log_tail()}")
        raw_path = raw / f"{name}.json"
        res["raw"] = {"requests": _raw_requests(records, start, by_id)}
        report.write_json(raw_path, {k: v for k, v in res.items()}, indent=None)
        res["raw_file"] = str(raw_path.relative_to(out_dir))
    except Exception as exc:  # any failure is this run's; the comparison goes on
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        sampler.stop()
        res["server"]["stop"] = server.stop(args.graceful_timeout + 30)
    if not res["server"]["stop"]["ok"] and "error" not in res:
        res["stop_error"] = f"vmkv serve did not stop cleanly: {res['server']['stop']}"
    return res


# ---------------------------------------------------------------------------------------- the command
def run(args) -> int:
    from vmkv.compare import serve_report

    console = report.console()
    try:
        _check_args(args)
        paths = parse_paths(args.paths)
        plan = engine_bench.plan(args)
        if len(plan.budgets) > 1:
            raise ValueError("vmkv compare serve takes one KV budget (--memory-gib/--kv-memory); "
                             "vmkv compare engine sweeps several")
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    if plan.note:
        console.print(plan.note)
    out_dir = report.results_dir(args.out, "serve")
    env = report.environment(seed=args.seed)
    runs: list[dict] = []
    with report.progress(console) as prog:
        for rate_text in plan.rates:
            try:   # relative rates scale the first path's offline run of the first backend
                rate = engine_bench.resolve_rate(rate_text, args, [r for r in runs if r["path"] == paths[0]],
                                                 plan.backends[0])
            except ValueError as exc:
                console.print(f"[red]error:[/red] {exc}")
                return 2
            spec = engine_bench._spec(args, rate)
            for backend in plan.backends:
                cfg = engine_bench.worker_config(args, backend, rate_text, spec, plan.max_model_len)
                for path in paths:
                    label = f"{cfg['scenario']}-{backend} {path}"
                    task = prog.add_task(f"{label} (loading)", total=spec.num_requests)
                    if path == "inprocess":
                        res = engine_bench._run_worker(cfg, out_dir, prog, task, args.timeout_s, args.torch_threads)
                        res.update(path="inprocess", rate_spec=rate_text)
                    else:
                        def on_progress(done: int, total: int, phase: str, task=task, label=label) -> None:
                            prog.update(task, completed=done, total=total, description=f"{label} ({phase})")

                        res = run_served(cfg, args, out_dir, runs, on_progress)
                    runs.append(res)
                    if "error" in res:
                        console.print(f"[red]{label} failed:[/red] {res['error']}")
                    elif "stop_error" in res:
                        console.print(f"[yellow]{label}:[/yellow] {res['stop_error']}")
    comparisons = serve_report.compare(runs)
    summary_runs = [{k: v for k, v in r.items() if k != "raw"} for r in runs]
    results = {"kind": "serve", "environment": env, "args": vars(args), "paths": paths,
               "max_model_len": plan.max_model_len, "workload": plan.base_spec.to_dict(), "runs": summary_runs,
               "comparisons": comparisons, "targets": serve_report.TARGETS}
    report.write_json(out_dir / "results.json", results)
    serve_report.render(results, runs, out_dir, console)
    bad = any("error" in r or "stop_error" in r for r in runs) or any(not c["identical_workload"] for c in comparisons)
    return 1 if bad else 0
