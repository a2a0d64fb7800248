"""Issue 25, item 1, against the real two-process server (:class:`RunningServer`), both KV backends:

- guidellm's streaming requests (``stream_options: {"include_usage": true, "continuous_usage_stats": true}``,
  refused with a 400 before) get 200 and a ``usage`` object on every chunk, as vLLM sends it: the choice's
  prompt tokens and its completion tokens so far, then the usual last usage chunk and ``[DONE]``;
- the vLLM sampling fields (``min_tokens``, ``min_p``, the penalties, ``logit_bias``,
  ``include_stop_str_in_output``) give the served completions the in-process engine gives, token for
  token and character for character: the core samples with them, the front applies ``min_tokens`` and
  ``include_stop_str_in_output`` to the stop strings it finds.
"""

from __future__ import annotations

import json

from server_helpers import (
    CHAT_URL,
    COMPLETIONS_URL,
    SERVED,
    RunningServer,
    final_completions,
    inprocess_engine,
    sse_events,
)

GUIDELLM_STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
PROMPT = "the capital of France is"


def _stream(srv: RunningServer, url: str, body: dict) -> list[dict]:
    with srv.http.stream("POST", url, json={"model": SERVED, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.read().decode())
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    return chunks


def test_guidellm_stream_options_put_usage_on_every_chat_chunk(server):
    chunks = _stream(server, CHAT_URL, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                                        "temperature": 0, "ignore_eos": True, "n": 2,
                                        "stream_options": GUIDELLM_STREAM_OPTIONS})
    *body, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    assert last["usage"]["prompt_tokens"] > 0                  # the prompt, once for both choices
    seen = {0: 0, 1: 0}
    for c in body:
        usage = c["usage"]
        assert usage is not None and set(usage) >= {"prompt_tokens", "completion_tokens", "total_tokens"}, c
        assert usage["prompt_tokens"] == last["usage"]["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        (choice,) = c["choices"]
        i = choice["index"]
        assert usage["completion_tokens"] >= seen[i]            # this choice's tokens so far
        seen[i] = usage["completion_tokens"]
        if choice["delta"].get("role") == "assistant":
            assert usage["completion_tokens"] == 0
    assert seen == {0: 6, 1: 6}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in body
                   if c["choices"][0]["index"] == 0)


def test_guidellm_stream_options_put_usage_on_every_completion_chunk(server):
    chunks = _stream(server, COMPLETIONS_URL, {"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                               "ignore_eos": True, "return_token_ids": True,
                                               "stream_options": GUIDELLM_STREAM_OPTIONS})
    *body, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    num_tokens = 0
    for c in body:
        num_tokens += len(c["choices"][0].get("token_ids") or [])
        assert c["usage"] == {"prompt_tokens": last["usage"]["prompt_tokens"], "completion_tokens": num_tokens,
                              "total_tokens": last["usage"]["prompt_tokens"] + num_tokens,
                              "prompt_tokens_details": None}, c
    assert num_tokens == 5
    # include_usage alone: usage only on the last chunk, as before
    chunks = _stream(server, COMPLETIONS_URL, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                               "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] >= 1
    # continuous_usage_stats without include_usage: no usage at all (vLLM)
    chunks = _stream(server, COMPLETIONS_URL, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                               "stream_options": {"continuous_usage_stats": True}})
    assert all(c["usage"] is None for c in chunks) and all(c["choices"] for c in chunks)


def test_served_sampling_fields_equal_the_in_process_engine(server, tiny_model_dir):
    from vmkv.engine.sampling_params import SamplingParams

    engine = inprocess_engine(tiny_model_dir, server.backend)

    def offline(params: SamplingParams) -> list:
        return final_completions(engine, PROMPT, params)

    greedy = offline(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    words = greedy.text.split()
    stop = next(w for i, w in enumerate(words) if w in words[i + 1:])       # occurs early and again later
    cases = [
        {"temperature": 0, "max_tokens": 30, "stop": [stop]},
        {"temperature": 0, "max_tokens": 30, "stop": [stop], "include_stop_str_in_output": True},
        {"temperature": 0, "max_tokens": 30, "stop": [stop], "min_tokens": 8},
        {"temperature": 0, "max_tokens": 30, "stop": [stop], "min_tokens": 8, "include_stop_str_in_output": True},
        {"temperature": 0, "max_tokens": 20, "repetition_penalty": 1.5},
        {"temperature": 0, "max_tokens": 20, "frequency_penalty": 1.0, "presence_penalty": 0.5},
        {"temperature": 0.9, "max_tokens": 16, "seed": 11, "n": 3, "min_p": 0.05, "repetition_penalty": 1.3,
         "frequency_penalty": 0.4},
        {"temperature": 0, "max_tokens": 6, "logit_bias": {"7": 100}, "min_tokens": 6},
    ]
    refs = []
    for body in cases:
        kw = dict(body, logit_bias={int(k): float(v) for k, v in body.get("logit_bias", {}).items()} or None)
        refs.append(offline(SamplingParams(ignore_eos=True, **kw)))
    engine.close()
    assert refs[0][0].finish_reason == "stop" and refs[0][0].text != refs[2][0].text
    assert refs[1][0].text == refs[0][0].text + stop
    assert refs[4][0].token_ids != greedy.token_ids[:20] and list(refs[7][0].token_ids) == [7] * 6

    for body, ref in zip(cases, refs):
        r = server.http.post(COMPLETIONS_URL, json={"model": SERVED, "prompt": PROMPT, "ignore_eos": True,
                                                    "return_token_ids": True, **body})
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["token_ids"] for c in choices] == [list(c.token_ids) for c in ref], body
        assert [c["text"] for c in choices] == [c.text for c in ref], body
        assert [(c["finish_reason"], c["stop_reason"]) for c in choices] == \
            [(c.finish_reason, c.stop_reason) for c in ref], body
    # streamed: the kept stop string arrives, and nothing after it
    chunks = _stream(server, COMPLETIONS_URL, {"prompt": PROMPT, "ignore_eos": True, **cases[3]})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == refs[3][0].text
    server.wait_kv_idle()
