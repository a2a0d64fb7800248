"""Seeded workloads: determinism, length ranges, arrival statistics, sharing patterns."""

import math

import numpy as np
import pytest

from vmkv.compare.workloads import LengthDist, WorkloadSpec, arrival_offsets, fingerprint, generate


def test_length_dist_parse_forms():
    assert LengthDist.parse("512") == LengthDist("fixed", 512, 512)
    assert LengthDist.parse("512..2048") == LengthDist("uniform", 512, 2048)
    ln = LengthDist.parse("lognormal:100,0.5,10,400")
    assert (ln.kind, ln.low, ln.high, ln.median, ln.sigma) == ("lognormal", 10, 400, 100, 0.5)
    assert LengthDist.parse("sharegpt-in").mean == pytest.approx(161.0)
    assert LengthDist.parse("sharegpt-out").mean == pytest.approx(338.0)
    for bad in ("abc", "lognormal:1", "5..2", "0"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_samples_stay_in_range():
    rng = np.random.default_rng(0)
    u = LengthDist.parse("512..2048").sample(rng, 5000)
    assert u.min() >= 512 and u.max() <= 2048 and u.min() < 560 and u.max() > 2000
    ln = LengthDist.parse("lognormal:100,1.0,4,1000").sample(rng, 5000)
    assert ln.min() >= 4 and ln.max() <= 1000
    assert np.median(ln) == pytest.approx(100, rel=0.1)


def test_generate_is_deterministic_and_matches_spec():
    spec = WorkloadSpec(num_requests=20, input_len="8..64", output_len="4..16", seed=3)
    a, b = generate(spec, 1000), generate(spec, 1000)
    assert fingerprint(a) == fingerprint(b)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(8 <= r.prompt_len <= 64 and 4 <= r.output_len <= 16 for r in a)
    assert all(100 <= t < 1000 for r in a for t in r.prompt_token_ids)
    assert all(r.arrival_s == 0 for r in a)  # offline
    c = generate(WorkloadSpec(num_requests=20, input_len="8..64", output_len="4..16", seed=4), 1000)
    assert fingerprint(c) != fingerprint(a)


def test_rate_changes_only_arrivals():
    off = generate(WorkloadSpec(num_requests=10, seed=1), 500)
    on = generate(WorkloadSpec(num_requests=10, seed=1, request_rate=4.0), 500)
    assert [r.prompt_token_ids for r in off] == [r.prompt_token_ids for r in on]
    arr = [r.arrival_s for r in on]
    assert arr == sorted(arr) and arr[0] > 0


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_mean_rate(burstiness):
    t = arrival_offsets(20000, 10.0, burstiness, np.random.default_rng(0))
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    # gamma(shape k) gaps: coefficient of variation 1/sqrt(k) (1 for Poisson)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_shared_prefix_workload():
    spec = WorkloadSpec(kind="shared-prefix", num_requests=6, input_len="40..50", shared_prefix_len=32,
                        num_prefixes=2, seed=0)
    reqs = generate(spec, 1000)
    assert [r.prefix_id for r in reqs] == [0, 1, 0, 1, 0, 1]
    assert reqs[0].prompt_token_ids[:32] == reqs[2].prompt_token_ids[:32]
    assert reqs[0].prompt_token_ids[:32] != reqs[1].prompt_token_ids[:32]
    assert reqs[0].prompt_token_ids[32:] != reqs[2].prompt_token_ids[32:]
    with pytest.raises(ValueError, match="shared_prefix_len"):
        generate(WorkloadSpec(kind="shared-prefix", num_requests=2, input_len="16", shared_prefix_len=32), 1000)


def test_parallel_and_validation():
    reqs = generate(WorkloadSpec(kind="parallel", n=4, num_requests=3), 1000)
    assert all(r.n == 4 for r in reqs)
    with pytest.raises(ValueError, match="parallel"):
        WorkloadSpec(n=2)
    with pytest.raises(ValueError, match="request_rate"):
        WorkloadSpec(request_rate=0)
    with pytest.raises(ValueError, match="kind"):
        WorkloadSpec(kind="sharegpt")
    spec = WorkloadSpec(request_rate=2.5)
    assert WorkloadSpec.from_dict(spec.to_dict()) == spec
    assert WorkloadSpec.from_dict(WorkloadSpec().to_dict()).is_offline
