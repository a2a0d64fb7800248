"""``InputProcessor``: tokenization, chat templates and request validation, without a model or a KV cache
(the tiny byte-level BPE tokenizer of ``engine_helpers``, vocab ~300, max_model_len 64)."""

from __future__ import annotations

import types

import pytest

from engine_helpers import build_tokenizer
from vmkv.engine.errors import InvalidRequestError
from vmkv.engine.input_processor import InputProcessor, ProcessedRequest, to_token_ids
from vmkv.engine.sampling_params import SamplingParams
from vmkv.engine.sequence import PromptTooLongError

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def proc(tokenizer):
    model = types.SimpleNamespace(vocab_size=len(tokenizer))
    return InputProcessor(tokenizer, model, MAX_MODEL_LEN, max_num_seqs=4, model_name="tiny")


def test_text_prompt_is_tokenized_once_and_ids_win_over_text(proc, tokenizer):
    req = proc.process("The capital of France", SamplingParams())
    assert req == ProcessedRequest("The capital of France", tokenizer.encode("The capital of France"),
                                   SamplingParams(), None)
    req = proc.process("ignored text", SamplingParams(), prompt_token_ids=(5, 6), cache_salt="tenant")
    assert (req.prompt_token_ids, req.cache_salt) == ([5, 6], "tenant")


def test_chat_template_renders_with_the_generation_prompt(proc, tokenizer):
    ids = proc.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                 {"type": "text", "text": "there"}]}])
    assert tokenizer.decode(ids) == "<|user|>hi\nthere\n<|assistant|>"


@pytest.mark.parametrize("ids, match", [
    ([], "prompt is empty"), ([1, True], "must be integers, got True"), ([1, 2.0], "must be integers, got 2.0"),
    ([1, 10_000], r"prompt token id 10000 is outside the vocabulary \[0, "), ([-1], "outside the vocabulary"),
    (7, "must be a list of integers, got 7"),
])
def test_bad_token_ids_raise_naming_the_value(proc, ids, match):
    with pytest.raises(ValueError, match=match):
        proc.process(None, SamplingParams(), prompt_token_ids=ids)


def test_prompt_too_long_in_tokens_or_certainly_in_text(proc, tokenizer, monkeypatch):
    with pytest.raises(PromptTooLongError) as e:
        proc.process(None, SamplingParams(), prompt_token_ids=[1] * MAX_MODEL_LEN)
    assert (e.value.prompt_len, e.value.max_model_len) == (MAX_MODEL_LEN, MAX_MODEL_LEN)
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized a certainly too long text"))
    with pytest.raises(PromptTooLongError, match="at least"):
        proc.encode("x" * 1_000_000)


@pytest.mark.parametrize("call, field", [
    (lambda p: p.encode("a\ud800b"), "prompt"),
    (lambda p: p.apply_chat_template([{"role": "user", "content": "ok"}, {"role": "user", "content": "\udfff"}]),
     r"messages\[1\].content"),
])
def test_lone_surrogates_raise_naming_the_field(proc, call, field):
    with pytest.raises(ValueError, match=rf"^{field} contains a lone UTF-16 surrogate"):
        call(proc)


def test_request_level_checks(proc):
    with pytest.raises(ValueError, match="n=5 exceeds max_num_seqs=4"):
        proc.process(None, SamplingParams(n=5), prompt_token_ids=[1])
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        proc.process(None, SamplingParams(), prompt_token_ids=[1], cache_salt="")
    with pytest.raises(ValueError, match="prompt is empty"):
        proc.process("", SamplingParams())
    params = SamplingParams()
    params.top_k = 2 ** 63                                   # mutated after construction: validated again
    with pytest.raises(ValueError, match="top_k"):
        proc.process(None, params, prompt_token_ids=[1])


def test_without_a_tokenizer_only_token_ids_are_accepted():
    proc = InputProcessor(None, types.SimpleNamespace(vocab_size=100), MAX_MODEL_LEN)
    assert proc.process(None, SamplingParams(n=9), prompt_token_ids=[3]).prompt_token_ids == [3]
    with pytest.raises(ValueError, match="no tokenizer"):
        proc.process("text", SamplingParams())
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer") as e:
        proc.process(None, SamplingParams(stop=["x"]), prompt_token_ids=[3])
    assert e.value.param == "stop" and "'x'" in str(e.value)     # the server's 400 names the field
    with pytest.raises(InvalidRequestError, match="has no chat template") as e:
        proc.apply_chat_template([{"role": "user", "content": "hi"}])
    assert e.value.param == "messages"


def test_refused_fields_are_named():
    proc = InputProcessor(None, types.SimpleNamespace(vocab_size=100), MAX_MODEL_LEN, max_num_seqs=4)
    cases = [(lambda: proc.process(None, SamplingParams(n=5), prompt_token_ids=[1]), "n"),
             (lambda: proc.process(None, SamplingParams(), prompt_token_ids=[1], cache_salt=""), "cache_salt"),
             (lambda: proc.process(None, SamplingParams(), prompt_token_ids=[1], cache_salt="a\ud800"),
              "cache_salt"),
             (lambda: proc.apply_chat_template([]), "messages"),
             (lambda: proc.apply_chat_template([{"role": "user", "content": "x\udc00"}]), "messages[0].content")]
    for call, param in cases:
        with pytest.raises(InvalidRequestError) as e:
            call()
        assert e.value.param == param


def test_to_token_ids_accepts_integer_likes():
    import numpy as np

    assert to_token_ids(np.array([1, 2], dtype=np.int64)) == [1, 2] and to_token_ids((3,)) == [3]
