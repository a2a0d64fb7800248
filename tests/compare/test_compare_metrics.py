"""Metric arithmetic of vmkv.compare.metrics (BENCHMARKS.md definitions), checked on hand-made records."""

import math

import pytest

from vmkv.compare.metrics import (
    SLO,
    RequestRecord,
    compute_serving_metrics,
    inter_token_latencies,
    percentile,
    summarize,
    tpot,
)


def _rec(i, arrival, times, prompt_len=10, **kw):
    return RequestRecord(f"r{i}", prompt_len, len(times), arrival, times[0], times[-1], list(times), **kw)


def test_tpot_definition():
    # e2e 1.0 s, ttft 0.1 s, 10 tokens -> 9 decode gaps -> 0.1 s each
    assert tpot(1.0, 0.1, 10) == pytest.approx(0.1)
    assert tpot(0.5, 0.5, 1) is None
    with pytest.raises(ValueError, match="exceeds"):
        tpot(0.1, 0.2, 5)


def test_itl_gaps_and_order():
    assert inter_token_latencies([1.0, 1.5, 1.75]) == [0.5, 0.25]
    assert inter_token_latencies([3.0]) == []
    with pytest.raises(ValueError, match="ascending"):
        inter_token_latencies([2.0, 1.0])


def test_percentile_linear_interpolation():
    vals = [1, 2, 3, 4]
    assert percentile(vals, 50) == 2.5
    assert percentile(vals, 0) == 1 and percentile(vals, 100) == 4
    assert percentile(list(range(101)), 99) == 99.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile(vals, 101)


def test_summarize_scales_and_ignores_none():
    s = summarize([0.001, 0.002, None, 0.003], scale=1e3)
    assert s["n"] == 3
    assert s["mean"] == pytest.approx(2.0) and s["p50"] == pytest.approx(2.0)
    assert s["min"] == pytest.approx(1.0) and s["max"] == pytest.approx(3.0)
    assert s["p90"] == pytest.approx(2.8) and s["p99"] == pytest.approx(2.98)
    assert summarize([])["n"] == 0 and math.isnan(summarize([])["p99"])


def test_record_derived_latencies():
    r = _rec(0, 10.0, [10.5, 10.7, 10.9, 11.5])
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e_latency == pytest.approx(1.5)
    assert r.tpot == pytest.approx((1.5 - 0.5) / 3)
    assert r.itls == pytest.approx([0.2, 0.2, 0.6])
    failed = RequestRecord("x", 5, 0, 0.0, None, None, success=False, error="boom")
    assert failed.ttft is None and failed.tpot is None and failed.itls == []


def test_serving_metrics_exact():
    recs = [
        _rec(0, 0.0, [0.1, 0.2, 0.3], prompt_len=100),          # ttft .1 e2e .3 tpot .1
        _rec(1, 1.0, [1.3, 1.5, 1.7, 1.9], prompt_len=50),      # ttft .3 e2e .9 tpot .2
        RequestRecord("f", 7, 0, 0.0, None, None, success=False),
    ]
    m = compute_serving_metrics(recs, duration_s=2.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 150 and m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(78.5)
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert m["e2e_ms"]["p50"] == pytest.approx(600.0)
    assert m["itl_ms"]["n"] == 5 and m["itl_ms"]["mean"] == pytest.approx(160.0)
    assert m["goodput"] is None


def test_num_output_tokens_counts_all_samples():
    r = _rec(0, 0.0, [0.1, 0.2], num_output_tokens=8)  # n=4 samples of 2 tokens
    m = compute_serving_metrics([r], duration_s=1.0)
    assert m["total_output_tokens"] == 8 and m["tpot_ms"]["mean"] == pytest.approx(100.0)


def test_goodput_counts_requests_meeting_every_slo():
    recs = [_rec(0, 0.0, [0.1, 0.2, 0.3]), _rec(1, 0.0, [0.3, 0.5, 0.7]), _rec(2, 0.0, [0.05])]
    slo = SLO.parse("ttft:200,tpot:150")
    # r0 meets both; r1 ttft 300 ms fails; r2 has no TPOT and meets ttft
    assert compute_serving_metrics(recs, 2.0, slo)["goodput"] == pytest.approx(1.0)
    assert compute_serving_metrics(recs, 1.0, SLO(e2e_ms=500))["goodput"] == pytest.approx(2.0)


def test_slo_parse_errors():
    assert SLO.parse(None) == SLO()
    assert SLO.parse("e2el:1000").e2e_ms == 1000
    with pytest.raises(ValueError, match="KEY:MILLISECONDS"):
        SLO.parse("latency:5")
    with pytest.raises(ValueError, match="number of ms"):
        SLO.parse("ttft:fast")
    with pytest.raises(ValueError, match="ttft_ms"):
        SLO(ttft_ms=0)


def test_duration_must_be_positive():
    with pytest.raises(ValueError, match="duration_s"):
        compute_serving_metrics([], 0.0)


# --- online sweeps: normalized latency, the warm-up drop, the sustained-rate rule (issue 24) ----------

from vmkv.compare.metrics import measured_records, normalized_latency, sustained_rate, sweep_point  # noqa: E402


def _lat(i, arrival, e2e, out):
    """A request arriving at ``arrival`` with ``out`` tokens, the last ``e2e`` s after it (ttft 0.1 e2e)."""
    times = ([arrival + 0.1 * e2e + (0.9 * e2e) * k / (out - 1) for k in range(out)] if out > 1
             else [arrival + e2e])
    return RequestRecord(f"r{i}", 4, out, arrival, times[0], times[-1], times)


def test_normalized_latency_is_the_mean_of_e2e_over_output_tokens():
    # 10 requests: the first by arrival (listed last) is the 10% dropped; its 100 s / 1 token would dominate
    recs = [_lat(i, float(i), e2e=2.0 * i, out=4) for i in range(1, 10)] + [_lat(0, 0.0, e2e=100.0, out=1)]
    assert normalized_latency(recs) == pytest.approx(sum(2.0 * i / 4 for i in range(1, 10)) / 9)
    assert normalized_latency(recs, 0.0) == pytest.approx((sum(2.0 * i / 4 for i in range(1, 10)) + 100.0) / 10)
    assert math.isnan(normalized_latency([]))


def test_warmup_drop_is_the_first_tenth_by_arrival():
    recs = [_lat(i, float(20 - i), 1.0, 2) for i in range(20)]      # listed latest first
    kept = measured_records(recs)
    assert len(kept) == 18 and [r.arrival_time for r in kept] == [float(a) for a in range(3, 21)]
    assert len(measured_records(recs[:9])) == 9                     # floor(0.9) = 0 dropped
    assert len(measured_records(recs[:10])) == 9
    with pytest.raises(ValueError):
        measured_records(recs, 1.0)


def test_sweep_point_attainment_counts_failures_and_the_slo():
    ok = [_lat(i, float(i), e2e=1.0, out=5) for i in range(9)]
    slow = _lat(9, 9.0, e2e=10.0, out=5)                    # ttft 1 s: over a 500 ms TTFT objective
    failed = RequestRecord("f", 4, 0, 10.0, None, None, success=False)
    p = sweep_point(ok + [slow, failed], rate=2.0, slo=SLO(ttft_ms=500), warmup_fraction=0.0)
    assert p["rate"] == 2.0 and p["requests_measured"] == 11 and p["requests_dropped"] == 0
    assert p["slo_attainment"] == pytest.approx(9 / 11)
    assert p["normalized_latency_s"] == pytest.approx((9 * 0.2 + 2.0) / 10)
    assert p["ttft_ms"]["n"] == 10 and p["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert sweep_point(ok, 2.0)["slo_attainment"] is None


def _pt(rate, nl, att=None):
    return {"rate": rate, "normalized_latency_s": nl, "slo_attainment": att}


def test_sustained_rate_rule_known_answers():
    # bounded latency, attainment falls below 0.9 at 8 req/s: 6 is the highest sustained
    r = sustained_rate([_pt(8, 0.05, 0.5), _pt(2, 0.01, 1.0), _pt(4, 0.012, 0.95), _pt(6, 0.02, 0.9)])
    assert r["sustained_rate"] == 6 and [p["passed"] for p in r["passes"]] == [True, True, True, False]
    assert not r["sustained_is_lower_bound"]
    assert "attainment" in r["passes"][-1]["why"]
    # the latency bound: 4x the lowest (0.01 s) is 0.04 s, exceeded at 6 req/s even with full attainment
    r = sustained_rate([_pt(2, 0.01, 1.0), _pt(4, 0.04, 1.0), _pt(6, 0.041, 1.0)])
    assert r["sustained_rate"] == 4 and "normalized latency" in r["passes"][2]["why"]
    # every lower rate must pass too: a pass above a failure does not count
    assert sustained_rate([_pt(2, 0.01, 0.5), _pt(4, 0.01, 1.0)])["sustained_rate"] is None
    assert sustained_rate([_pt(2, 0.01, 1.0), _pt(4, 0.01, 0.8), _pt(6, 0.01, 1.0)])["sustained_rate"] == 2
    # no SLO: the latency bound alone; a NaN latency (nothing completed) fails
    assert sustained_rate([_pt(1, 0.01), _pt(2, 0.03)])["sustained_rate"] == 2
    assert sustained_rate([_pt(1, 0.01), _pt(2, 0.03)])["sustained_is_lower_bound"]      # every rate passed
    assert sustained_rate([_pt(1, 0.01), _pt(2, math.nan)])["sustained_rate"] == 1
    r = sustained_rate([_pt(1, 0.01, 1.0)], attainment_min=0.5, latency_bound_factor=2.0)
    assert r["rule"] == {"slo_attainment_min": 0.5, "norm_latency_bound_factor": 2.0, "norm_latency_floor_s": 0.01}
