"""Sampler: exact top-k / top-p masks on small logits, greedy, temperature, per-row seeds."""

from __future__ import annotations

import math

import pytest
import torch

from vmkv.engine.sampler import Sampler, SamplingRow, apply_top_k, apply_top_p
from vmkv.engine.sampling_params import SamplingParams

NEG = float("-inf")


def kept(t: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row != NEG).flatten().tolist() for row in t]


def test_top_k_mask_is_exact():
    logits = torch.tensor([[0.1, 2.0, -1.0, 3.0, 0.5],
                           [5.0, 4.0, 3.0, 2.0, 1.0],
                           [1.0, 1.0, 1.0, 0.0, 2.0]])
    out = apply_top_k(logits, torch.tensor([2, 0, 2]))
    # row 0: two largest (3.0 at 3, 2.0 at 1); row 1: disabled; row 2: 2.0 and the tied 1.0s
    assert kept(out) == [[1, 3], [0, 1, 2, 3, 4], [0, 1, 2, 4]]
    assert torch.equal(out[out != NEG], logits[out != NEG])            # kept values unchanged
    assert kept(apply_top_k(logits, torch.tensor([1, 5, 7]))) == [[3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]


def test_top_p_mask_is_exact():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3],
                          [0.25, 0.25, 0.25, 0.25],
                          [0.7, 0.1, 0.1, 0.1]])
    logits = probs.log()
    # row 0 sorted: 0.5 (1), 0.3 (3), 0.15 (2), 0.05 (0); p=0.7: mass before 0.3 is 0.5 < 0.7 keep,
    # mass before 0.15 is 0.8 >= 0.7 drop
    out = apply_top_p(logits, torch.tensor([0.7, 0.6, 0.5]))
    assert kept(out) == [[1, 3], [0, 1, 2], [0]]
    assert kept(apply_top_p(logits, torch.tensor([0.81, 1.0, 0.75]))) == [[1, 2, 3], [0, 1, 2, 3], [0, 1]]
    # the most likely token is always kept, even for a tiny p
    assert kept(apply_top_p(logits, torch.tensor([1e-6, 1e-6, 1e-6]))) == [[1], [0], [0]]


def test_top_p_after_top_k_renormalizes():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    k = apply_top_k(logits, torch.tensor([2]))                  # keeps 0.4, 0.3 -> 4/7, 3/7
    assert kept(apply_top_p(k, torch.tensor([0.5]))) == [[0]]   # 4/7 >= 0.5
    assert kept(apply_top_p(k, torch.tensor([0.6]))) == [[0, 1]]


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    s = Sampler(seed=0)
    assert s.sample(logits, [SamplingRow(0.0)] * 6) == logits.argmax(-1).tolist()
    mixed = [SamplingRow(0.0), SamplingRow(1.0), SamplingRow(0.0), SamplingRow(0.7, top_k=3),
             SamplingRow(0.0), SamplingRow(1.2, top_p=0.5)]
    got = s.sample(logits, mixed)
    for i in (0, 2, 4):
        assert got[i] == int(logits[i].argmax())
    assert got[3] in logits[3].topk(3).indices.tolist()


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    rows = [SamplingRow(1.5, top_k=1)] * 4
    for seed in range(5):
        assert Sampler(seed).sample(logits, rows) == logits.argmax(-1).tolist()


def test_sampled_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    got = torch.tensor(Sampler(seed=3).sample(logits, [SamplingRow(1.0)] * 4000))
    freq = torch.bincount(got, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq
    # temperature 0.5 squares the odds: p^2 / sum p^2
    sharp = probs ** 2 / (probs ** 2).sum()
    got = torch.tensor(Sampler(seed=4).sample(logits, [SamplingRow(0.5)] * 4000))
    freq = torch.bincount(got, minlength=4).float() / 4000
    assert torch.allclose(freq, sharp, atol=0.03), freq
    # top-p 0.7 keeps {0.5, 0.3}: renormalized 0.625 / 0.375, never the tail
    got = torch.tensor(Sampler(seed=5).sample(logits, [SamplingRow(1.0, top_p=0.7)] * 4000))
    freq = torch.bincount(got, minlength=4).float() / 4000
    assert freq[2] == freq[3] == 0 and math.isclose(float(freq[0]), 0.625, abs_tol=0.03)


def test_seeded_rows_do_not_depend_on_the_batch():
    vocab = 64
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(2))

    def run(rows_before: int) -> list[int]:
        g = torch.Generator().manual_seed(99)
        s = Sampler(seed=rows_before)                  # the shared generator differs too
        out = []
        for _ in range(10):
            batch = torch.cat([torch.randn(rows_before, vocab), logits[:1]])
            rows = [SamplingRow(1.0)] * rows_before + [SamplingRow(0.8, top_p=0.9, generator=g)]
            out.append(s.sample(batch, rows)[-1])
        return out

    assert run(0) == run(3) == run(7)


def test_shared_generator_is_seeded_by_the_engine_seed():
    logits = torch.zeros(20, 30)
    rows = [SamplingRow(1.0)] * 20
    assert Sampler(11).sample(logits, rows) == Sampler(11).sample(logits, rows)
    assert Sampler(11).sample(logits, rows) != Sampler(12).sample(logits, rows)


def test_sample_checks_row_count():
    with pytest.raises(ValueError, match="num_rows"):
        Sampler().sample(torch.zeros(2, 5), [SamplingRow()])


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 5}, "temperature must be in [0, 2], got 5"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n must be"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop strings"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    # upper bounds: every integer must fit the torch dtype it ends up in (issue 9: top_k=2**63
    # killed the engine thread); the message names the field, the range and the value
    ({"top_k": 2 ** 63}, "top_k must be -1 or 0 (disabled) or an int in [1, 2147483647], got 9223372036854775808"),
    ({"top_k": 2 ** 31}, "top_k"),
    ({"seed": 2 ** 63}, "seed must be None or an int in [0, 9223372036854775807], got 9223372036854775808"),
    ({"n": 2 ** 31}, "n must be an int in [1, 2147483647]"),
    ({"max_tokens": 2 ** 31}, "max_tokens must be None or an int in [1, 2147483647]"),
    ({"stop_token_ids": [2 ** 63]}, "stop_token_ids must be ints in [0, 9223372036854775807]"),
    ({"stop_token_ids": 5}, "stop_token_ids must be None or a list"),
    ({"stop": 5}, "stop must be None, a str or a list"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"n": True}, "n must be"),
    # adversarial follow-ups: a dict is not a list of stops, and a lone surrogate is not text
    ({"stop": {"a": 1}}, "stop must be None, a str or a list of str, got a dict"),
    ({"stop": {"a"}}, "stop must be None, a str or a list of str, got a set"),
    ({"stop": "\ud800"}, "stop strings must be Unicode text"),
    ({"stop": ["ok", "x\udfff"]}, "stop strings must be Unicode text"),
    ({"stop_token_ids": {1: 2}}, "stop_token_ids must be None or a list"),
])
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


def test_assigned_stop_is_normalized_like_the_constructor():
    """``sp.stop = "the"`` then ``validate()`` used to say "stop must be None, a str or a list of str,
    got 'the'" (and stop_strings split it into letters)."""
    sp = SamplingParams()
    sp.stop = "the"
    sp.validate()
    assert sp.stop == ["the"] and sp.stop_strings == ["the"]
    sp.stop = ("a", "b")
    sp.validate()
    assert sp.stop == ["a", "b"]
    assert SamplingParams(stop=("x",)).stop == ["x"] and SamplingParams(stop_token_ids=(3,)).stop_token_ids == [3]


def test_sampling_params_bounds_are_accepted():
    p = SamplingParams(top_k=2 ** 31 - 1, seed=2 ** 63 - 1, n=1, max_tokens=2 ** 31 - 1,
                       stop_token_ids=(2 ** 63 - 1,), stop=("a", "b"))
    assert p.stop_token_ids == [2 ** 63 - 1] and p.stop == ["a", "b"]


def test_top_k_beyond_the_vocabulary_is_clamped():
    """A k at or above the vocabulary keeps every token; beyond int64 it must not reach torch."""
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    probs = Sampler().probabilities(logits, [SamplingRow(top_k=2 ** 63), SamplingRow(top_k=11),
                                             SamplingRow(top_k=0)])
    torch.testing.assert_close(probs, logits.softmax(-1))
    mixed = Sampler().probabilities(logits, [SamplingRow(top_k=2 ** 63), SamplingRow(top_k=2),
                                             SamplingRow(temperature=0.0, top_k=2 ** 70)])
    torch.testing.assert_close(mixed[0], logits[0].softmax(-1))
    assert int((mixed[1] > 0).sum()) == 2
    g = lambda: torch.Generator().manual_seed(5)   # noqa: E731
    assert Sampler().sample(logits, [SamplingRow(top_k=2 ** 63, generator=g())] * 1 + [SamplingRow()] * 2) \
        [:1] == Sampler().sample(logits, [SamplingRow(top_k=0, generator=g())] + [SamplingRow()] * 2)[:1]


def test_sampling_params_normalization():
    p = SamplingParams(stop="###", temperature=0)
    assert p.stop == ["###"] and p.is_greedy and p.effective_top_k == 0
    assert SamplingParams(top_k=0).effective_top_k == 0
    assert SamplingParams(top_k=7).effective_top_k == 7
    assert SamplingParams(max_tokens=None).max_tokens is None
