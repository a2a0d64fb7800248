"""`vmkv compare engine` end to end on the `tiny` random-weight shape, both backends, CPU."""

import json
import math
import sys

import pytest

from vmkv.cli import main
from vmkv.compare import engine_bench
from vmkv.compare.workloads import WorkloadSpec, generate
from vmkv.vmem.options import VMemOptions


@pytest.mark.slow
def test_compare_engine_tiny_both_backends(tmp_path):
    out = tmp_path / "res"
    rc = main(["compare", "engine", "--backends", "paged,vmem", "--model", "tiny", "--device", "cpu",
               "--num-requests", "4", "--input-len", "8..40", "--output-len", "3..6", "--warmup-requests", "1",
               # a 64-token budget: the warm-up fills one step with 2 prompts of 40, so the run's 4
               # concurrent sequences still map slots the warm-up did not (the vmm counters below)
               "--max-num-batched-tokens", "64", "--warmup-fill-budget",
               "--torch-threads", "1", "--max-num-seqs", "4", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    runs = {r["backend"]: r for r in res["runs"]}
    assert set(runs) == {"paged", "vmem"}
    expected = generate(WorkloadSpec(num_requests=4, input_len="8..40", output_len="3..6"), 512)
    assert res["max_model_len"] == 256  # longest prompt + output, rounded up to 256
    assert len({r["workload_fingerprint"] for r in runs.values()}) == 1
    bpt = 2 * 2 * 2 * 16 * 4  # tiny: 2 layers x 2 KV heads x 16 dims x fp32, K and V
    for backend, r in runs.items():
        assert r["model"]["kind"] == "random-weights" and r["model"]["name"] == "random-tiny"
        s = r["serving"]
        assert s["completed"] == 4 and s["failed"] == 0 and r["output_len_mismatches"] == 0
        assert s["total_output_tokens"] == sum(q.output_len for q in expected)
        assert s["total_input_tokens"] == sum(q.prompt_len for q in expected)
        assert 0 < s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]
        m = r["memory"]
        assert r["kv_bytes_per_token"] == bpt
        assert m["peak_used_tokens"] > 0 and m["peak_allocated_bytes"] >= m["peak_used_tokens"] * bpt
        assert m["peak_mapped_bytes"] >= m["peak_allocated_bytes"] and 0 <= m["waste_pct_mean"] < 100
        assert 1 <= m["max_concurrent_seqs"] <= 4 and m["preemptions"] == 0
        assert r["allocation"]["step_time_s"] > r["allocation"]["alloc_time_s"] >= 0
        raw = json.loads((out / r["raw_file"]).read_text())["raw"]
        assert len(raw["requests"]) == 4 and len(raw["steps"]["t_s"]) == r["timing"]["num_steps"]
        # CPU: no graphs; async scheduling is on by default, so decode steps were launched ahead
        assert r["timing"]["cuda_graph_steps"] == 0 and r["timing"]["ahead_steps"] > 0
        # physical KV memory held over time, every step kept: created >= mapped, in use + idle = created
        steps = raw["steps"]
        assert all(len(steps[c]) == len(steps["t_s"]) for c in
                   ("created_bytes", "mapped_bytes", "in_use_bytes", "idle_bytes", "device_used_bytes"))
        assert steps["t_s"] == sorted(steps["t_s"]) and steps["t_s"][0] >= 0
        for c, mp, iu, idle, al, dev in zip(steps["created_bytes"], steps["mapped_bytes"], steps["in_use_bytes"],
                                            steps["idle_bytes"], steps["allocated_bytes"], steps["device_used_bytes"]):
            assert m["capacity_bytes"] >= c >= mp and iu == al and idle == c - iu >= 0 and dev > 0  # CPU: RSS
        assert max(steps["in_use_bytes"]) == m["peak_allocated_bytes"] > 0
        assert m["peak_created_bytes"] == max(steps["created_bytes"]) >= m["final_created_bytes"] > 0
        assert m["final_created_bytes"] == steps["created_bytes"][-1] and m["final_in_use_bytes"] == 0
        assert m["device_used_bytes_peak"] > 0 and m["device_memory_kind"] == "process RSS"
        if backend == "paged":     # a static pool exists whole from the start
            assert set(steps["created_bytes"]) == {m["capacity_bytes"]}
    vmm = runs["vmem"]["allocation"]["vmm"]
    assert vmm["num_maps_run"] > 0 and vmm["map_us"]["n"] == vmm["num_maps_run"]
    assert runs["paged"]["allocation"]["vmm"] is None
    # KVCache.backend_stats() of every backend, with the measured run's share of each counter
    paged_stats = runs["paged"]["allocation"]["backend_stats"]
    assert paged_stats["num_blocks"] > 0 and paged_stats["block_size"] == 16
    assert paged_stats["num_cow_copies_run"] == 0
    vmem_stats = runs["vmem"]["allocation"]["backend_stats"]
    assert vmem_stats["num_maps_run"] == vmm["num_maps_run"] and vmem_stats["layout"] == "megacache"
    assert (out / "summary.md").read_text().count("| offline |") >= 3
    assert (out / "latency_cdf_offline.png").stat().st_size > 0 and (out / "kv_memory_offline.png").stat().st_size > 0
    assert "created peak/final" in (out / "summary.md").read_text()


@pytest.mark.slow
def test_compare_engine_online_samples_memory_while_idle(tmp_path):
    """Between arrivals no step runs: the worker keeps sampling the KV memory held (``idle_memory``),
    so the timeline shows what a backend gives back between bursts."""
    out = tmp_path / "res"
    rc = main(["compare", "engine", "--backends", "vmem", "--model", "tiny", "--device", "cpu",
               "--num-requests", "3", "--input-len", "8..16", "--output-len", "2", "--request-rate", "4",
               "--warmup-requests", "0", "--torch-threads", "1", "--max-num-seqs", "4", "--out", str(out)])
    assert rc == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    raw = json.loads((out / run["raw_file"]).read_text())["raw"]
    idle = raw["idle_memory"]
    assert len(idle["t_s"]) >= 1 and all(len(v) == len(idle["t_s"]) for v in idle.values())
    assert all(c >= m and i == c - u for c, m, u, i in zip(idle["created_bytes"], idle["mapped_bytes"],
                                                            idle["in_use_bytes"], idle["idle_bytes"]))
    assert run["memory"]["peak_created_bytes"] >= max(idle["created_bytes"])
    assert (out / "kv_memory_rate-4.png").stat().st_size > 0


def _fake_worker(calls):
    def fake(cfg, out_dir, prog, task, timeout_s, threads):
        calls.append(cfg)
        rate = cfg["workload"]["request_rate"]
        return {"backend": cfg["backend"], "scenario": cfg["scenario"],
                "serving": {"request_throughput": 10.0 if cfg["backend"] == "paged" else 12.0},
                "config": cfg, "rate": rate}
    return fake


def test_relative_rates_use_first_backend_offline_throughput(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(engine_bench, "_run_worker", _fake_worker(calls))
    monkeypatch.setattr("vmkv.compare.engine_report.render", lambda *a, **k: None)
    argv = ["compare", "engine", "--model", "tiny", "--request-rate", "0.5x,2,inf", "--num-requests", "3",
            "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["/venv/bin/vmkv", *argv])   # what the console script sees
    rc = main(argv)
    assert rc == 0
    order = [(c["scenario"], c["backend"]) for c in calls]
    assert order == [("offline", "paged"), ("offline", "vmem"), ("rate-2", "paged"), ("rate-2", "vmem"),
                     ("rate-5", "paged"), ("rate-5", "vmem")]
    assert calls[-1]["workload"]["request_rate"] == 5.0 and calls[-1]["rate_spec"] == "0.5x"
    assert all(c["knobs"]["random_weights"] == "tiny" and c["model"] is None for c in calls)
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["environment"]["command"] == " ".join(["vmkv", *argv])


def test_relative_rate_without_offline_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setattr(engine_bench, "_run_worker", _fake_worker([]))
    assert main(["compare", "engine", "--model", "tiny", "--request-rate", "0.5x", "--out", str(tmp_path)]) == 2
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"runs": [{"scenario": "offline", "backend": "paged",
                                          "serving": {"request_throughput": 4.0}}]}))
    calls = []
    monkeypatch.setattr(engine_bench, "_run_worker", _fake_worker(calls))
    monkeypatch.setattr("vmkv.compare.engine_report.render", lambda *a, **k: None)
    assert main(["compare", "engine", "--model", "tiny", "--request-rate", "0.25x", "--reference", str(ref),
                 "--out", str(tmp_path / "b")]) == 0
    assert {c["workload"]["request_rate"] for c in calls} == {1.0}


def test_parse_rates():
    assert engine_bench.parse_rates("inf, 2,0.5X") == ["inf", "2", "0.5x"]
    for bad in ("", "fast", "0", "-1x"):
        with pytest.raises(ValueError):
            engine_bench.parse_rates(bad)


# ------------------------------------------------------------------ backend options per backend
def _calls_for(monkeypatch, tmp_path, flags):
    calls = []
    monkeypatch.setattr(engine_bench, "_run_worker", _fake_worker(calls))
    monkeypatch.setattr("vmkv.compare.engine_report.render", lambda *a, **k: None)
    rc = main(["compare", "engine", "--model", "tiny", "--num-requests", "2", "--out", str(tmp_path), *flags])
    return rc, {c["backend"]: c["knobs"] for c in calls}


def test_attention_impl_reaches_the_vmem_run_only(monkeypatch, tmp_path):
    rc, knobs = _calls_for(monkeypatch, tmp_path, ["--attention-impl", "sdpa", "--layout", "per_layer",
                                                   "--block-size", "32", "--no-prefix-caching"])
    assert rc == 0 and set(knobs) == {"paged", "vmem"}
    assert knobs["vmem"]["attention_impl"] == "sdpa" and knobs["vmem"]["layout"] == "per_layer"
    assert knobs["paged"]["block_size"] == 32
    # each run gets the options its backend has, no other
    assert not {"attention_impl", "layout", "driver", "page_size_bytes"} & set(knobs["paged"])
    assert "block_size" not in knobs["vmem"]
    assert knobs["paged"]["enable_prefix_caching"] is knobs["vmem"]["enable_prefix_caching"] is False
    # the worker's config is valid as it is: the typed options carry sdpa to the vmem cache
    from vmkv.engine.config import EngineConfig
    from vmkv.vmem.options import VMemOptions

    for backend, kw in knobs.items():
        opts = EngineConfig.from_args(kv_backend=backend, **kw).cache.backend_options()
        assert (opts.attention_impl == "sdpa") if backend == "vmem" else not isinstance(opts, VMemOptions)


def test_defaults_are_the_options_classes(monkeypatch, tmp_path):
    from vmkv.paged.options import PagedOptions
    from vmkv.vmem.options import VMemOptions

    rc, knobs = _calls_for(monkeypatch, tmp_path, [])
    assert rc == 0
    v, pg = VMemOptions(), PagedOptions()
    assert {k: knobs["vmem"][k] for k in ("layout", "driver", "attention_impl", "page_size_bytes",
                                          "enable_prefix_caching")} == \
        {"layout": v.layout, "driver": v.driver, "attention_impl": v.attention_impl,
         "page_size_bytes": v.page_size_bytes, "enable_prefix_caching": v.enable_prefix_caching}
    assert (knobs["paged"]["block_size"], knobs["paged"]["enable_prefix_caching"]) == \
        (pg.block_size, pg.enable_prefix_caching)
    # every vmem option reaches the vmem run, every paged option the paged run
    assert {k: knobs["vmem"][k] for k in v.field_names()} == v.as_kwargs()
    assert {k: knobs["paged"][k] for k in pg.field_names()} == pg.as_kwargs()


def test_lookahead_and_preallocate_reach_the_vmem_run_only(monkeypatch, tmp_path):
    from vmkv.engine.config import EngineConfig
    from vmkv.vmem.options import VMemOptions

    rc, knobs = _calls_for(monkeypatch, tmp_path, ["--lookahead-tokens", "32", "--preallocate"])
    assert rc == 0
    assert (knobs["vmem"]["lookahead_tokens"], knobs["vmem"]["preallocate"]) == (32, True)
    assert not {"lookahead_tokens", "preallocate"} & set(knobs["paged"])
    opts = EngineConfig.from_args(kv_backend="vmem", **knobs["vmem"]).cache.backend_options()
    assert (opts.lookahead_tokens, opts.preallocate) == (32, True) and isinstance(opts, VMemOptions)


def test_page_size_reaches_the_vmem_run_only(monkeypatch, tmp_path, capsys):
    """``--page-size 32MiB`` (this harness's name for ``page_size_bytes``; serve's size parser) reaches the vmem
    worker's cache options; the paged run gets no such knob, and a paged-only comparison refuses it by the
    harness's flag name, as ``--kv-reserve``."""
    from vmkv.engine.config import EngineConfig

    rc, knobs = _calls_for(monkeypatch, tmp_path, ["--page-size", "32MiB"])
    assert rc == 0 and knobs["vmem"]["page_size_bytes"] == 32 << 20 and "page_size_bytes" not in knobs["paged"]
    assert EngineConfig.from_args(kv_backend="vmem", **knobs["vmem"]).cache.backend_options().page_size_bytes == \
        32 << 20
    rc, knobs = _calls_for(monkeypatch, tmp_path / "b", ["--backends", "paged", "--page-size", "32MiB"])
    assert rc == 2 and knobs == {}
    assert "--page-size is an option of the vmem backend" in capsys.readouterr().out


def test_a_vmem_option_without_a_vmem_run_is_an_error(monkeypatch, tmp_path, capsys):
    rc, knobs = _calls_for(monkeypatch, tmp_path, ["--backends", "paged", "--attention-impl", "sdpa"])
    assert rc == 2 and knobs == {}
    err = capsys.readouterr().out
    assert "--attention-impl is an option of the vmem backend" in err and "add vmem to --backends" in err
    # the default value asks for nothing, so a paged-only comparison takes it
    rc, knobs = _calls_for(monkeypatch, tmp_path / "b", ["--backends", "paged", "--attention-impl", "auto"])
    assert rc == 0 and set(knobs) == {"paged"}


def test_lookahead_without_a_vmem_run_is_an_error(monkeypatch, tmp_path, capsys):
    rc, knobs = _calls_for(monkeypatch, tmp_path, ["--backends", "paged", "--lookahead-tokens", "8"])
    assert rc == 2 and knobs == {}
    assert "--lookahead-tokens is an option of the vmem backend" in capsys.readouterr().out


def test_an_unknown_backend_is_an_error(monkeypatch, tmp_path, capsys):
    rc, knobs = _calls_for(monkeypatch, tmp_path, ["--backends", "paged,blocks"])
    assert rc == 2 and knobs == {}
    assert "unknown KV backend 'blocks'" in capsys.readouterr().out


# ------------------------------------------------------------------ the worker reads the cache through the interface
def test_worker_reads_backend_stats_and_samples_through_the_interface():
    """The worker takes counters from ``KVCache.backend_stats()`` and raw samples from
    ``backend_samples()``: no ``getattr``/``hasattr`` on the cache, and the run's samples are the
    last ``num_maps_run`` of them."""
    import ast
    import inspect

    import torch

    from vmkv.compare import engine_worker as w
    from vmkv.kvcache import KVCacheSpec, create_kv_cache

    for node in ast.walk(ast.parse(inspect.getsource(w))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "hasattr"):
            assert "kv_cache" not in ast.unparse(node.args[0]), ast.unparse(node)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    limits = dict(max_num_seqs=2, max_model_len=256, memory_bytes=1 << 20)
    with create_kv_cache("vmem", spec, **limits, driver="host") as cache:
        cache.allocate(1, 10)                     # warm-up
        stats0, _ = w._backend_snapshot(cache)
        cache.allocate(2, 200)
        stats1, samples1 = w._backend_snapshot(cache)
        vmm, raw = w._vmm_delta(stats0, stats1, samples1)
    new = stats1["num_maps"] - stats0["num_maps"]
    assert new > 0 and vmm["num_maps_run"] == new == vmm["map_us"]["n"]
    assert raw["map_us"] == [round(x, 3) for x in samples1["map_us"][-new:]] and raw["unmap_us"] == []
    assert "map_us" not in stats1                 # counters and samples stay apart
    with create_kv_cache("paged", spec, **limits) as cache:
        stats, samples = w._backend_snapshot(cache)
        assert samples == {} and w._vmm_delta(stats, stats, samples) == (None, {})
        assert w._counter_deltas(stats, stats)["num_blocks_run"] == 0


def test_an_infinite_grace_period_reaches_the_worker(tmp_path):
    """``--kv-shrink-grace-s inf`` (never shrink) travels to the worker process as inf: the worker's
    configuration file keeps non-finite floats (strict JSON turned it into null, which the option refused)."""
    out = tmp_path / "res"
    rc = main(["compare", "engine", "--backends", "vmem", "--model", "tiny", "--device", "cpu",
               "--num-requests", "2", "--input-len", "8..16", "--output-len", "2", "--warmup-requests", "0",
               "--torch-threads", "1", "--kv-shrink-grace-s", "inf", "--out", str(out)])
    assert rc == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert "error" not in run and run["serving"]["completed"] == 2
    cfg = json.loads((out / "raw" / "offline-vmem.config.json").read_text())
    assert cfg["knobs"]["kv_shrink_grace_s"] == float("inf")


@pytest.mark.slow
def test_online_sweep_two_rates_two_designs(tmp_path):
    """The sweep in one invocation (issue 24): per design and rate the normalized latency, TTFT/TPOT,
    goodput and SLO attainment, the sustained rate and its ratio to the reference design (the +max one by
    default); the plots; and the memory breakdown per step, each part >= 0 and all adding up to created."""
    out = tmp_path / "res"
    rc = main(["compare", "engine", "--backends", "paged,vmem+max", "--model", "tiny", "--device", "cpu",
               "--num-requests", "10", "--input-len", "8..40", "--output-len", "3..8", "--warmup-requests", "1",
               "--request-rate", "4,16", "--slo", "ttft:60000,tpot:60000", "--torch-threads", "1",
               "--max-num-seqs", "4", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    sw = res["sweep"]
    assert sw["reference_design"] == "vmem+max" and sw["warmup_fraction"] == 0.1
    assert sw["rule"]["slo_attainment_min"] == 0.9 and "sustained" in sw["rule"]["text"]
    assert list(sw["designs"]) == ["paged", "vmem+max"]
    for name, d in sw["designs"].items():
        assert [p["rate"] for p in d["points"]] == [4.0, 16.0]
        for p in d["points"]:
            assert p["requests_measured"] == 9 and p["requests_dropped"] == 1   # the first 10% by arrival
            assert p["normalized_latency_s"] > 0 and p["ttft_ms"]["p99"] >= p["ttft_ms"]["p50"] > 0
            assert p["tpot_ms"]["p99"] >= p["tpot_ms"]["p50"] > 0 and p["goodput"] > 0
            assert p["slo_attainment"] == 1.0 and p["batch_mean"] > 0 and p["batch_max"] >= 1
        # a generous SLO: both rates are sustained unless the latency bound trips on CPU noise
        assert d["sustained_rate"] in (None, 4.0, 16.0) and len(d["passes"]) == 2
    ref = sw["designs"]["vmem+max"]
    if ref["sustained_rate"]:
        assert ref["sustained_vs_reference"] == 1.0
    for png in ("normalized_latency_vs_rate", "batch_size_rate-4", "batch_size_rate-16", "kv_breakdown_rate-4",
                "kv_breakdown_rate-16"):
        assert (out / f"{png}.png").stat().st_size > 0, png
    md = (out / "summary.md").read_text()
    assert md.index("Sustained request rate") < md.index("Online sweep") < md.index("Serving")
    assert "KV memory breakdown" in md
    for r in res["runs"]:
        b = r["memory"]["breakdown"]
        assert b["created_bytes_mean"] > 0
        assert sum(b[f"{k}_pct"] for k in ("token", "reserved_unused", "tail", "idle")) == pytest.approx(100)
        steps = json.loads((out / r["raw_file"]).read_text())["raw"]["steps"]
        parts = ("token_bytes", "reserved_unused_bytes", "waste_bytes", "idle_bytes")
        for row in zip(*(steps[k] for k in parts + ("created_bytes", "allocated_bytes", "num_running_seqs"))):
            *p, created, allocated, running = row
            assert all(x >= 0 for x in p) and sum(p) <= created and sum(p[:3]) == allocated and running >= 0
        if r["backend"] == "vmem+max":   # a reservation holds unwritten positions while requests run
            assert b["reserved_unused_bytes_peak"] > 0 and b["in_use_reserved_unused_pct"] > 0


def test_reference_design_defaults_and_errors(monkeypatch, tmp_path, capsys):
    from vmkv.compare.engine_report import reference_design

    assert reference_design(["paged", "vmem", "paged+max"]) == "paged+max"
    assert reference_design(["paged", "vmem"]) == "paged"
    assert reference_design(["paged", "vmem"], "vmem") == "vmem"
    with pytest.raises(ValueError, match="not among"):
        reference_design(["paged"], "vmem+max")
    monkeypatch.setattr(engine_bench, "_run_worker", lambda *a, **k: pytest.fail("ran a worker"))
    rc = main(["compare", "engine", "--backends", "paged", "--reference-design", "vmem", "--out", str(tmp_path)])
    assert rc == 2 and "not among" in capsys.readouterr().out


def _fake_run(design, rate, e2e_s, out=4, n=10):
    """A finished run of ``design`` at ``rate``: ``n`` requests a second apart, each ``e2e_s`` long."""
    reqs = [{"id": f"q{i}", "prompt_len": 8, "output_len": out, "num_output_tokens": out, "arrival_s": float(i),
             "first_token_s": i + 0.1 * e2e_s, "finish_s": i + e2e_s,
             "token_times_s": [i + 0.1 * e2e_s + 0.9 * e2e_s * k / (out - 1) for k in range(out)],
             "success": True, "error": ""} for i in range(n)]
    return {"backend": design, "scenario": f"rate-{rate:g}", "config": {"workload": {"request_rate": rate}},
            "serving": {"goodput": rate, "request_throughput": rate, "output_throughput": rate * out},
            "raw": {"requests": reqs, "steps": {"t_s": [0.0, 1.0], "num_running_seqs": [2, 4]}}}


def test_sweep_from_runs_sustained_rates_ratio_and_a_failed_rate():
    from vmkv.compare.engine_report import sustained_rows, sweep, sweep_rows

    runs = [_fake_run("paged", 2, 0.4), _fake_run("paged+max", 2, 0.4),
            _fake_run("paged", 4, 0.5), _fake_run("paged+max", 4, 4.0),      # 10x the lowest: unbounded
            _fake_run("paged", 8, 0.6),
            {"backend": "paged+max", "scenario": "rate-8", "error": "timed out after 5 s", "request_rate": 8.0}]
    sw = sweep(runs, "ttft:1000")
    assert sw["reference_design"] == "paged+max"
    p, m = sw["designs"]["paged"], sw["designs"]["paged+max"]
    assert p["sustained_rate"] == 8 and m["sustained_rate"] == 2 and p["sustained_vs_reference"] == 4.0
    assert [x["passed"] for x in m["passes"]] == [True, False, False]
    assert "timed out" in m["passes"][2]["why"] and "normalized latency" in m["passes"][1]["why"]
    pt = p["points"][0]
    assert pt["normalized_latency_s"] == pytest.approx(0.1) and pt["requests_dropped"] == 1
    assert pt["slo_attainment"] == 1.0 and pt["batch_mean"] == 3.0 and pt["goodput_per_offered"] == 1.0
    assert m["points"][1]["slo_attainment"] == 1.0 - 0.0     # ttft 400 ms: within the SLO, the bound fails it
    rows = sweep_rows(sw)
    assert len(rows) == 6 and rows[-1][2] == "failed" and rows[-1][-1] == "no"
    assert [r[:3] for r in sustained_rows(sw)] == [["paged", ">= 8.00", ">= 4.00x"], ["paged+max (reference)", "2.00", "1.00x"]]
    assert p["sustained_is_lower_bound"] and not m["sustained_is_lower_bound"]
    assert sweep([_fake_run("paged", 2, 0.4)], None)["rule"]["slo_attainment_min"] is None
    assert sweep([{**_fake_run("paged", 2, 0.4), "config": {"workload": {"request_rate": "inf"}}}], None) is None


def test_a_design_variant_runs_a_backend_again_with_one_option_changed(monkeypatch, tmp_path):
    """``--backends vmem,vmem@kv_shrink_grace_s=inf`` runs vmem twice in one invocation, the second with
    shrinking off (issue 24: the elastic shrink's cost online, as a ratio within one run); the value is
    converted by its option's type and checked by the options class; an option the backend lacks, or a
    malformed variant, fails before anything runs."""
    rc, knobs = _calls_for(monkeypatch, tmp_path, ["--backends", "paged,vmem,vmem@kv_shrink_grace_s=inf,"
                                                   "vmem@kv-reserve-bytes=1MiB,vmem@layout=per_layer"])
    assert rc == 0 and list(knobs) == ["paged", "vmem", "vmem@kv_shrink_grace_s=inf", "vmem@kv_reserve_bytes=1MiB",
                                       "vmem@layout=per_layer"]
    assert knobs["vmem@layout=per_layer"]["layout"] == "per_layer"
    assert knobs["vmem@kv_shrink_grace_s=inf"]["kv_shrink_grace_s"] == math.inf
    assert knobs["vmem"]["kv_shrink_grace_s"] == VMemOptions().kv_shrink_grace_s
    assert knobs["vmem@kv_reserve_bytes=1MiB"]["kv_reserve_bytes"] == 1 << 20
    from vmkv.engine.config import EngineConfig

    cfg = EngineConfig.from_args(kv_backend="vmem", **knobs["vmem@kv_shrink_grace_s=inf"])
    assert cfg.cache.backend_options().kv_shrink_grace_s == math.inf
    for bad, why in (("paged@kv_shrink_grace_s=inf", "not an option of the paged backend"),
                     ("vmem@kv_shrink_grace_s", "is not name=value"),
                     ("vmem@kv_reserve_bytes=-1", "kv_reserve_bytes: not a size"),
                     ("vmem@kv_shrink_grace_s=abc", "kv_shrink_grace_s: could not convert"),
                     ("vmem@layout=bogus", "layout must be one of"),
                     ("vmem,vmem", "listed twice")):
        with pytest.raises(ValueError, match=why):
            engine_bench.designs(bad)
    # on the command line: one error line, nothing run
    rc, knobs = _calls_for(monkeypatch, tmp_path / "bad", ["--backends", "vmem@foo=1"])
    assert rc == 2 and not knobs
