"""The sampler's logits processing (issue 25, item 1): ``min_tokens``, ``logit_bias``, the repetition /
frequency / presence penalties and ``min_p``, each against a straightforward float64 pure-Python reference
on random inputs; the per-completion token counts the penalties read, kept on the device by the sampler
itself (:class:`~vmkv.engine.logits_processing.TokenCounts`), against the tokens actually drawn."""

from __future__ import annotations

import random

import pytest
import torch

from sampling_refs import ref_probs, ref_process
from vmkv.engine.logits_processing import LogitsProcessing, TokenCounts, apply_min_p, apply_penalties
from vmkv.engine.sampler import Sampler, SamplingRow
from vmkv.engine.sampling_params import SamplingParams

NEG = float("-inf")


class Owner:
    """Stands for a request (``SequenceGroup``): its token-count slots are reused once it is finished."""

    def __init__(self) -> None:
        self.is_finished = False


def _random_processing(rnd: random.Random, vocab: int, owner: Owner, index: int, prompt: list[int]) -> LogitsProcessing:
    return LogitsProcessing(
        suppress_token_ids=tuple(rnd.sample(range(vocab), 2)) + (vocab + 5,) if rnd.random() < 0.5 else (),
        logit_bias={rnd.randrange(vocab): rnd.uniform(-5, 5) for _ in range(3)} if rnd.random() < 0.5 else None,
        repetition_penalty=rnd.choice([1.0, 0.7, 1.3, 2.0]),
        frequency_penalty=rnd.choice([0.0, 0.5, -0.4, 2.0]),
        presence_penalty=rnd.choice([0.0, 0.3, -1.0]),
        min_p=rnd.choice([0.0, 0.05, 0.3]),
        owner=owner, index=index, prompt_token_ids=prompt)


# ---------------------------------------------------------------------- kernels against the references
def test_apply_penalties_matches_the_reference():
    g = torch.Generator().manual_seed(0)
    rnd = random.Random(0)
    rows, vocab = 6, 40
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3
    prompts = [[rnd.randrange(vocab) for _ in range(rnd.randrange(1, 12))] for _ in range(rows)]
    outputs = [[rnd.randrange(vocab) for _ in range(rnd.randrange(0, 20))] for _ in range(rows)]
    counts = torch.zeros(rows, vocab, dtype=torch.int32)
    mask = torch.zeros(rows, vocab, dtype=torch.bool)
    for i in range(rows):
        for t in outputs[i]:
            counts[i, t] += 1
        mask[i, prompts[i]] = True
    rep = [1.0, 1.5, 0.5, 2.0, 1.2, 3.0]
    freq = [0.0, 0.5, -0.5, 2.0, 1.0, -2.0]
    pres = [0.0, -1.0, 1.0, 0.5, 2.0, 0.0]
    got = apply_penalties(logits.float(), counts, mask, torch.tensor(rep), torch.tensor(freq), torch.tensor(pres))
    for i in range(rows):
        proc = LogitsProcessing(repetition_penalty=rep[i], frequency_penalty=freq[i], presence_penalty=pres[i])
        want = ref_process(logits[i].tolist(), proc, prompts[i], outputs[i])
        torch.testing.assert_close(got[i].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-5)


def test_apply_min_p_matches_the_reference():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 30, generator=g) * 2
    logits[1, :10] = NEG                                      # rows may hold -inf from earlier masks
    min_p = [0.0, 0.1, 0.5, 1.0, 0.02]
    got = apply_min_p(logits, torch.tensor(min_p))
    for i, m in enumerate(min_p):
        p = logits[i].double().softmax(-1)
        want = [NEG if p[t] < p.max() * m else float(logits[i, t]) for t in range(30)]
        assert got[i].tolist() == pytest.approx(want), i
    assert int((got[3] != NEG).sum()) == 1                    # min_p 1 keeps only the most likely token


# ---------------------------------------------------------------------- the sampler, step after step
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampler_processing_matches_the_reference_over_many_steps(seed):
    """Random rows (greedy and sampled, with and without processing, n=2 from one owner) over 12 steps:
    each step's processed logits equal the float64 reference computed from the tokens actually drawn
    so far, and so do the distributions the non-greedy rows sample from."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    vocab, num_rows = 48, 7
    sampler = Sampler(seed=seed)
    owners = [Owner() for _ in range(num_rows - 1)]
    owners.append(owners[0])                        # the last row: completion 1 of row 0's request
    prompts = [[rnd.randrange(vocab) for _ in range(rnd.randrange(1, 10))] for _ in range(num_rows)]
    prompts[-1] = prompts[0]
    procs = [_random_processing(rnd, vocab, owners[i], 1 if i == num_rows - 1 else 0, prompts[i])
             for i in range(num_rows)]
    procs[2] = None                                 # one row without any processing
    procs[3] = LogitsProcessing(repetition_penalty=1.8, owner=owners[3], prompt_token_ids=prompts[3])
    temps = [0.0, 0.8, 1.0, 0.0, 1.3, 0.0, 0.6]
    top_k = [0, 5, 0, 0, 0, 3, 0]
    top_p = [1.0, 1.0, 0.9, 1.0, 0.8, 1.0, 1.0]
    outputs: list[list[int]] = [[] for _ in range(num_rows)]
    for _ in range(12):
        rows = [SamplingRow(temps[i], top_k[i], top_p[i], None, procs[i]) for i in range(num_rows)]
        logits = torch.randn(num_rows, vocab, generator=g) * 2
        processed, _ = sampler.process(logits, rows)
        probs = sampler.probabilities(processed, rows)
        for i in range(num_rows):
            want = ref_process(logits[i].tolist(), procs[i], prompts[i], outputs[i])
            torch.testing.assert_close(processed[i].double(), torch.tensor(want, dtype=torch.float64),
                                       rtol=1e-5, atol=1e-5)
            if temps[i] > 0:
                want_p = ref_probs(want, temps[i], procs[i].min_p if procs[i] else 0.0, top_k[i], top_p[i])
                torch.testing.assert_close(probs[i].double(), torch.tensor(want_p, dtype=torch.float64),
                                           rtol=1e-4, atol=1e-6)
        tokens = sampler.sample(logits, rows)
        for i, t in enumerate(tokens):
            if temps[i] == 0:
                want = ref_process(logits[i].tolist(), procs[i], prompts[i], outputs[i])
                assert t == max(range(vocab), key=lambda v: want[v]), (i, t)      # greedy on the processed
            elif procs[i] is not None:
                assert t not in procs[i].suppress_token_ids, (i, t)
            outputs[i].append(t)
    # the counts kept on the device are the tokens drawn, per completion
    tc = sampler.token_counts
    penalized = [i for i in range(num_rows) if procs[i] is not None and procs[i].uses_penalties]
    slots = tc.slots([procs[i] for i in penalized], vocab)
    counts, mask = tc.gather(slots)
    for row, i in enumerate(penalized):
        assert counts[row].tolist() == [outputs[i].count(t) for t in range(vocab)]
        assert mask[row].tolist() == [t in prompts[i] for t in range(vocab)]


def test_rows_without_processing_are_untouched_and_not_counted():
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(3))
    sampler = Sampler()
    rows = [SamplingRow(0.0)] * 4
    out, pen = sampler.process(logits, rows)
    assert out is logits and pen is None
    assert sampler.sample(logits, rows) == logits.argmax(-1).tolist()
    assert sampler.token_counts.output_counts is None           # no table made for the common path


def test_min_tokens_suppression_beats_a_dominant_token():
    logits = torch.zeros(3, 10)
    logits[:, 7] = 100.0                                        # token 7 (an "EOS") dominates
    rows = [SamplingRow(0.0, processing=LogitsProcessing(suppress_token_ids=(7, 9))),
            SamplingRow(1.0, processing=LogitsProcessing(suppress_token_ids=(7,))),
            SamplingRow(0.0)]
    for seed in range(20):
        got = Sampler(seed).sample(logits, rows)
        assert got[0] != 7 and got[0] != 9 and got[1] != 7 and got[2] == 7


def test_logit_bias_moves_the_argmax_and_ignores_ids_outside_the_vocabulary():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    row = SamplingRow(0.0, processing=LogitsProcessing(logit_bias={0: 5.0, 99: 100.0}))
    assert Sampler().sample(logits, [row]) == [0]


def test_a_penalty_row_needs_an_owner():
    with pytest.raises(ValueError, match="owner"):
        Sampler().sample(torch.zeros(1, 5), [SamplingRow(0.0, processing=LogitsProcessing(presence_penalty=1.0))])


def test_token_count_slots_are_reused_after_their_request_finishes_and_grow_when_all_are_held():
    tc = TokenCounts("cpu")
    vocab = 16
    owners = [Owner() for _ in range(TokenCounts.INITIAL_CAPACITY + 2)]
    procs = [LogitsProcessing(presence_penalty=1.0, owner=o, prompt_token_ids=[i]) for i, o in enumerate(owners)]
    first = tc.slots(procs[:TokenCounts.INITIAL_CAPACITY], vocab)
    tc.add(first, torch.tensor([3] * len(first)))
    assert tc.capacity == TokenCounts.INITIAL_CAPACITY and tc.num_slots == TokenCounts.INITIAL_CAPACITY
    grown = tc.slots(procs[TokenCounts.INITIAL_CAPACITY:TokenCounts.INITIAL_CAPACITY + 1], vocab)
    assert tc.capacity == 2 * TokenCounts.INITIAL_CAPACITY        # every slot was held: doubled
    counts, mask = tc.gather(first)                              # the old rows survived the growth
    assert counts[:, 3].tolist() == [1] * len(first) and mask[:, 0].tolist() == [True, False, False, False]
    assert int(tc.gather(grown)[0].sum()) == 0
    # a finished request's slot goes back (zeroed, its new prompt recorded) before the table grows again
    for o in owners[:TokenCounts.INITIAL_CAPACITY]:
        o.is_finished = True
    for p in procs[TokenCounts.INITIAL_CAPACITY + 1:]:
        tc.slots([p], vocab)
    late = [LogitsProcessing(presence_penalty=1.0, owner=Owner(), prompt_token_ids=[9]) for _ in range(6)]
    slots = tc.slots(late, vocab)
    assert tc.capacity == 2 * TokenCounts.INITIAL_CAPACITY
    counts, mask = tc.gather(slots)
    assert int(counts.sum()) == 0 and mask.sum(dim=1).tolist() == [1] * 6 and mask[:, 9].all()


# ---------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize("kwargs, message", [
    ({"min_tokens": -1}, "min_tokens must be an int in [0, 2147483647], got -1"),
    ({"min_tokens": 2 ** 31}, "min_tokens must be an int in [0, 2147483647]"),
    ({"min_tokens": 1.5}, "min_tokens must be an int"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be at most max_tokens=10, got 20"),
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
    ({"min_p": float("nan")}, "min_p must be in [0, 1]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, inf), got 0.0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be in (0, inf)"),
    ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2], got 2.5"),
    ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3"),
    ({"presence_penalty": True}, "presence_penalty must be in [-2, 2], got True"),
    ({"logit_bias": [1, 2]}, "logit_bias must be None or a dict"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {5: 101.0}}, "logit_bias[5] must be in [-100, 100], got 101.0"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be a bool"),
])
def test_new_sampling_params_are_validated(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


def test_processes_logits_only_when_asked():
    assert not SamplingParams().processes_logits
    assert not SamplingParams(repetition_penalty=1.0, min_p=0.0, logit_bias={}).processes_logits
    for kw in ({"min_tokens": 1}, {"min_p": 0.1}, {"repetition_penalty": 1.1}, {"frequency_penalty": -0.1},
               {"presence_penalty": 0.1}, {"logit_bias": {1: 1.0}}):
        assert SamplingParams(**kw).processes_logits, kw
