"""Ratios, tables, markdown and plots of a ``vmkv compare serve`` run (:mod:`vmkv.compare.serve_bench`).

The ratios are issue 22's targets: served / in-process output tok/s and goodput (higher is better), TPOT
p50 and TTFT p99 (lower is better), per (rate, backend).
"""

from __future__ import annotations

import math
from pathlib import Path

from vmkv.compare import report

__all__ = ["TARGETS", "ratios", "meets", "compare", "client_bound", "render", "SERVING_COLUMNS", "RATIO_COLUMNS",
           "CPU_COLUMNS"]

#: ratio -> (comparison, bound): the targets of issue 22 (served / in-process)
TARGETS = {"output_throughput": (">=", 0.95), "goodput": (">=", 0.95), "tpot_p50": ("<=", 1.10),
           "ttft_p99": ("<=", 1.5)}
#: a client process busier than this many cores, or whose event loop wakes this late (p99), may be
#: what limits a served run (its asyncio loop runs on one thread)
CLIENT_BUSY_CORES = 0.8
CLIENT_LOOP_LAG_MS = 10.0

SERVING_COLUMNS = ["scenario", "backend", "path", "ok/failed", "req/s", "out tok/s", "goodput", "TTFT p50",
                   "TTFT p99", "TPOT p50", "ITL p50", "ITL p99", "E2E p50"]
RATIO_COLUMNS = ["scenario", "backend", "out tok/s (>=0.95)", "goodput (>=0.95)", "TPOT p50 (<=1.10)",
                 "TTFT p99 (<=1.5)", "same requests"]
CPU_COLUMNS = ["scenario", "backend", "clients", "client cores", "busiest", "loop lag p99", "send lag p99",
               "client limit?", "server cores", "server tree", "in-proc cores", "start s", "stop"]

_f = report.fmt_num


def _value(serving: dict, key: str) -> float | None:
    if key == "output_throughput":
        return serving.get("output_throughput")
    if key == "goodput":
        return serving.get("goodput")
    metric, p = {"tpot_p50": ("tpot_ms", "p50"), "ttft_p99": ("ttft_ms", "p99")}[key]
    return (serving.get(metric) or {}).get(p)


def _div(a, b) -> float | None:
    if a is None or b is None or isinstance(a, bool) or not b:
        return None
    if isinstance(a, float) and math.isnan(a) or isinstance(b, float) and math.isnan(b):
        return None
    return a / b


def ratios(served: dict, inprocess: dict) -> dict[str, float | None]:
    """Served / in-process of every :data:`TARGETS` measure from two ``serving`` dicts
    (:func:`vmkv.compare.metrics.compute_serving_metrics`); None where either side lacks it (no SLO: no
    goodput) or the in-process value is 0."""
    return {k: _div(_value(served, k), _value(inprocess, k)) for k in TARGETS}


def meets(r: dict[str, float | None]) -> dict[str, bool | None]:
    """Whether each ratio of :func:`ratios` meets its target (None: no ratio)."""
    out = {}
    for k, (op, bound) in TARGETS.items():
        v = r.get(k)
        out[k] = None if v is None else (v >= bound if op == ">=" else v <= bound)
    return out


def client_bound(client: dict | None) -> bool | None:
    """Could the load client have limited the served run?  True when its busiest process used at least
    :data:`CLIENT_BUSY_CORES` cores or its event loop's p99 wake-up lag reached :data:`CLIENT_LOOP_LAG_MS`;
    None without client measures."""
    if not client:
        return None
    lag = client.get("loop_lag_p99_ms")
    return bool(client["busiest_cores"] >= CLIENT_BUSY_CORES or (lag is not None and not math.isnan(lag)
                                                                 and lag >= CLIENT_LOOP_LAG_MS))


def compare(runs: list[dict]) -> list[dict]:
    """One entry per (scenario, backend) with both paths measured: the ratios, whether they meet the
    targets, whether both paths ran the same requests (workload fingerprints) and whether the client
    may have been the limit."""
    out = []
    ok = [r for r in runs if "serving" in r]
    keys = dict.fromkeys((r["scenario"], r["backend"]) for r in ok)
    for scenario, backend in keys:
        group = [r for r in ok if (r["scenario"], r["backend"]) == (scenario, backend)]
        served = next((r for r in group if r["path"] == "served"), None)
        inproc = next((r for r in group if r["path"] == "inprocess"), None)
        if served is None or inproc is None:
            continue
        rs = ratios(served["serving"], inproc["serving"])
        out.append({"scenario": scenario, "backend": backend, "rate_spec": served.get("rate_spec"),
                    "ratios": rs, "meets": meets(rs),
                    "identical_workload": served.get("workload_fingerprint") == inproc.get("workload_fingerprint"),
                    "workload_fingerprint": inproc.get("workload_fingerprint"),
                    "client_bound": client_bound(served.get("client"))})
    return out


# ---------------------------------------------------------------------------------------- tables
def serving_rows(runs: list[dict]) -> list[list[str]]:
    rows = []
    for r in runs:
        if "serving" not in r:
            continue
        s = r["serving"]
        rows.append([r["scenario"], r["backend"], r["path"], f"{s['completed']}/{s['failed']}",
                     _f(s["request_throughput"]), _f(s["output_throughput"], 1),
                     "-" if s.get("goodput") is None else _f(s["goodput"]),
                     _f(s["ttft_ms"]["p50"], 1), _f(s["ttft_ms"]["p99"], 1), _f(s["tpot_ms"]["p50"], 2),
                     _f(s["itl_ms"]["p50"], 2), _f(s["itl_ms"]["p99"], 2), _f(s["e2e_ms"]["p50"], 0)])
    return rows


def _ratio_cell(v: float | None, ok: bool | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3f} {'ok' if ok else 'MISS'}"


def ratio_rows(comparisons: list[dict]) -> list[list[str]]:
    return [[c["scenario"], c["backend"]] + [_ratio_cell(c["ratios"][k], c["meets"][k]) for k in TARGETS]
            + ["yes" if c["identical_workload"] else "NO"] for c in comparisons]


def _procs(cpu: dict | None) -> str:
    if not cpu or not cpu.get("processes"):
        return "-"
    return " + ".join(f"{p['role']} {p['cores']:.2f}" for p in cpu["processes"] if p["cpu_s"] > 0.005) or "-"


def cpu_rows(runs: list[dict]) -> list[list[str]]:
    rows = []
    inproc = {(r["scenario"], r["backend"]): r for r in runs if r.get("path") == "inprocess" and "timing" in r}
    for r in runs:
        if r.get("path") != "served" or "client" not in r:
            continue
        c, srv = r["client"], r["server"]
        stop = srv.get("stop") or {}
        bound = client_bound(c)
        ip = inproc.get((r["scenario"], r["backend"]))
        cores = (ip or {}).get("timing", {}).get("cores")
        rows.append([r["scenario"], r["backend"], str(c["num_processes"]), _f(c["cores"]), _f(c["busiest_cores"]),
                     f"{_f(c['loop_lag_p99_ms'], 1)} ms", f"{_f(c['send_lag_p99_ms'], 1)} ms",
                     "MAYBE" if bound else "no", _f((srv.get("cpu") or {}).get("cores")), _procs(srv.get("cpu")),
                     _f(cores), _f(srv.get("startup_s"), 1),
                     ("ok " if stop.get("ok") else "BAD ") + f"{_f(stop.get('stop_s'), 1)} s"])
    return rows


def _describe(results: dict, runs: list[dict]) -> str:
    w = results["workload"]
    ip = next((r for r in runs if r.get("path") == "inprocess" and "model" in r), None)
    sv = next((r for r in runs if r.get("path") == "served" and "model" in r), None)
    model = (ip or {}).get("model") or {}
    name = model.get("name") or (sv or {}).get("model", {}).get("served_name", "?")
    dev = (ip or {}).get("device_name", "?")
    dtype = (ip or {}).get("dtype", "?")
    a = results["args"]
    return (f"model {name}, {dtype} on {dev}; workload {w['kind']}: {w['num_requests']} requests, input "
            f"{w['input_len']}, output {w['output_len']} (ignore_eos), seed {w['seed']}, burstiness "
            f"{w['burstiness']}; max_model_len {results['max_model_len']}, max_num_seqs {a.get('max_num_seqs')}; "
            f"SLO {a.get('slo') or 'none'}; paths {', '.join(results['paths'])}; load client: "
            f"{a.get('client_processes', 1)} process(es) of vmkv bench serve's client ({a.get('http_client', 'raw')} HTTP), "
            "streaming /v1/completions "
            "with token-id prompts")


def _latency_plots(runs: list[dict], out_dir: Path, title: str) -> list[Path]:
    from vmkv.compare.engine_report import _latency_series

    paths = []
    ok = [r for r in runs if "raw" in r and "serving" in r]
    for scenario in dict.fromkeys(r["scenario"] for r in ok):
        series = {f"{r['backend']} {r['path']}": _latency_series(r["raw"]) for r in ok if r["scenario"] == scenario}
        paths.append(report.plot_latency_cdfs(series, out_dir / f"latency_cdf_{scenario}.png",
                                              f"{title}; {scenario}"))
    return paths


def render(results: dict, runs: list[dict], out_dir: Path, console) -> None:
    """Print the tables, write ``summary.md`` and the latency CDF plots into ``out_dir``."""
    desc = _describe(results, runs)
    comparisons = results["comparisons"]
    tables = [("Served and in-process (latencies in ms, goodput in req/s)", SERVING_COLUMNS, serving_rows(runs)),
              ("Served / in-process (issue 22 targets)", RATIO_COLUMNS, ratio_rows(comparisons)),
              ("CPU (cores = CPU seconds / wall seconds of the measured run)", CPU_COLUMNS, cpu_rows(runs))]
    console.print(desc)
    for title, cols, rows in tables:
        if rows:
            console.print(report.make_table(title, cols, rows))
    failed = [r for r in runs if "error" in r or "stop_error" in r]
    plots = []
    try:
        plots = _latency_plots(runs, out_dir, desc.split(";")[0])
    except Exception as exc:  # plots are a convenience; never lose the JSON over them
        console.print(f"[yellow]plotting failed: {exc}[/yellow]")
    env = results["environment"]
    md = ["# vmkv compare serve", "", f"Command: `{env['command']}`", "",
          f"Commit {env.get('git_commit')}{' (dirty)' if env.get('git_dirty') else ''}, torch {env['torch']}, "
          f"triton {env['triton']}, CUDA {env['torch_cuda']}, GPUs {env['gpus'] or 'none'}, CPU {env['cpu']} "
          f"({env['cpu_count']} cores).", "", desc + ".", ""]
    for title, cols, rows in tables:
        if rows:
            md += [f"## {title}", "", report.markdown_table(cols, rows), ""]
    if failed:
        md += ["## Failed runs", ""] + [f"- {r['scenario']}-{r['backend']} {r.get('path')}: "
                                        f"{r.get('error') or r.get('stop_error')}" for r in failed] + [""]
    md += ["Definitions: served = `vmkv serve` in its own process(es), measured by the load client (TTFT from "
           "the request's send); in-process = the engine driven in one process as `vmkv compare engine` does "
           "(TTFT from the scheduled arrival); both on the same requests (same requests: the workload "
           "fingerprints agree). Ratios are served / in-process. Client cores: CPU seconds / wall seconds "
           "of the load client's processes (busiest: the busiest one; its asyncio loop runs on one thread); loop "
           f"lag: how late a {10} ms sleep of the client's event loop woke up (p99); send lag: how late requests "
           "left against their schedule (p99); client limit? MAYBE when the busiest client process used >= "
           f"{CLIENT_BUSY_CORES} cores or its loop lag p99 >= {CLIENT_LOOP_LAG_MS:g} ms (then rerun with more "
           "--client-processes). Server cores: CPU time of the server's process tree from /proc (role and "
           "cores per process, pids in results.json: server = the HTTP process, child = e.g. its engine core); in-process cores: the "
           "engine worker's process (a process waiting on CUDA spin-waits by default: ~1 core means never idle, not "
           "necessarily CPU-bound). Stop: SIGTERM, exit status 0 and no process of the tree left. Raw: "
           "`raw/*.json` (requests), `raw/*.server.log`, `raw/*.client*.json`.", ""]
    report.write_summary(out_dir, md, plots, console)
