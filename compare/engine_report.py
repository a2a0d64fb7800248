"""Tables, markdown and plots of a ``vmkv compare engine`` run (see :mod:`vmkv.compare.engine_bench`)."""

from __future__ import annotations

import math
from pathlib import Path

from vmkv.compare import report
from vmkv.compare.metrics import inter_token_latencies

__all__ = ["render", "vmm_latency", "serving_rows", "memory_rows", "ratio_rows", "memory_series"]

SERVING_COLUMNS = ["scenario", "backend", "rate", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
                   "TPOT p99", "ITL p50", "ITL p99", "E2E p50", "E2E p99", "goodput"]
MEMORY_COLUMNS = ["scenario", "backend", "KV alloc peak", "mapped peak", "created peak/final", "waste %",
                  "reserved unused %", "B/used tok",
                  "max seqs", "preempt", "hit %", "alloc %", "alloc ahead %", "prefetch %", "alloc us p99", "map us p50/99",
                  "unmap us p50/99", "device peak"]
RATIO_COLUMNS = ["scenario", "ratio", "out tok/s", "TTFT p50", "TPOT p50", "E2E p50", "peak mapped", "max seqs"]

_f = report.fmt_num


def _ok(runs: list[dict]) -> list[dict]:
    return [r for r in runs if "serving" in r]


def vmm_latency(run: dict) -> dict:
    """``{"map_us": {...}, "unmap_us": {...}}`` latency summaries (us) of the measured run (vmem only)."""
    vmm = (run.get("allocation") or {}).get("vmm") or {}
    return {k: vmm[k] for k in ("map_us", "unmap_us") if isinstance(vmm.get(k), dict) and vmm[k].get("n")}


def _pair(d: dict | None) -> str:
    if not d or d.get("p50") is None:
        return "-"
    short = (lambda x: f"{x:.1f}" if x < 100 else f"{x:.0f}")
    return f"{short(d['p50'])}/{short(d['p99'])}"


def serving_rows(runs: list[dict]) -> list[list[str]]:
    rows = []
    for r in _ok(runs):
        s = r["serving"]
        rate = r["config"]["workload"]["request_rate"]
        rows.append([r["scenario"], r["backend"], "inf" if rate == "inf" else _f(float(rate)),
                     _f(s["request_throughput"]), _f(s["output_throughput"], 1),
                     _f(s["ttft_ms"]["p50"], 1), _f(s["ttft_ms"]["p99"], 1), _f(s["tpot_ms"]["p50"], 2),
                     _f(s["tpot_ms"]["p99"], 2), _f(s["itl_ms"]["p50"], 2), _f(s["itl_ms"]["p99"], 2),
                     _f(s["e2e_ms"]["p50"], 0), _f(s["e2e_ms"]["p99"], 0),
                     "-" if s.get("goodput") is None else _f(s["goodput"])])
    return rows


def _created(m: dict) -> str:
    """``peak/final`` physical KV bytes created (``-`` for results written before they were sampled)."""
    if "peak_created_bytes" not in m:
        return "-"
    return f"{report.fmt_size(m['peak_created_bytes'], 1)}/{report.fmt_size(m['final_created_bytes'], 1)}"


def memory_rows(runs: list[dict]) -> list[list[str]]:
    rows = []
    for r in _ok(runs):
        m, a = r["memory"], r["allocation"]
        v = vmm_latency(r)
        rows.append([r["scenario"], r["backend"], report.fmt_size(m["peak_allocated_bytes"], 1),
                     report.fmt_size(m["peak_mapped_bytes"], 1), _created(m), _f(m["waste_pct_mean"]),
                     _f(m["reserved_unused_pct_mean"]) if "reserved_unused_pct_mean" in m else "-",
                     _f(m["bytes_per_used_token_at_peak"], 0), str(m["max_concurrent_seqs"]), str(m["preemptions"]),
                     _f(100 * m["prefix_hit_rate"], 1), _f(a["alloc_share_pct"], 3),
                     _f(a["alloc_ahead_share_pct"], 3) if "alloc_ahead_share_pct" in a else "-",
                     _f(a["prefetch_share_pct"], 3) if "prefetch_share_pct" in a else "-",
                     _f(a["alloc_us_per_step"]["p99"], 1), _pair(v.get("map_us")), _pair(v.get("unmap_us")),
                     report.fmt_size(m["device_used_bytes_peak"], 1) if m["device_used_bytes_peak"] else "-"])
    return rows


def _ratio(a, b) -> str:
    if a is None or b is None or not isinstance(a, (int, float)) or not b or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{a / b:.3f}"


def ratio_rows(runs: list[dict]) -> list[list[str]]:
    """``other / first backend`` per scenario (first backend = the baseline, normally paged)."""
    ok = _ok(runs)
    rows = []
    for scenario in dict.fromkeys(r["scenario"] for r in ok):
        group = [r for r in ok if r["scenario"] == scenario]
        base = group[0]
        for other in group[1:]:
            s, b = other["serving"], base["serving"]
            rows.append([scenario, f"{other['backend']}/{base['backend']}",
                         _ratio(s["output_throughput"], b["output_throughput"]),
                         _ratio(s["ttft_ms"]["p50"], b["ttft_ms"]["p50"]),
                         _ratio(s["tpot_ms"]["p50"], b["tpot_ms"]["p50"]),
                         _ratio(s["e2e_ms"]["p50"], b["e2e_ms"]["p50"]),
                         _ratio(other["memory"]["peak_mapped_bytes"], base["memory"]["peak_mapped_bytes"]),
                         _ratio(other["memory"]["max_concurrent_seqs"], base["memory"]["max_concurrent_seqs"])])
    return rows


DETAIL_COLUMNS = ["scenario", "backend", "metric (ms)", "mean", "p50", "p90", "p99", "n"]


def detail_rows(runs: list[dict]) -> list[list[str]]:
    """Mean, p50, p90, p99 of every latency metric (BENCHMARKS.md), one row per run and metric."""
    rows = []
    for r in _ok(runs):
        for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
            d = r["serving"][key]
            rows.append([r["scenario"], r["backend"], name] + [_f(d[k], 2) for k in ("mean", "p50", "p90", "p99")]
                        + [str(d["n"])])
    return rows


def _latency_series(raw: dict) -> dict[str, list[float]]:
    ttft, tpot, itl, e2e = [], [], [], []
    for q in raw["requests"]:
        if not q["success"] or q["first_token_s"] is None:
            continue
        t = q["first_token_s"] - q["arrival_s"]
        e = q["finish_s"] - q["arrival_s"]
        ttft.append(1e3 * t)
        e2e.append(1e3 * e)
        if q["output_len"] > 1:
            tpot.append(1e3 * (e - t) / (q["output_len"] - 1))
        itl += [1e3 * g for g in inter_token_latencies(q["token_times_s"])]
    return {"TTFT (ms)": ttft, "TPOT (ms)": tpot, "ITL (ms)": itl, "E2E (ms)": e2e}


def memory_series(raw: dict) -> dict[str, list]:
    """A run's per-step memory samples (``raw["steps"]``) merged in time order with those taken while it
    waited for arrivals (``raw["idle_memory"]``), for :func:`report.plot_memory_timeline`; the steps
    alone for results written before idle samples existed."""
    steps, idle = raw["steps"], raw.get("idle_memory") or {}
    if not idle.get("t_s"):
        return steps
    keys = [k for k in idle if k in steps]
    rows = sorted([tuple(steps[k][i] for k in keys) for i in range(len(steps["t_s"]))]
                  + [tuple(idle[k][i] for k in keys) for i in range(len(idle["t_s"]))],
                  key=lambda row: row[keys.index("t_s")])
    return {k: [row[j] for row in rows] for j, k in enumerate(keys)}


def _plots(runs: list[dict], out_dir: Path, title: str) -> list[Path]:
    paths = []
    ok = [r for r in runs if "raw" in r]
    for scenario in dict.fromkeys(r["scenario"] for r in ok):
        group = [r for r in ok if r["scenario"] == scenario]
        labels = [r["backend"] if [g["backend"] for g in group].count(r["backend"]) == 1 else f"{r['backend']}#{i}"
                  for i, r in enumerate(group)]
        paths.append(report.plot_latency_cdfs({lb: _latency_series(r["raw"]) for lb, r in zip(labels, group)},
                                              out_dir / f"latency_cdf_{scenario}.png", f"{title}; {scenario}"))
        paths.append(report.plot_memory_timeline({lb: memory_series(r["raw"]) for lb, r in zip(labels, group)},
                                                 out_dir / f"kv_memory_{scenario}.png", f"{title}; {scenario}"))
    online = [r for r in _ok(runs) if r["scenario"] != "offline"]
    if online:
        points: dict[str, list] = {}
        for r in online:
            points.setdefault(r["backend"], []).append(
                (float(r["config"]["workload"]["request_rate"]), r["serving"]["output_throughput"],
                 r["serving"]["ttft_ms"]["p50"]))
        paths.append(report.plot_throughput_vs_rate(points, out_dir / "throughput_vs_rate.png", title))
    return paths


def _describe(results: dict, runs: list[dict]) -> str:
    ok = _ok(runs)
    w = results["workload"]
    first = ok[0] if ok else {}
    model = first.get("model", {})
    prints = {r["scenario"]: {x["workload_fingerprint"] for x in ok if x["scenario"] == r["scenario"]} for r in ok}
    same = all(len(v) == 1 for v in prints.values())
    return (f"model {model.get('name', '?')} ({model.get('kind', '?')}; {model.get('num_layers')} layers, "
            f"{model.get('num_kv_heads')} KV heads, head_dim {model.get('head_dim')}), {first.get('dtype', '?')} on "
            f"{first.get('device_name', '?')}; workload {w['kind']}: {w['num_requests']} requests, input "
            f"{w['input_len']}, output {w['output_len']} (ignore_eos), seed {w['seed']}, burstiness "
            f"{w['burstiness']}; max_model_len {results['max_model_len']}; identical requests on every backend: "
            f"{'yes' if same else 'NO'}")


def render(results: dict, runs: list[dict], out_dir: Path, console) -> None:
    """Print the tables, write ``summary.md`` and the plots into ``out_dir``."""
    desc = _describe(results, runs)
    tables = [("Serving (latencies in ms)", SERVING_COLUMNS, serving_rows(runs)),
              ("KV memory and allocation", MEMORY_COLUMNS, memory_rows(runs)),
              ("Ratios (lower is better for latency, higher for throughput)", RATIO_COLUMNS, ratio_rows(runs))]
    console.print(desc)
    for title, cols, rows in tables:   # split to the console's width: a cut cell ("8.0M/…") says nothing
        for table in report.fitting_tables(console, title, cols, rows) if rows else []:
            console.print(table)
    failed = [r for r in runs if "error" in r]
    plots = []
    try:
        plots = _plots(runs, out_dir, _describe_short(runs))
    except Exception as exc:  # plots are a convenience; never lose the JSON over them
        console.print(f"[yellow]plotting failed: {exc}[/yellow]")
    env = results["environment"]
    md = ["# vmkv compare engine", "", f"Command: `{env['command']}`", "",
          f"Commit {env.get('git_commit')}{' (dirty)' if env.get('git_dirty') else ''}, torch {env['torch']}, "
          f"triton {env['triton']}, CUDA {env['torch_cuda']}, GPUs {env['gpus'] or 'none'}, CPU {env['cpu']}.", "",
          desc + ".", ""]
    for title, cols, rows in tables + [("Latency detail", DETAIL_COLUMNS, detail_rows(runs))]:
        if rows:
            md += [f"## {title}", "", report.markdown_table(cols, rows), ""]
    if failed:
        md += ["## Failed runs", ""] + [f"- {r['scenario']}-{r['backend']}: {r['error']}" for r in failed] + [""]
    md += ["Definitions (sizes in powers of 1024: K = KiB, M = MiB, G = GiB): TTFT arrival to first token; TPOT (E2E - TTFT) / (output tokens - 1); ITL gaps between "
           "token steps; waste % = (allocated - used) / allocated averaged over steps; alloc % = time in the "
           "cache's allocate/extend/fork/free on the critical path / step time; alloc ahead % = the same calls made "
           "while scheduling a step ahead (async scheduling: the GPU runs the previous step meanwhile) / step time; prefetch % = time in the cache's prefetch (maps ahead while the GPU "
           "runs the forward, off the critical path) / step time; created = physical KV memory that exists (vmem: "
           "pages created and not released; paged: its static pool), peak over the run / at its last step; device "
           "peak = device memory in use (CUDA: total - free; CPU: process RSS). Plot `kv_memory_<scenario>.png`: KV "
           "memory over time (created, mapped, in use, idle per backend) next to device memory in use. Raw samples: "
           "`raw/*.json`.", ""]
    md += [f"![{p.stem}]({p.name})" for p in plots]
    (out_dir / "summary.md").write_text("\n".join(md) + "\n")
    console.print(f"wrote {out_dir}/results.json, summary.md, raw/, {len(plots)} plots")


def _describe_short(runs: list[dict]) -> str:
    ok = _ok(runs)
    if not ok:
        return ""
    r = ok[0]
    return f"{r['model']['name']} {r['dtype']} on {r['device_name']}"
