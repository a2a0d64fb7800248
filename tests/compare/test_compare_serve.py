"""`vmkv compare serve`: arguments, one request list for both paths, ``vmkv serve``'s command line from the
worker's knobs, the ratios, the CPU accounting, and an end-to-end run through real ``vmkv serve`` processes
on the ``tiny`` random-weight shape (CPU)."""

import argparse
import json
import math
import os
import subprocess
import sys
import time

import pytest

from vmkv.cli import build_parser, main
from vmkv.compare import bench_cli, engine_bench, serve_bench, serve_report
from vmkv.compare.metrics import RequestRecord, compute_serving_metrics
from vmkv.compare.serve_client import decode_requests, encode_requests
from vmkv.compare.serve_proc import serve_argv, tree_cpu, window_cpu
from vmkv.compare.workloads import WorkloadSpec, fingerprint, generate

#: issue 22's workload (the H200 row), smaller: the lengths and arrivals are the same kind
ISSUE22 = ["--request-rate", "24,inf", "--input-len", "sharegpt-in", "--output-len", "64..512", "--max-num-seqs", "256",
           "--memory-gib", "64", "--slo", "ttft:1000,tpot:50", "--random-weights", "llama3-8b", "--dtype", "bf16",
           "--num-requests", "60", "--async-scheduling"]


def _args(argv: list[str]) -> argparse.Namespace:
    argv = ["compare", "serve", *argv]
    return build_parser(argv).parse_args(argv)


def _cfgs(argv: list[str]) -> tuple[argparse.Namespace, list[dict]]:
    """Every (rate, backend) worker configuration the command would run, as ``run`` builds them."""
    args = _args(argv)
    serve_bench._check_args(args)
    plan = engine_bench.plan(args)
    cfgs = []
    for rate_text in plan.rates:
        spec = engine_bench._spec(args, engine_bench.resolve_rate(rate_text, args, [], plan.backends[0]))
        cfgs += [engine_bench.worker_config(args, b, rate_text, spec, plan.max_model_len) for b in plan.backends]
    return args, cfgs


# ------------------------------------------------------------------------------------------ arguments
def test_the_workload_flags_are_compare_engines():
    args, cfgs = _cfgs(ISSUE22)
    assert args.model == "llama3-8b" and args.paths == "inprocess,served" and args.client_processes == 1
    assert [(c["scenario"], c["backend"]) for c in cfgs] == [("offline", "paged"), ("offline", "vmem"),
                                                             ("rate-24", "paged"), ("rate-24", "vmem")]
    for c in cfgs:
        k = c["knobs"]
        assert (k["random_weights"], k["max_num_seqs"], k["memory_bytes"], k["async_scheduling"]) == \
            ("llama3-8b", 256, 64 << 30, True)
        assert c["slo"] == "ttft:1000,tpot:50" and c["dtype"] == "bf16" and c["model"] is None
        assert c["workload"]["input_len"] == "sharegpt-in" and c["workload"]["num_requests"] == 60
    # the same flags give compare engine the same worker configurations
    eargv = ["compare", "engine", *[a for a in ISSUE22 if a != "--random-weights"]]
    eargv[eargv.index("llama3-8b")] = "--model"
    eargv.insert(eargv.index("--model") + 1, "llama3-8b")
    eargs = build_parser(eargv).parse_args(eargv)
    eplan = engine_bench.plan(eargs)
    spec = engine_bench._spec(eargs, 24.0)
    assert engine_bench.worker_config(eargs, "vmem", "24", spec, eplan.max_model_len) == cfgs[-1]


def test_argument_errors(capsys):
    for argv, msg in ((["--paths", "served,http"], "--paths must list"),
                      (["--paths", "served,served"], "--paths must list"),
                      (["--random-weights", "tiny", "--model", "llama3-8b"], "name two models"),
                      (["--random-weights", "huge"], "is not a shape"),
                      (["--client-processes", "0"], "--client-processes must be >= 1"),
                      (["--workload", "parallel", "--n", "2"], "--n > 1"),
                      (["--request-rate", "fast"], "request rate 'fast'"),
                      (["--backends", "paged", "--attention-impl", "sdpa"], "option of the vmem backend")):
        model = [] if "--random-weights" in argv else ["--random-weights", "tiny"]
        assert main(["compare", "serve", *model, *argv]) == 2, argv
        assert msg in capsys.readouterr().out, argv
    assert serve_bench.parse_paths("served, in-process") == ["served", "inprocess"]


def test_serve_gets_the_in_process_engines_knobs():
    """``vmkv serve``'s own parser reads back every knob the in-process worker gets, for both backends."""
    from vmkv.engine.args import engine_kwargs

    _, cfgs = _cfgs([*ISSUE22, "--max-num-batched-tokens", "8192", "--block-size", "32", "--layout", "per_layer",
                     "--lookahead-tokens", "16", "--kv-reserve", "1GiB", "--kv-shrink-grace-s", "inf",
                     "--page-size", "32MiB", "--no-prefix-caching", "--cuda-graph-sizes", "1", "8",
                     "--torch-threads", "2", "--device", "cuda:0", "--seed", "7"])
    for cfg in cfgs[:2]:
        argv = serve_argv(cfg, 8123, graceful_timeout_s=3)
        ns = build_parser(["serve", *argv]).parse_args(["serve", *argv])
        kw = engine_kwargs(ns)
        assert kw["kv_backend"] == cfg["backend"] and kw["device"] == "cuda:0" and kw["dtype"] == "bf16"
        assert kw["model"] is None and ns.threads == 2 and ns.port == 8123 and ns.graceful_timeout == 3
        for knob, value in cfg["knobs"].items():
            assert kw[knob] == value, knob
    assert cfgs[0]["knobs"]["block_size"] == 32 and "layout" not in cfgs[0]["knobs"]
    assert cfgs[1]["knobs"]["kv_shrink_grace_s"] == math.inf and cfgs[1]["knobs"]["page_size_bytes"] == 32 << 20
    with pytest.raises(ValueError, match="has no vmkv serve flag"):
        serve_argv({**cfgs[0], "knobs": {"new_knob": 1}}, 1)


# ------------------------------------------------------------------------------------------ one request list
def test_served_and_in_process_get_the_same_requests():
    """The served run sends the list the in-process worker regenerates (``generate(workload, vocab)``),
    through the client's wire format unchanged, split over client processes without loss, as token-id
    prompts with exact output lengths."""
    _, cfgs = _cfgs(ISSUE22)
    cfg = next(c for c in cfgs if c["scenario"] == "rate-24")
    vocab = 128256
    served = serve_bench.served_requests(cfg, vocab)
    in_process = generate(WorkloadSpec.from_dict(cfg["workload"]), vocab)     # what engine_worker runs
    assert fingerprint(served) == fingerprint(in_process)
    assert [(r.request_id, r.prompt_token_ids, r.output_len, r.arrival_s) for r in served] == \
        [(r.request_id, r.prompt_token_ids, r.output_len, r.arrival_s) for r in in_process]
    assert served[-1].arrival_s > 0 and len({r.prompt_len for r in served}) > 10    # Poisson, ShareGPT-like
    wire = decode_requests(json.loads(json.dumps(encode_requests(served))))
    assert fingerprint(wire) == fingerprint(in_process)
    for n in (1, 3):
        parts = serve_bench.split_requests(wire, n)
        assert len(parts) == n and sorted(r.request_id for p in parts for r in p) == sorted(r.request_id for r in wire)
        assert all([r.arrival_s for r in p] == sorted(r.arrival_s for r in p) for p in parts)
    ns = argparse.Namespace(temperature=1.0, no_ignore_eos=False, endpoint="/v1/completions")
    body = bench_cli._payload(wire[0], ns, "m")
    assert body["prompt"] == in_process[0].prompt_token_ids and body["max_tokens"] == in_process[0].output_len
    assert body["ignore_eos"] is True and body["stream"] and body["return_token_ids"]
    # offline: every arrival at 0 in both paths
    off = next(c for c in cfgs if c["scenario"] == "offline")
    assert {r.arrival_s for r in serve_bench.served_requests(off, vocab)} == {0.0}


def test_the_warm_up_is_the_in_process_workers():
    from vmkv.compare.engine_worker import warmup_sets

    _, cfgs = _cfgs([*ISSUE22, "--warmup-fill-budget"])
    cfg = cfgs[0]
    reqs = serve_bench.served_requests(cfg, 128256)
    phases = serve_bench._warmup_phases(cfg, reqs, cfg["knobs"]["max_model_len"], 128256)
    sets = warmup_sets(cfg, WorkloadSpec.from_dict(cfg["workload"]), reqs, cfg["knobs"]["max_model_len"], 128256)
    assert [p["name"] for p in phases] == ["warmup-0-offline", "warmup-1-offline", "warmup-2-mixed"]
    for p, (_, s) in zip(phases, sets):
        assert [row[1] for row in p["requests"]] == [r.prompt_token_ids for r in s]
    assert [row[3] for row in phases[2]["requests"]] == [0.0, serve_bench.MIXED_WARMUP_DELAY_S]
    assert serve_bench._warmup_phases({**cfg, "warmup_requests": 0}, reqs, 2560, 128256) == []


def test_client_phases_merge_into_one_run():
    def rec(i, t0, n=3):
        return RequestRecord(f"req-{i}", 5, n, t0, t0 + 0.1, t0 + 0.1 + 0.01 * (n - 1),
                             [t0 + 0.1 + 0.01 * k for k in range(n)]).to_dict()

    phases = [{"start": 100.0, "records": [rec(0, 100.0), rec(2, 100.5)]},
              {"start": 100.0, "records": [rec(1, 100.2)]}]
    records, start, duration = serve_bench.merge_client_phases(phases)
    assert start == 100.0 and duration == pytest.approx(0.62) and len(records) == 3
    m = compute_serving_metrics(records, duration)
    assert m["completed"] == 3 and m["total_output_tokens"] == 9 and m["ttft_ms"]["p50"] == pytest.approx(100)


# ------------------------------------------------------------------------------------------ ratios
def _serving(out_tok_s, goodput, tpot_p50, ttft_p99):
    return {"output_throughput": out_tok_s, "goodput": goodput, "tpot_ms": {"p50": tpot_p50},
            "ttft_ms": {"p99": ttft_p99}}


def test_ratios_and_targets():
    # issue 22's measured row: 4,984 / 6,348 out tok/s, 10.29 / 21.67 goodput, 38.2 / 14.3 TPOT, 4,861 / 133 TTFT
    r = serve_report.ratios(_serving(4984, 10.29, 38.2, 4861), _serving(6348, 21.67, 14.3, 133))
    assert r == pytest.approx({"output_throughput": 0.785, "goodput": 0.4749, "tpot_p50": 2.671,
                               "ttft_p99": 36.55}, rel=1e-3)
    assert serve_report.meets(r) == {k: False for k in serve_report.TARGETS}
    r = serve_report.ratios(_serving(6200, 21.0, 15.0, 190), _serving(6348, 21.67, 14.3, 133))
    assert serve_report.meets(r) == {"output_throughput": True, "goodput": True, "tpot_p50": True, "ttft_p99": True}
    # no SLO (goodput None), a zero or NaN in-process value: no ratio, no verdict
    r = serve_report.ratios(_serving(1.0, None, 2.0, float("nan")), _serving(0.0, None, 1.0, 5.0))
    assert r == {"output_throughput": None, "goodput": None, "tpot_p50": 2.0, "ttft_p99": None}
    assert serve_report.meets(r)["goodput"] is None and serve_report.meets(r)["tpot_p50"] is False


def test_compare_pairs_the_paths_per_scenario_and_backend():
    runs = [{"path": "inprocess", "scenario": "rate-24", "backend": "paged", "workload_fingerprint": "a",
             "serving": _serving(100, 10, 10, 100)},
            {"path": "served", "scenario": "rate-24", "backend": "paged", "workload_fingerprint": "a",
             "serving": _serving(90, 10, 11, 120), "rate_spec": "24",
             "client": {"busiest_cores": 0.3, "loop_lag_p99_ms": 1.0}},
            {"path": "inprocess", "scenario": "rate-24", "backend": "vmem", "workload_fingerprint": "a",
             "serving": _serving(100, 10, 10, 100)},
            {"path": "served", "scenario": "rate-24", "backend": "vmem", "workload_fingerprint": "b",
             "serving": _serving(100, 10, 10, 100), "client": {"busiest_cores": 0.95, "loop_lag_p99_ms": 1.0}},
            {"path": "served", "scenario": "offline", "backend": "paged", "error": "boom"}]
    c = serve_report.compare(runs)
    assert [(x["scenario"], x["backend"]) for x in c] == [("rate-24", "paged"), ("rate-24", "vmem")]
    assert c[0]["ratios"]["output_throughput"] == pytest.approx(0.9) and c[0]["meets"]["output_throughput"] is False
    assert c[0]["identical_workload"] and not c[1]["identical_workload"]
    assert c[0]["client_bound"] is False and c[1]["client_bound"] is True
    assert serve_report.client_bound({"busiest_cores": 0.1, "loop_lag_p99_ms": 25.0}) is True
    rows = serve_report.ratio_rows(c)
    assert rows[0][2] == "0.900 MISS" and rows[0][5] == "1.200 ok" and rows[1][-1] == "NO"


# ------------------------------------------------------------------------------------------ CPU accounting
def test_window_cpu_of_sampled_trees():
    names = {10: {"ppid": 1, "comm": "python", "cmdline": "vmkv serve"},
             11: {"ppid": 10, "comm": "python", "cmdline": "engine core"}}
    samples = [(0.0, {10: 1.0}), (1.0, {10: 1.5, 11: 0.2}), (2.0, {10: 2.0, 11: 1.2}), (3.0, {10: 2.5, 11: 2.2})]
    w = window_cpu(samples, names, 1.2, 2.9)       # widened to the samples around it: 1.0 .. 3.0
    assert w["wall_s"] == 2.0 and w["cpu_s"] == pytest.approx(3.0) and w["cores"] == pytest.approx(1.5)
    assert [(p["pid"], p["role"], round(p["cores"], 3)) for p in w["processes"]] == [(11, "child", 1.0),
                                                                                     (10, "server", 0.5)]
    assert window_cpu(samples[:1], names, 0, 1)["cores"] is None


def test_tree_cpu_reads_a_real_process_tree():
    code = "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.time() + 20
        while len(tree := tree_cpu(proc.pid)) < 2:
            assert time.time() < deadline, tree
            time.sleep(0.05)
        assert tree[proc.pid]["ppid"] == os.getpid() and all(v["cpu_s"] >= 0 for v in tree.values())
        (child,) = [p for p in tree if p != proc.pid]
        assert tree[child]["ppid"] == proc.pid and "time.sleep(30)" in tree[child]["cmdline"]
    finally:
        for pid in tree_cpu(proc.pid):
            if pid != proc.pid:
                os.kill(pid, 9)
        proc.kill()
        proc.wait()
    assert tree_cpu(proc.pid) == {}


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_compare_serve_tiny_end_to_end(tmp_path):
    """Real ``vmkv serve`` processes (one per backend) and the in-process engine, 4 requests at 40 req/s:
    both paths complete the same requests, the ratios and the CPU of client and server are reported, and
    every server stopped on SIGTERM with no process of its tree left."""
    out = tmp_path / "res"
    rc = main(["compare", "serve", "--random-weights", "tiny", "--device", "cpu", "--backends", "paged,vmem",
               "--num-requests", "4", "--input-len", "8..24", "--output-len", "3..6", "--request-rate", "40",
               "--warmup-requests", "1", "--max-num-seqs", "4", "--torch-threads", "1", "--slo", "ttft:5000,tpot:500",
               "--graceful-timeout", "5", "--out", str(out)])
    res = json.loads((out / "results.json").read_text())
    errors = [(r["path"], r["backend"], r.get("error") or r.get("stop_error")) for r in res["runs"]
              if "error" in r or "stop_error" in r]
    assert rc == 0, errors
    assert res["kind"] == "serve" and res["environment"]["git_commit"] and res["paths"] == ["inprocess", "served"]
    runs = {(r["path"], r["backend"]): r for r in res["runs"]}
    assert set(runs) == {(p, b) for p in ("inprocess", "served") for b in ("paged", "vmem")}
    expected = generate(WorkloadSpec(num_requests=4, input_len="8..24", output_len="3..6", request_rate=40.0), 512)
    for (path, backend), r in runs.items():
        s = r["serving"]
        assert s["completed"] == 4 and s["failed"] == 0 and r["output_len_mismatches"] == 0, (path, backend)
        assert s["total_input_tokens"] == sum(q.prompt_len for q in expected)
        assert s["total_output_tokens"] == sum(q.output_len for q in expected)
        assert r["workload_fingerprint"] == fingerprint(expected)
        assert s["goodput"] is not None and 0 < s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]
    for backend in ("paged", "vmem"):
        r = runs[("served", backend)]
        assert r["model"]["vocab_size"] == 512
        assert r["server"]["command"][:4] == ["vmkv", "serve", "--backend", backend]
        stop = r["server"]["stop"]
        assert stop["ok"] and stop["signal"] == "SIGTERM" and stop["exit_code"] == 0 and stop["orphans"] == []
        c = r["client"]
        assert c["num_processes"] == 1 and c["cpu_s"] > 0 and c["processes"][0]["num_requests"] == 4
        assert c["processes"][0]["send_lag_ms"]["n"] == 4 and c["processes"][0]["loop_lag_ms"]["n"] > 0
        cpu = r["server"]["cpu"]
        assert cpu["wall_s"] > 0 and cpu["cpu_s"] > 0 and cpu["processes"][0]["pid"] > 0
        assert any(p["role"] == "server" for p in cpu["processes"])
        raw = json.loads((out / r["raw_file"]).read_text())["raw"]["requests"]
        assert sorted(q["id"] for q in raw) == [f"req-{i}" for i in range(4)]
        assert all(q["output_len"] == q["target_output_len"] and q["success"] for q in raw)
        assert (out / r["server"]["log_file"]).exists()
        assert runs[("inprocess", backend)]["timing"]["cores"] > 0
    comps = {c["backend"]: c for c in res["comparisons"]}
    assert set(comps) == {"paged", "vmem"}
    for c in comps.values():
        assert c["identical_workload"] and c["scenario"] == "rate-40"
        assert set(c["ratios"]) == set(serve_report.TARGETS) and all(v is not None and v > 0 for v in c["ratios"].values())
    md = (out / "summary.md").read_text()
    assert md.count("| rate-40 |") >= 2 + 2 + 2 and "Served / in-process" in md and "client limit?" in md
    assert (out / "latency_cdf_rate-40.png").stat().st_size > 0
