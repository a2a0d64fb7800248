"""Incremental detokenization, stop strings with hold-back, and per-token stop conditions."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import build_tokenizer
from vmkv.engine.detokenizer import IncrementalDetokenizer, find_stop_string, stop_holdback_len
from vmkv.engine.sampling_params import SamplingParams
from vmkv.engine.sequence import Sequence, SequenceGroup


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


TEXTS = ["Hello world! How are you today?", "héllo wörld — 日本語 ✓ ok", " leading spaces  and\nnewlines",
         "The capital of France is Paris."]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_deltas_join_to_the_full_decode(tok, text):
    prompt = tok.encode("Some prompt:")
    ids = tok.encode(text)
    assert len(ids) > 3
    d = IncrementalDetokenizer(tok, prompt)
    deltas = [d.add_token(t) for t in ids]
    joined = "".join(deltas) + d.flush()
    assert joined == tok.decode(ids) == text
    assert all("\ufffd" not in x for x in deltas)          # partial UTF-8 bytes are held back
    if any(ord(c) > 127 for c in text):
        assert "" in deltas                                # some token completed no character


def test_random_ids_match_full_decode(tok):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tok), (200,), generator=g).tolist()
    d = IncrementalDetokenizer(tok, [5, 6, 7])
    text = "".join(d.add_token(t) for t in ids) + d.flush()
    assert text == tok.decode(ids)


def test_find_stop_string_and_holdback():
    assert find_stop_string("abc STOP def", ["STOP"], 12) == (4, "STOP")
    assert find_stop_string("abc STOP def", ["STOP"], 3) is None       # ended before the new text
    assert find_stop_string("abc ST", ["STOP"], 2) is None
    assert find_stop_string("xxSTOPyyEND", ["END", "STOP"], 9) == (2, "STOP")   # earliest wins
    assert find_stop_string("abcST", ["STOP"], 1) is None
    assert find_stop_string("abcSTOP", ["STOP"], 1) == (3, "STOP")      # completed by the last char
    assert stop_holdback_len("hello S", ["STOP"]) == 1
    assert stop_holdback_len("hello STO", ["STOP"]) == 3
    assert stop_holdback_len("hello STOX", ["STOP"]) == 0
    assert stop_holdback_len("ab", ["bcd", "abx"]) == 2
    assert stop_holdback_len("", ["x"]) == 0


def make_seq(tok, params: SamplingParams, prompt: str = "Q:") -> Sequence:
    g = SequenceGroup("r", prompt, tok.encode(prompt), params, tok, 0.0, torch.device("cpu"))
    s = Sequence(0, g, 0)
    g.seqs.append(s)
    return s


def test_stop_string_spanning_tokens_is_held_back_then_cut(tok):
    text = "The capital of France is Paris. The capital"
    ids = tok.encode(text)
    seq = make_seq(tok, SamplingParams(stop=["Paris."], max_tokens=100))
    emitted = []
    for t in ids:
        seq.append_token(t, eos_token_ids=(), max_model_len=1000)
        emitted.append(seq.output_text)
        if seq.finish_reason:
            break
    assert seq.finish_reason == "stop" and seq.stop_reason == "Paris."
    assert seq.output_text == "The capital of France is "
    for before, after in zip(emitted, emitted[1:]):
        assert after.startswith(before)
    assert all("Pari" not in e for e in emitted)


def test_eos_stop_ids_length_and_ignore_eos(tok):
    ids = tok.encode("Hello world! How are you")
    eos = tok.eos_token_id
    seq = make_seq(tok, SamplingParams(max_tokens=50))
    for t in ids[:3]:
        seq.append_token(t, (eos,), 1000)
    seq.append_token(eos, (eos,), 1000)
    assert (seq.finish_reason, seq.stop_reason) == ("stop", None)
    assert seq.output_token_ids[-1] == eos and seq.output_text == tok.decode(ids[:3])

    seq = make_seq(tok, SamplingParams(max_tokens=50, ignore_eos=True))
    seq.append_token(eos, (eos,), 1000)
    assert seq.finish_reason is None

    seq = make_seq(tok, SamplingParams(max_tokens=50, stop_token_ids=[ids[2]]))
    for t in ids:
        seq.append_token(t, (eos,), 1000)
        if seq.finish_reason:
            break
    assert (seq.finish_reason, seq.stop_reason) == ("stop", ids[2])
    assert seq.output_text == tok.decode(ids[:2])

    seq = make_seq(tok, SamplingParams(max_tokens=2))
    seq.append_token(ids[0], (eos,), 1000)
    seq.append_token(ids[1], (eos,), 1000)
    assert seq.finish_reason == "length" and seq.output_text == tok.decode(ids[:2])

    seq = make_seq(tok, SamplingParams(max_tokens=None))       # max_model_len caps the output
    seq.append_token(ids[0], (eos,), seq.prompt_len + 1)
    assert seq.finish_reason == "length"


def test_stop_string_wins_over_length(tok):
    ids = tok.encode("abc STOP")
    seq = make_seq(tok, SamplingParams(stop=["STOP"], max_tokens=len(ids)))
    for t in ids:
        seq.append_token(t, (), 1000)
    assert (seq.finish_reason, seq.stop_reason, seq.output_text) == ("stop", "STOP", "abc ")


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hello") + [tok.convert_tokens_to_ids("<pad>")] + tok.encode(" world")
    for skip, want in ((True, "Hello world"), (False, "Hello<pad> world")):
        seq = make_seq(tok, SamplingParams(skip_special_tokens=skip, max_tokens=100))
        for t in ids:
            seq.append_token(t, (), 1000)
        assert seq.output_text == want
