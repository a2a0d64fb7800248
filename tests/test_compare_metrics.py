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
