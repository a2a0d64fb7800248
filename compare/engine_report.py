"""Tables, markdown and plots of a ``vmkv compare engine`` run (see :mod:`vmkv.compare.engine_bench`)."""

from __future__ import annotations

import math
from pathlib import Path

from vmkv.compare import report
from vmkv.compare.metrics import (NORM_LATENCY_BOUND_FACTOR, SLO, SLO_ATTAINMENT_MIN, WARMUP_FRACTION, RequestRecord,
                                  inter_token_latencies, sustained_rate, sweep_point)
from vmkv.engine.reservation import design_label, parse_design, reserved_tokens

__all__ = ["render", "vmm_latency", "serving_rows", "memory_rows", "ratio_rows", "memory_series", "records_from_raw",
           "sweep", "reference_design", "sweep_rows", "sustained_rows", "breakdown_rows", "budget_label", "budget_of",
           "budget_table", "budget_rows", "BUDGET_COLUMNS", "NOISE_FRACTION"]

SERVING_COLUMNS = ["scenario", "backend", "budget", "rate", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
                   "TPOT p99", "ITL p50", "ITL p99", "E2E p50", "E2E p99", "goodput"]
MEMORY_COLUMNS = ["scenario", "backend", "budget", "KV alloc peak", "mapped peak", "created peak/final", "waste %",
                  "reserved unused %", "B/used tok",
                  "max seqs", "preempt", "hit %", "alloc %", "alloc ahead %", "prefetch %", "alloc us p99", "map us p50/99",
                  "unmap us p50/99", "device peak"]
RATIO_COLUMNS = ["scenario", "ratio", "out tok/s", "TTFT p50", "TPOT p50", "E2E p50", "peak mapped", "max seqs"]

_f = report.fmt_num


def _ok(runs: list[dict]) -> list[dict]:
    return [r for r in runs if "serving" in r]


def budget_label(n: int | None) -> str:
    """A KV budget's label: ``2GiB``, ``1.5GiB``, ``512MiB``, ``4096B``; ``auto`` for None (the engine's
    default budget).  A budget given in GiB with decimals (``--memory-gib 1.9``: 2,040,109,465 bytes) is
    labelled by its 3-decimal value when that is within a byte per MiB of it (``1.9GiB``)."""
    if n is None:
        return "auto"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and (n * 1000) % scale == 0:      # at most 3 decimals, exact
            return f"{n / scale:g}{unit}"
        value = round(n / scale, 3)
        if n >= scale and abs(value * scale - n) <= scale >> 20:
            return f"{value:g}{unit}"
    return f"{int(n)}B"


def budget_of(run: dict) -> tuple[int | None, str]:
    """``(bytes, label)`` of a run's KV budget: ``kv_budget_bytes`` / ``budget`` as ``vmkv compare engine``
    records them, else its worker configuration's ``memory_bytes`` (results written before budgets were
    swept)."""
    n = run.get("kv_budget_bytes", ((run.get("config") or {}).get("knobs") or {}).get("memory_bytes"))
    return n, run.get("budget") or budget_label(n)


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
        rows.append([r["scenario"], r["backend"], budget_of(r)[1], "inf" if rate == "inf" else _f(float(rate)),
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
        rows.append([r["scenario"], r["backend"], budget_of(r)[1], report.fmt_size(m["peak_allocated_bytes"], 1),
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
    online = [r for r in _ok(runs) if math.isfinite(_rate(r))]
    if online:
        points: dict[str, list] = {}
        several = len({budget_of(r)[1] for r in online}) > 1
        for r in online:
            points.setdefault(r["backend"] + (f" {budget_of(r)[1]}" if several else ""), []).append(
                (float(r["config"]["workload"]["request_rate"]), r["serving"]["output_throughput"],
                 r["serving"]["ttft_ms"]["p50"]))
        paths.append(report.plot_throughput_vs_rate(points, out_dir / "throughput_vs_rate.png", title))
    return paths


def records_from_raw(raw_requests: list[dict]) -> list[RequestRecord]:
    """The :class:`RequestRecord` of every raw request (``raw["requests"]``; times since the run's start)."""
    return [RequestRecord(request_id=q["id"], prompt_len=q["prompt_len"], output_len=q["output_len"],
                          arrival_time=q["arrival_s"], first_token_time=q["first_token_s"], finish_time=q["finish_s"],
                          token_times=list(q.get("token_times_s") or []), num_output_tokens=q.get("num_output_tokens"),
                          success=q["success"], error=q.get("error", "")) for q in raw_requests]


def reference_design(designs: list[str], requested: str | None = None) -> str | None:
    """The design sustained rates are compared with: ``requested`` (``--reference-design``), else the
    first static Max design (``paged+max``: the paper's Orca (Max) baseline), else the first design.

    Raises:
        ValueError: ``requested`` is not among ``designs``.
    """
    if requested:
        if requested not in designs:
            raise ValueError(f"--reference-design {requested!r} is not among the designs run: {designs}")
        return requested
    return next((d for d in designs if d.endswith("+max")), designs[0] if designs else None)


def _rate(r: dict) -> float:
    rate = r["config"]["workload"]["request_rate"]
    return math.inf if rate in ("inf", None) else float(rate)


def sweep(runs: list[dict], slo_text: str | None, reference: str | None = None,
          attainment_min: float = SLO_ATTAINMENT_MIN, warmup_fraction: float = WARMUP_FRACTION) -> dict | None:
    """The online sweep of a comparison (``results["sweep"]``), from the finite-rate runs that carry raw
    requests; None without one.  Per design (run order), ``points``: one
    :func:`vmkv.compare.metrics.sweep_point` per rate (the first ``warmup_fraction`` of requests by
    arrival dropped) plus ``scenario``, ``goodput`` (req/s meeting the SLO over the whole run, as in
    ``serving``), ``goodput_per_offered`` (goodput / rate), ``request_throughput``,
    ``output_throughput``, ``batch_mean`` / ``batch_max`` (sequences in the running batch over the
    steps); ``sustained_is_lower_bound``: every swept rate passed (sweep higher to find the limit); a run that failed (or timed out, ``--timeout-s``) is a point with its ``error`` and no figures,
    a rate not sustained; ``sustained_rate`` and ``passes`` (:func:`vmkv.compare.metrics.sustained_rate`), and
    ``sustained_vs_reference``: its sustained rate / the reference design's (None when either is None)."""
    online = [r for r in runs if "raw" in r and "serving" in r and math.isfinite(_rate(r))]
    failed = [r for r in runs if "error" in r and math.isfinite(float(r.get("request_rate", math.inf)))]
    if not online and not failed:
        return None
    slo = SLO.parse(slo_text)
    out_designs: dict[str, dict] = {}
    for r in runs:
        if r in failed:     # a failed or timed-out run: its rate is not sustained (no figures)
            out_designs.setdefault(r["backend"], {"points": []})["points"].append(
                {"rate": float(r["request_rate"]), "scenario": r.get("scenario"), "error": r["error"],
                 "normalized_latency_s": None, "slo_attainment": None, "goodput": None,
                 "goodput_per_offered": None, "requests_measured": 0})
            continue
        if r not in online:
            continue
        pt = sweep_point(records_from_raw(r["raw"]["requests"]), _rate(r), slo, warmup_fraction)
        s = r["serving"]
        steps = r["raw"].get("steps") or {}
        batch = steps.get("num_running_seqs") or steps.get("num_running") or []
        pt.update(scenario=r["scenario"], goodput=s.get("goodput"),
                  goodput_per_offered=(s["goodput"] / pt["rate"]) if s.get("goodput") is not None else None,
                  request_throughput=s["request_throughput"], output_throughput=s["output_throughput"],
                  batch_mean=(sum(batch) / len(batch)) if batch else 0.0, batch_max=max(batch, default=0))
        out_designs.setdefault(r["backend"], {"points": []})["points"].append(pt)
    ref = reference_design(list(out_designs), reference)
    for d in out_designs.values():
        d["points"].sort(key=lambda p: p["rate"])
        d.update(sustained_rate(d["points"], attainment_min, NORM_LATENCY_BOUND_FACTOR))
    ref_rate = out_designs[ref]["sustained_rate"] if ref else None
    for d in out_designs.values():
        d["sustained_vs_reference"] = (d["sustained_rate"] / ref_rate if d["sustained_rate"] is not None
                                       and ref_rate else None)
    return {"warmup_fraction": warmup_fraction, "slo": slo_text, "reference_design": ref,
            "rule": {"slo_attainment_min": attainment_min if slo.is_set else None,
                     "norm_latency_bound_factor": NORM_LATENCY_BOUND_FACTOR,
                     "text": SUSTAINED_RULE_TEXT.format(att=attainment_min, k=NORM_LATENCY_BOUND_FACTOR,
                                                        w=int(round(100 * warmup_fraction)))
                     + ("" if slo.is_set else " No SLO was given (--slo): the latency bound alone decides.")},
            "designs": out_designs}


SUSTAINED_RULE_TEXT = ("A swept rate is sustained when (a) at least {att:g} of its measured requests meet every "
                       "--slo objective (SLO attainment: goodput >= {att:g} x the offered requests, counted per "
                       "request so the run's drain does not count against it) and (b) its normalized latency "
                       "(mean of end-to-end latency / output tokens) is at most {k:g} x the design's lowest in "
                       "the sweep (it stays bounded rather than growing with the queue); a design's sustained "
                       "rate is the highest swept rate that passes with every lower swept rate passing too. "
                       "Measured requests: all but the first {w}% by arrival.")

SUSTAINED_COLUMNS = ["design", "sustained req/s", "x reference", "rates swept", "first failing rate"]
SWEEP_COLUMNS = ["design", "rate", "norm lat ms/tok", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "goodput",
                 "goodput/rate", "SLO met %", "batch mean", "ok"]
BREAKDOWN_COLUMNS = ["scenario", "design", "created mean", "token %", "reserved unused %", "tail %", "idle %",
                     "in use: token %", "in use: reserved %", "in use: tail %"]


def sustained_rows(sw: dict | None) -> list[list[str]]:
    """The table a user reads first: per design, the rate it sustains and its ratio to the reference."""
    if not sw:
        return []
    rows = []
    for name, d in sw["designs"].items():
        fail = next((p for p in d["passes"] if not p["passed"]), None)
        ref = sw["designs"][sw["reference_design"]]
        ratio = "-"
        if d["sustained_vs_reference"] is not None:   # an unsaturated design: at least; an unsaturated reference: at most
            lo, hi = d.get("sustained_is_lower_bound"), ref.get("sustained_is_lower_bound") and name != sw["reference_design"]
            ratio = ("? " if lo and hi else ">= " if lo else "<= " if hi else "") + f"{d['sustained_vs_reference']:.2f}x"
        rows.append([name + (" (reference)" if name == sw["reference_design"] else ""),
                     "none" if d["sustained_rate"] is None else
                     (">= " if d.get("sustained_is_lower_bound") else "") + _f(d["sustained_rate"]),
                     ratio,
                     ", ".join(_f(p["rate"]) for p in d["points"]),
                     "-" if fail is None else f"{_f(fail['rate'])}: {fail['why']}"])
    return rows


def sweep_rows(sw: dict | None) -> list[list[str]]:
    if not sw:
        return []
    rows = []
    for name, d in sw["designs"].items():
        ok = {p["rate"]: p["passed"] for p in d["passes"]}
        for p in d["points"]:
            nl = p["normalized_latency_s"]
            if p.get("error"):
                rows.append([name, _f(p["rate"]), "failed"] + ["-"] * (len(SWEEP_COLUMNS) - 4) + ["no"])
                continue
            rows.append([name, _f(p["rate"]), "-" if nl is None or math.isnan(nl) else _f(1e3 * nl, 2),
                         _f(p["ttft_ms"]["p50"], 1), _f(p["ttft_ms"]["p99"], 1), _f(p["tpot_ms"]["p50"], 2),
                         _f(p["tpot_ms"]["p99"], 2), "-" if p["goodput"] is None else _f(p["goodput"]),
                         "-" if p["goodput_per_offered"] is None else _f(p["goodput_per_offered"]),
                         "-" if p["slo_attainment"] is None else _f(100 * p["slo_attainment"], 1),
                         _f(p["batch_mean"], 1), "yes" if ok.get(p["rate"]) else "no"])
    return rows


def breakdown_rows(runs: list[dict]) -> list[list[str]]:
    """The memory breakdown of every run (``memory["breakdown"]``): shares of the created bytes and of
    the in-use bytes, summed over the steps."""
    rows = []
    for r in _ok(runs):
        b = r["memory"].get("breakdown")
        if not b:
            continue
        rows.append([r["scenario"], r["backend"], report.fmt_size(b["created_bytes_mean"], 1)]
                    + [_f(b[f"{k}_pct"], 1) for k in ("token", "reserved_unused", "tail", "idle")]
                    + [_f(b[f"in_use_{k}_pct"], 1) for k in ("token", "reserved_unused", "tail")])
    return rows


def _sweep_plots(runs: list[dict], sw: dict | None, out_dir: Path, title: str, suffix: str = "") -> list[Path]:
    """``normalized_latency_vs_rate<suffix>.png`` (Fig. 12; suffix ``_2GiB`` per budget of a budget sweep),
    and per scenario ``batch_size_<scenario>.png`` (Fig. 13 over time) and ``kv_breakdown_<scenario>.png``
    (Fig. 2 over time, a panel per design)."""
    paths = []
    if sw:
        pts = {name: [(p["rate"], p["normalized_latency_s"]) for p in d["points"] if not p.get("error")]
               for name, d in sw["designs"].items()}
        paths.append(report.plot_normalized_latency_vs_rate(
            pts, out_dir / f"normalized_latency_vs_rate{suffix}.png", f"normalized latency vs rate; {title}",
            {name: d["sustained_rate"] for name, d in sw["designs"].items()}))
    ok = [r for r in runs if "raw" in r and "serving" in r]
    for scenario in dict.fromkeys(r["scenario"] for r in ok):
        group = [r for r in ok if r["scenario"] == scenario]
        labels = [r["backend"] if [g["backend"] for g in group].count(r["backend"]) == 1 else f"{r['backend']}#{i}"
                  for i, r in enumerate(group)]
        batch = {}
        for lb, r in zip(labels, group):
            st = r["raw"]["steps"]
            batch[lb] = (st["t_s"], st.get("num_running_seqs") or st["num_running"])
        paths.append(report.plot_batch_size(batch, out_dir / f"batch_size_{scenario}.png",
                                            f"batch size over time; {title}; {scenario}"))
        paths.append(report.plot_memory_breakdown(
            {lb: {**r["raw"]["steps"], "capacity_bytes": r["memory"]["capacity_bytes"]} for lb, r in zip(labels, group)},
            out_dir / f"kv_breakdown_{scenario}.png", f"KV memory breakdown; {title}; {scenario}"))
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
    # per KV budget its sweep (results written before budgets were swept: "sweep" alone)
    sweeps = results.get("sweeps") or ({"": results["sweep"]} if results.get("sweep") else {})
    several = len(sweeps) > 1
    first = []
    btable = results.get("budget_table") or []
    show_budgets = bool(btable) and (several or any(e.get("base") for e in btable))
    if show_budgets:
        cols, rows = budget_rows(btable)
        first.append((BUDGET_TITLE, cols, rows))
    for label, sw in sweeps.items():
        if not sw:
            continue
        at = f"; KV budget {label}" if several else ""
        first += [(f"Sustained request rate within the SLO ({sw['slo'] or 'no SLO'}; reference "
                   f"{sw['reference_design']}{at})", SUSTAINED_COLUMNS, sustained_rows(sw)),
                  (f"Online sweep (first {int(round(100 * sw['warmup_fraction']))}% of requests by arrival dropped; "
                   f"latencies in ms; goodput req/s{at})", SWEEP_COLUMNS, sweep_rows(sw))]
    tables = first + [("Serving (latencies in ms)", SERVING_COLUMNS, serving_rows(runs)),
              ("KV memory and allocation", MEMORY_COLUMNS, memory_rows(runs)),
              ("KV memory breakdown (shares summed over the steps)", BREAKDOWN_COLUMNS, breakdown_rows(runs)),
              ("Ratios (lower is better for latency, higher for throughput)", RATIO_COLUMNS, ratio_rows(runs))]
    console.print(desc)
    for title, cols, rows in tables:   # split to the console's width: a cut cell ("8.0M/…") says nothing
        why = title == BUDGET_TITLE and cols[-1] == "why"     # the budget table's reasons: lines below it
        for table in report.fitting_tables(console, title, cols[:-1] if why else cols,
                                           [r[:-1] for r in rows] if why else rows) if rows else []:
            console.print(table)
        if why:
            for e in btable:
                if e.get("why"):
                    console.print(f"  {e['budget']} {e['design']} / {e['base']}: {e['why']}")
    failed = [r for r in runs if "error" in r]
    plots = []
    try:
        plots = _plots(runs, out_dir, _describe_short(runs))
        for label, sw in (sweeps or {"": None}).items():
            mine = [r for r in runs if budget_of(r)[1] == label] if several else runs
            plots += _sweep_plots(mine, sw, out_dir, _describe_short(runs) + (f"; KV budget {label}" if several else ""),
                                  f"_{label}" if several else "")
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
    flagged = [e for e in btable if e.get("static_ge_paged")]
    if show_budgets:
        md += ["Budget table definitions: KV tokens = the budget's token slots (capacity / KV bytes per token); "
               "out x ref and sustained x ref = the design's offline output tok/s and sustained rate / the "
               "reference design's at the same budget; max seqs, max waiting and preempt = the most sequences "
               "running at once, the most requests queued at a step, and preemptions (the offline run, else "
               "over the online runs); reserved unused % = allocated KV reserved but not written yet (a static "
               "reservation's waste), mean over the steps; demand / budget = every request's reservation "
               "(static) or prompt + output (no reservation) over the budget's token slots (<= 1: every request "
               "fits at once and nothing need queue for memory); static/paged = a static design's figure "
               "(offline tok/s, else sustained rate) / its backend's without a reservation; 'static >= paged' "
               "flags where the paging's overhead outweighs its waste saving, '(noise)' where the two are "
               f"within {NOISE_FRACTION:.0%} (one run; BENCHMARKS.md repeats a claim 3 times).", ""]
        if flagged:
            md += ["Where static >= paged:", ""] + [
                f"- {e['budget']}, {e['design']} / {e['base']} = {e['vs_base']:.3f} ({e['metric']}): {e['why']}"
                for e in flagged] + [""]
    sw = next((x for x in sweeps.values() if x), None)
    if sw:
        md += ["Sweep definitions: normalized latency = mean over the measured requests of end-to-end latency / "
               "output tokens (the PagedAttention paper's Fig. 12, ms per token here, s per token in the plot and "
               "JSON); SLO met % = measured requests meeting every --slo objective; goodput = requests meeting "
               "the SLO per second of the whole run; batch mean = sequences in the running batch averaged over "
               "steps. " + sw["rule"]["text"], ""]
    md += ["Memory breakdown (the paper's Fig. 2): token states (written K/V of live sequences) + reserved "
           "unused (backed, not written yet: a static reservation's waste) + tail (block or page tails past the "
           "backed positions) + idle (created, backing no live sequence: paged's free blocks, vmem's kept pages) "
           "= created; plot `kv_breakdown_<scenario>.png`, raw per step in `raw/*.json` (`token_bytes`, "
           "`reserved_unused_bytes`, `waste_bytes`, `idle_bytes`). Plot `batch_size_<scenario>.png`: sequences "
           "in the running batch per step (Fig. 13).", ""]
    report.write_summary(out_dir, md, plots, console)


def _describe_short(runs: list[dict]) -> str:
    ok = _ok(runs)
    if not ok:
        return ""
    r = ok[0]
    return f"{r['model']['name']} {r['dtype']} on {r['device_name']}"


# ---------------------------------------------------------------------------------------- the budget table
#: BENCHMARKS.md: a single engine run can move 5-10%; a static/paged ratio this close to 1 is flagged as noise
NOISE_FRACTION = 0.05


def _base_design(design: str, names: list[str]) -> str | None:
    """The design a static design is measured against: its backend without a reservation, with the same
    variant options if that design ran (``paged+max`` -> ``paged``, ``vmem+max@x=1`` -> ``vmem@x=1``)."""
    backend, policy = parse_design(design)
    if policy == "none":
        return None
    _, at, variant = design.partition("@")
    for cand in (design_label(backend, "none") + at + variant, design_label(backend, "none")):
        if cand in names:
            return cand
    return None


def _demand(run: dict, policy: str) -> int | None:
    """KV tokens the run's requests need at once: every request's reservation under ``policy`` (a static
    design), or prompt + output tokens (no reservation); None without raw requests."""
    reqs = (run.get("raw") or {}).get("requests")
    if not reqs:
        return None
    mml = run.get("max_model_len") or (run.get("config") or {}).get("knobs", {}).get("max_model_len")
    total = 0
    for q in reqs:
        res = reserved_tokens(policy, q["prompt_len"], q["output_len"], mml) if mml else None
        total += res if res is not None else q["prompt_len"] + q["output_len"]
    return total


def _design_entry(label: str, design: str, mine: list[dict], sw: dict | None) -> dict:
    ok = _ok(mine)
    off = next((r for r in ok if math.isinf(_rate(r))), None)
    primary = [off] if off else ok
    with_mem = [r for r in primary if "memory" in r]
    kv_backend, policy = parse_design(design)
    first = primary[0] if primary else (mine[0] if mine else {})
    mem = first.get("memory") or {}
    bpt = first.get("kv_bytes_per_token")
    waiting = [max(st, default=0) for st in ((r.get("raw") or {}).get("steps", {}).get("num_waiting") for r in primary)
               if st is not None]
    demand = _demand(first, policy) if first else None
    capacity = int(mem["capacity_bytes"] // bpt) if mem.get("capacity_bytes") and bpt else None
    d = (sw or {}).get("designs", {}).get(design) or {}
    return {
        "budget": label, "kv_budget_bytes": budget_of(mine[0])[0] if mine else None, "design": design,
        "kv_backend": kv_backend, "kv_reservation": policy, "capacity_tokens": capacity,
        "offline_output_throughput": off["serving"].get("output_throughput") if off else None,
        "offline_request_throughput": off["serving"].get("request_throughput") if off else None,
        "sustained_rate": d.get("sustained_rate"), "sustained_is_lower_bound": d.get("sustained_is_lower_bound"),
        "sustained_vs_reference": d.get("sustained_vs_reference"),
        "max_concurrent_seqs": max((r["memory"]["max_concurrent_seqs"] for r in with_mem), default=None),
        "max_waiting": max(waiting) if waiting else None,
        "preemptions": sum(r["memory"]["preemptions"] for r in with_mem) if with_mem else None,
        "reserved_unused_pct_mean": (max(r["memory"].get("reserved_unused_pct_mean", 0.0) for r in with_mem)
                                     if with_mem else None),
        # every request's reservation (static) or its prompt + output (paged) over the budget's KV tokens
        "demand_tokens": demand, "demand_vs_capacity": demand / capacity if demand and capacity else None,
        "failed": [r.get("scenario") for r in mine if "error" in r],
    }


def _why(s: dict, b: dict, metric: str, ratio: float, noise: float) -> str:
    """Why a static design ``s`` ran as fast as (or slower than) its paged base ``b``, from measured fields."""
    ms, mb = s["max_concurrent_seqs"], b["max_concurrent_seqs"]
    if ratio >= 1:
        if b["preemptions"]:
            why = f"{b['design']} preempted {b['preemptions']} times (recomputing them), {s['design']} never preempts"
        elif ms is not None and mb is not None and ms >= mb:
            why = (f"the budget holds the reservations: {s['design']} ran {ms} sequences at once, as many as "
                   f"{b['design']} ({mb}), and nothing was preempted, so paging's memory saving buys no larger "
                   f"batch and its overhead decides")
        else:
            why = (f"{s['design']} ran fewer sequences at once ({ms} vs {mb}) at no loss in {metric}: the larger "
                   f"batch did not pay")
    elif ms is not None and mb is not None and ms >= mb:
        why = (f"{s['design']} ran as many sequences at once as {b['design']} ({ms}): memory did not decide, "
               f"the gap is the step's own cost")
    else:
        why = f"{s['design']}'s reservations held it to {ms} sequences at once vs {b['design']}'s {mb}"
        if s.get("max_waiting"):
            why += f", up to {s['max_waiting']} requests waiting (vs {b.get('max_waiting')})"
        if s.get("reserved_unused_pct_mean"):
            why += f"; {s['reserved_unused_pct_mean']:.0f}% of its allocated KV reserved and unwritten on average"
    if s.get("demand_vs_capacity") is not None:
        fit = s["demand_vs_capacity"]
        why += (f" (every request's reservation, {s['demand_tokens']:,} tokens, "
                + (f"fits the {s['capacity_tokens']:,}-token budget)" if fit <= 1 else
                   f"is {fit:.1f}x the {s['capacity_tokens']:,}-token budget)"))
    if abs(ratio - 1) < noise:
        why += f"; |ratio - 1| < {noise:.0%}: within one run's noise"
    return why


def budget_table(runs: list[dict], sweeps: dict[str, dict | None] | None = None, reference: str | None = None,
                 noise: float = NOISE_FRACTION) -> list[dict]:
    """``results["budget_table"]``: one row per (KV budget, design), budgets and designs in run order.

    Each row: ``budget`` / ``kv_budget_bytes``, ``design``, ``capacity_tokens`` (the budget's KV token
    slots), the offline ``offline_output_throughput`` (tok/s) and ``offline_vs_reference``, the sweep's
    ``sustained_rate`` and ``sustained_vs_reference`` (``sweeps[budget]``, :func:`sweep`), what decided them
    (of the offline run, else over the online runs): ``max_concurrent_seqs``, ``max_waiting`` (requests
    queued at a step), ``preemptions``, ``reserved_unused_pct_mean``, ``demand_tokens`` (every request's
    reservation, or prompt + output without one) and ``demand_vs_capacity``.  A static design (``+max``,
    ``+oracle``, ``+pow2``) is compared with its backend without a reservation (``base``): ``metric`` (the
    offline output tok/s when both ran offline, else the sustained rate), ``vs_base`` (static / base),
    ``static_ge_paged`` (vs_base >= 1; None when both sustained every swept rate: the ratio is unknown),
    ``within_noise`` (|vs_base - 1| < ``noise``) and ``why`` (:func:`_why`: the measured reason).  The
    reference: ``reference`` (``--reference-design``) where it ran at that budget, else the default of
    :func:`reference_design`."""
    sweeps = sweeps or {}
    names_all = list(dict.fromkeys(r["backend"] for r in runs))
    out = []
    for label in dict.fromkeys(budget_of(r)[1] for r in runs):
        at = [r for r in runs if budget_of(r)[1] == label]
        names = [d for d in names_all if any(r["backend"] == d for r in at)]
        entries = {d: _design_entry(label, d, [r for r in at if r["backend"] == d], sweeps.get(label)) for d in names}
        ref = reference if reference in names else reference_design(names)
        ref_tp = entries[ref]["offline_output_throughput"] if ref else None
        for d, e in entries.items():
            e["reference"] = ref
            e["offline_vs_reference"] = (e["offline_output_throughput"] / ref_tp
                                         if e["offline_output_throughput"] is not None and ref_tp else None)
            base = _base_design(d, names)
            e.update(base=base, metric=None, vs_base=None, static_ge_paged=None, within_noise=None, why="")
            if base is None:
                continue
            b = entries[base]
            if e["offline_output_throughput"] is not None and b["offline_output_throughput"]:
                e["metric"], e["vs_base"] = "offline out tok/s", e["offline_output_throughput"] / b["offline_output_throughput"]
            elif e["sustained_rate"] is not None and b["sustained_rate"]:
                e["metric"], e["vs_base"] = "sustained req/s", e["sustained_rate"] / b["sustained_rate"]
                if e["sustained_is_lower_bound"] and b["sustained_is_lower_bound"]:
                    e["why"] = "both sustain every swept rate: sweep higher to compare them"
                    continue
            elif b["sustained_rate"] and e["sustained_rate"] is None and sweeps.get(label):
                e["metric"], e["vs_base"] = "sustained req/s", 0.0
            if e["vs_base"] is None:
                continue
            e["static_ge_paged"] = e["vs_base"] >= 1.0
            e["within_noise"] = abs(e["vs_base"] - 1) < noise
            e["why"] = _why(e, b, e["metric"], e["vs_base"], noise)
        out += entries.values()
    return out


BUDGET_TITLE = ("Budget table: per KV budget and design, offline output tok/s and sustained rate (x the reference "
                "design), each static design / its backend without a reservation")
BUDGET_COLUMNS = ["budget", "design", "KV tokens", "out tok/s", "out x ref", "sustained req/s", "sustained x ref",
                  "max seqs", "max waiting", "preempt", "reserved unused %", "demand / budget", "static/paged",
                  "static >= paged", "why"]


def budget_rows(table: list[dict] | None) -> tuple[list[str], list[list[str]]]:
    """``(columns, rows)`` of :func:`budget_table`'s rows, the columns that no row has a value in left out
    (an offline-only run has no sustained rate)."""
    if not table:
        return BUDGET_COLUMNS, []
    rows = []
    for e in table:
        ge = e.get("static_ge_paged")
        flag = "-" if ge is None else ("yes" if ge else "no") + (" (noise)" if e.get("within_noise") else "")
        sus = e.get("sustained_rate")
        rows.append([e["budget"], e["design"] + (" (ref)" if e["design"] == e.get("reference") else ""),
                     "-" if e["capacity_tokens"] is None else f"{e['capacity_tokens']:,}",
                     _f(e["offline_output_throughput"], 1), _f(e.get("offline_vs_reference"), 3),
                     "-" if sus is None else (">= " if e.get("sustained_is_lower_bound") else "") + _f(sus),
                     _f(e.get("sustained_vs_reference"), 2),
                     "-" if e["max_concurrent_seqs"] is None else str(e["max_concurrent_seqs"]),
                     "-" if e["max_waiting"] is None else str(e["max_waiting"]),
                     "-" if e["preemptions"] is None else str(e["preemptions"]),
                     _f(e.get("reserved_unused_pct_mean"), 1), _f(e.get("demand_vs_capacity"), 2),
                     _f(e.get("vs_base"), 3), flag, e.get("why") or "-"])
    keep = [i for i, c in enumerate(BUDGET_COLUMNS) if i < 2 or any(r[i] != "-" for r in rows)]
    return [BUDGET_COLUMNS[i] for i in keep], [[r[i] for i in keep] for r in rows]
