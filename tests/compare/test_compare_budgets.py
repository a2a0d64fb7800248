"""`vmkv compare engine --memory-gib 2,8,32` / `--kv-memory 64KiB,1MiB` (issue 24 item 5, "where memory
matters"): every design at every KV budget in one invocation, each run's budget in results.json, a budget
column in the summary tables and the budget table (per budget and design: ratios to the reference design,
static / paged and the measured reason).  Functional only: no timing assertions."""

import json
from types import SimpleNamespace

import pytest

from vmkv.cli import main
from vmkv.compare import engine_bench, engine_report


@pytest.mark.slow
def test_two_budgets_two_designs_in_one_invocation(tmp_path):
    out = tmp_path / "res"
    # tiny: 512 B of KV a token; 64 KiB = 128 token slots: paged+max reserves 64 a request (max_model_len),
    # so it runs 2 at once where paged runs more; 1 MiB holds every request's reservation
    rc = main(["compare", "engine", "--backends", "paged,paged+max", "--model", "tiny", "--device", "cpu",
               "--num-requests", "6", "--input-len", "8..24", "--output-len", "3..6", "--max-model-len", "64",
               "--kv-memory", "64KiB,1MiB", "--warmup-requests", "1", "--torch-threads", "1",
               "--max-num-seqs", "8", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["budgets"] == [{"budget": "64KiB", "kv_budget_bytes": 64 << 10},
                              {"budget": "1MiB", "kv_budget_bytes": 1 << 20}]
    runs = [(r["budget"], r["backend"], r["scenario"]) for r in res["runs"]]
    assert runs == [("64KiB", "paged", "offline-64KiB"), ("64KiB", "paged+max", "offline-64KiB"),
                    ("1MiB", "paged", "offline-1MiB"), ("1MiB", "paged+max", "offline-1MiB")]
    for r in res["runs"]:
        assert r["kv_budget_bytes"] == r["config"]["knobs"]["memory_bytes"] == r["memory"]["capacity_bytes"]
        assert r["serving"]["completed"] == 6 and (out / r["raw_file"]).exists()
    assert res["sweep"] is None and res["sweeps"] == {"64KiB": None, "1MiB": None}   # offline only
    table = res["budget_table"]
    assert [(e["budget"], e["design"]) for e in table] == [(b, d) for b in ("64KiB", "1MiB")
                                                          for d in ("paged", "paged+max")]
    by = {(e["budget"], e["design"]): e for e in table}
    for budget, tokens in (("64KiB", 128), ("1MiB", 2048)):
        paged, static = by[(budget, "paged")], by[(budget, "paged+max")]
        assert paged["capacity_tokens"] == static["capacity_tokens"] == tokens
        assert static["reference"] == "paged+max" and static["offline_vs_reference"] == 1.0
        assert paged["offline_vs_reference"] == pytest.approx(
            paged["offline_output_throughput"] / static["offline_output_throughput"])
        assert paged["base"] is None and paged["static_ge_paged"] is None
        assert static["base"] == "paged" and static["metric"] == "offline out tok/s"
        assert static["vs_base"] == pytest.approx(static["offline_output_throughput"] / paged["offline_output_throughput"])
        assert static["static_ge_paged"] == (static["vs_base"] >= 1) and static["why"]
        assert static["preemptions"] == 0 and static["demand_tokens"] == 6 * 64     # every request reserves 64
    assert by[("64KiB", "paged+max")]["max_concurrent_seqs"] == 2                     # 128 slots / 64
    assert by[("64KiB", "paged+max")]["demand_vs_capacity"] == 3.0
    assert by[("1MiB", "paged+max")]["demand_vs_capacity"] < 1 and by[("1MiB", "paged+max")]["max_waiting"] == 0
    md = (out / "summary.md").read_text()
    assert md.index("Budget table") < md.index("## Serving")
    assert "| budget | design | KV tokens |" in md and "| 64KiB | paged+max (ref) | 128 |" in md
    assert "| offline-1MiB | paged | 1MiB | inf |" in md          # the serving table's budget column
    for png in ("kv_breakdown_offline-64KiB", "kv_breakdown_offline-1MiB", "batch_size_offline-1MiB"):
        assert (out / f"{png}.png").stat().st_size > 0, png


def _fake_worker(calls):
    def fake(cfg, out_dir, prog, task, timeout_s, threads):
        calls.append(cfg)
        return {"backend": cfg["backend"], "scenario": cfg["scenario"], "config": cfg,
                "serving": {"request_throughput": 10.0}}
    return fake


def test_budgets_are_the_outer_loop_and_relative_rates_scale_each_budgets_offline_run(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(engine_bench, "_run_worker", _fake_worker(calls))
    monkeypatch.setattr(engine_report, "render", lambda *a, **k: None)
    monkeypatch.setattr(engine_report, "sweep", lambda *a, **k: None)
    monkeypatch.setattr(engine_report, "budget_table", lambda *a, **k: [])
    rc = main(["compare", "engine", "--model", "tiny", "--memory-gib", "2, 0.5", "--request-rate", "inf,0.5x",
               "--out", str(tmp_path)])
    assert rc == 0
    assert [(c["scenario"], c["backend"], c["knobs"]["memory_bytes"]) for c in calls] == [
        ("offline-2GiB", "paged", 2 << 30), ("offline-2GiB", "vmem", 2 << 30),
        ("rate-5-2GiB", "paged", 2 << 30), ("rate-5-2GiB", "vmem", 2 << 30),
        ("offline-512MiB", "paged", 1 << 29), ("offline-512MiB", "vmem", 1 << 29),
        ("rate-5-512MiB", "paged", 1 << 29), ("rate-5-512MiB", "vmem", 1 << 29)]
    res = json.loads((tmp_path / "results.json").read_text())
    assert {r["budget"] for r in res["runs"]} == {"2GiB", "512MiB"}
    # one budget: the scenario names and results["sweep"] as before budgets were swept
    calls.clear()
    assert main(["compare", "engine", "--model", "tiny", "--memory-gib", "1.5", "--out", str(tmp_path / "b")]) == 0
    assert [(c["scenario"], c["knobs"]["memory_bytes"]) for c in calls] == [("offline", 3 << 29)] * 2
    assert "sweep" in json.loads((tmp_path / "b" / "results.json").read_text())


def test_parse_budgets_and_labels():
    ns = lambda gib=None, size=None: SimpleNamespace(memory_gib=gib, kv_memory=size)   # noqa: E731
    assert engine_bench.parse_budgets(ns()) == [None]
    assert engine_bench.parse_budgets(ns("2,8,32")) == [2 << 30, 8 << 30, 32 << 30]
    assert engine_bench.parse_budgets(ns(1.9)) == [int(1.9 * (1 << 30))]
    assert engine_bench.parse_budgets(ns(size="64KiB, 1MiB")) == [64 << 10, 1 << 20]
    for bad, why in ((ns("2,x"), "not a number"), (ns("0"), "> 0"), (ns("2,2"), "twice"),
                     (ns(size="lots"), "not a size"), (ns(","), "at least one")):
        with pytest.raises(ValueError, match=why):
            engine_bench.parse_budgets(bad)
    assert [engine_report.budget_label(n) for n in (2 << 30, 3 << 29, 1 << 29, 4096, 1000, None,
                                                    int(1.9 * (1 << 30)))] == [
        "2GiB", "1.5GiB", "512MiB", "4KiB", "1000B", "auto", "1.9GiB"]
    assert engine_bench.scenario_name(4.0, "2GiB") == "rate-4-2GiB" and engine_bench.scenario_name(4.0) == "rate-4"


def test_a_bad_budget_list_is_an_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(engine_bench, "_run_worker", lambda *a, **k: pytest.fail("ran a worker"))
    assert main(["compare", "engine", "--model", "tiny", "--memory-gib", "2,abc", "--out", str(tmp_path)]) == 2
    assert "not a number of GiB" in capsys.readouterr().out


def _run(design, budget, tp, seqs, preempt=0, waiting=0):
    reqs = [{"prompt_len": 10, "output_len": 20}] * 4
    return {"backend": design, "scenario": f"offline-{budget}", "budget": budget, "kv_budget_bytes": 1,
            "config": {"workload": {"request_rate": "inf"}}, "max_model_len": 64, "kv_bytes_per_token": 1,
            "serving": {"output_throughput": tp, "request_throughput": tp / 10},
            "memory": {"capacity_bytes": 1000 if budget == "big" else 100, "max_concurrent_seqs": seqs,
                       "preemptions": preempt, "reserved_unused_pct_mean": 0.0 if "+" not in design else 60.0},
            "raw": {"requests": reqs, "steps": {"num_waiting": [waiting, 0]}}}


def test_budget_table_flags_static_at_or_above_paged_with_the_reason():
    runs = [_run("paged", "small", 100.0, 4, preempt=3), _run("paged+max", "small", 50.0, 1, waiting=3),
            _run("paged+oracle", "small", 101.0, 3),
            _run("paged", "big", 100.0, 4), _run("paged+max", "big", 110.0, 4)]
    t = {(e["budget"], e["design"]): e for e in engine_report.budget_table(runs)}
    small_max, small_oracle, big_max = t[("small", "paged+max")], t[("small", "paged+oracle")], t[("big", "paged+max")]
    assert small_max["static_ge_paged"] is False and small_max["vs_base"] == 0.5
    assert "held it to 1 sequences at once vs paged's 4" in small_max["why"] and "3 requests waiting" in small_max["why"]
    assert "is 2.6x the 100-token budget" in small_max["why"]     # 4 x 64 reserved tokens
    assert small_oracle["static_ge_paged"] and small_oracle["within_noise"]
    assert "paged preempted 3 times" in small_oracle["why"]
    assert big_max["static_ge_paged"] and "the budget holds the reservations" in big_max["why"]
    assert "fits the 1,000-token budget" in big_max["why"] and big_max["offline_vs_reference"] == 1.0
    assert t[("big", "paged")]["offline_vs_reference"] == pytest.approx(100 / 110)
    cols, rows = engine_report.budget_rows(list(t.values()))
    assert "sustained req/s" not in cols and cols[-2:] == ["static >= paged", "why"]    # offline only
    assert [r[cols.index("static >= paged")] for r in rows] == ["-", "no", "yes (noise)", "-", "yes"]
