"""End-to-end tests of the OpenAI-compatible server (``vmkv serve``), on both KV backends.

A tiny random Llama (transformers ``save_pretrained``) with a word-level tokenizer and a ChatML chat
template is written to a temp dir; the real app is served by uvicorn on 127.0.0.1 (a thread of this
process, or ``python -m vmkv.cli serve`` for the CLI test) and driven with the official ``openai``
client and raw ``httpx`` (see ``server_helpers``).  The defects of the HTTP edge found by issue 9 have
their regression tests in ``test_server_edge.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import openai
import pytest
from server_helpers import (
    fail_steps,
    has_unfinished_requests,
    CHAT,
    CHAT_URL,
    COMPLETIONS_URL,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    SERVED,
    VMEM_PAGE_SIZE_BYTES,
    RunningServer,
    sse_events,
)


@pytest.fixture(scope="module", params=["paged", "vmem"])
def server(request, tiny_model_dir):
    srv = RunningServer(tiny_model_dir, request.param)
    yield srv
    srv.stop()
    assert not srv.thread.is_alive()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _chat_prompt_len(tokenizer) -> int:
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------------------- basics
def test_models_health_and_metrics_format(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [SERVED]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert server.http.get("/health").json() == {"status": "ok"}
    r = server.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert f'vmkv_server_info{{backend="{server.backend}",model="{SERVED}"}} 1.0' in r.text
    m = server.metrics()
    for name in ("vmkv_kv_used_tokens", "vmkv_kv_allocated_bytes", "vmkv_kv_mapped_bytes", "vmkv_kv_waste_bytes",
                 "vmkv_kv_capacity_bytes", "vmkv_num_requests_running", "vmkv_num_requests_waiting",
                 "vmkv_num_preemptions_total", "vmkv_prefix_cache_hit_rate"):
        assert name in m, name
    assert m["vmkv_kv_capacity_bytes"] > 0


KV_MEMORY_GAUGES = ("vmkv_kv_created_bytes", "vmkv_kv_mapped_bytes", "vmkv_kv_in_use_bytes", "vmkv_kv_idle_bytes",
                    "vmkv_device_memory_used_bytes", "vmkv_kv_token_bytes", "vmkv_kv_reserved_unused_bytes",
                    "vmkv_kv_tail_bytes")


def _check_kv_memory(server, m: dict) -> None:
    created, mapped, in_use, idle = (m[f"vmkv_kv_{k}_bytes"] for k in ("created", "mapped", "in_use", "idle"))
    assert m["vmkv_kv_capacity_bytes"] >= created >= mapped >= 0 and created >= in_use >= 0
    assert idle == created - in_use and in_use == m["vmkv_kv_allocated_bytes"]
    assert m["vmkv_device_memory_used_bytes"] > 0          # CPU: the server process's RSS
    # the breakdown (paper's Fig. 2): token states + reserved unused + tails + idle = created
    parts = [m[f"vmkv_kv_{k}_bytes"] for k in ("token", "reserved_unused", "tail")]
    assert all(p >= 0 for p in parts) and sum(parts) == in_use and sum(parts) + idle == created
    assert m["vmkv_kv_tail_bytes"] == m["vmkv_kv_waste_bytes"]
    if server.backend == "paged":                          # a static pool: all of it exists
        assert created == m["vmkv_kv_capacity_bytes"]
    else:                                                  # pages created on demand, whole pages
        assert created % VMEM_PAGE_SIZE_BYTES == 0


def test_metrics_kv_memory_held_next_to_device_memory(server):
    """/metrics reports the physical KV bytes held (created, mapped, in use, idle) next to the device
    memory in use, read fresh at every scrape: in use rises while a request runs and is idle after."""
    done = threading.Event()

    def run():
        try:
            server.client.completions.create(model=SERVED, prompt="hello world", max_tokens=40, temperature=0,
                                             extra_body={"ignore_eos": True})
        finally:
            done.set()

    seen_in_use = 0.0
    with server.slowed(0.02):
        t = threading.Thread(target=run, daemon=True)
        t.start()
        while not done.is_set():
            m = server.metrics()
            assert all(name in m for name in KV_MEMORY_GAUGES), sorted(m)
            _check_kv_memory(server, m)
            seen_in_use = max(seen_in_use, m["vmkv_kv_in_use_bytes"])
            time.sleep(0.02)
        t.join(30)
    assert seen_in_use > 0
    m = server.wait_kv_idle()
    _check_kv_memory(server, m)
    # idle after the request (vmem may already have given some of it back: created can only be lower)
    assert m["vmkv_kv_in_use_bytes"] == 0 and m["vmkv_kv_idle_bytes"] == m["vmkv_kv_created_bytes"]


def test_chat_completion(server, tokenizer):
    r = server.client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == SERVED
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert isinstance(choice.message.content, str) and len(choice.message.content.split()) >= 1
    assert r.usage.prompt_tokens == _chat_prompt_len(tokenizer)
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    # max_completion_tokens is the newer name of max_tokens and wins over it
    r2 = server.client.chat.completions.create(model=SERVED, messages=CHAT, max_completion_tokens=3, max_tokens=9,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert r2.usage.completion_tokens == 3 and r2.choices[0].finish_reason == "length"
    # greedy decoding is deterministic: the 3 tokens are the start of the 6
    assert r.choices[0].message.content.startswith(r2.choices[0].message.content)


def test_chat_streaming_matches_non_streamed(server):
    full = server.client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True})
    # steps slower than the client reads: a consumer that falls behind gets merged chunks, fewer than tokens
    with server.slowed(0.02):
        chunks = list(server.client.chat.completions.create(
            model=SERVED, messages=CHAT, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    *content_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 8
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in content_chunks)
    assert [c.choices[0].finish_reason for c in content_chunks].count("length") == 1
    assert content_chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == full.choices[0].message.content
    assert len(content_chunks) >= 3  # role chunk + several token chunks: really streamed


def test_raw_sse_wire_format(server):
    body = {"model": SERVED, "messages": CHAT, "max_tokens": 3, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with server.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 3


def test_text_completion_and_stream(server, tokenizer):
    prompt = "the capital of France is"
    r = server.client.completions.create(model=SERVED, prompt=prompt, max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt)) and r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length"
    chunks = list(server.client.completions.create(model=SERVED, prompt=prompt, max_tokens=5, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    # default max_tokens of /v1/completions is 16 (OpenAI's default)
    d = server.client.completions.create(model=SERVED, prompt=prompt, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert d.usage.completion_tokens == 16
    # token-id prompts and prompt batches
    ids = tokenizer.encode(prompt)
    b = server.client.completions.create(model=SERVED, prompt=[ids, ids[:2]], max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert [c.index for c in b.choices] == [0, 1]
    assert b.choices[0].text == r.choices[0].text
    assert b.usage.prompt_tokens == len(ids) + 2 and b.usage.completion_tokens == 10


def test_n_2(server):
    r = server.client.chat.completions.create(model=SERVED, messages=CHAT, n=2, max_tokens=6, temperature=1.0,
                                              seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == r.usage.prompt_tokens  # counted once per prompt, not per choice
    # streamed n=2: each choice gets its role chunk, its content and exactly one finish_reason
    stream = server.client.completions.create(model=SERVED, prompt="the capital of France", n=2, max_tokens=4,
                                              temperature=1.0, seed=7, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True})
    texts, finishes, usage = {0: "", 1: ""}, {0: [], 1: []}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert finishes == {0: ["length"], 1: ["length"]}
    assert all(len(t.split()) >= 1 for t in texts.values())
    assert usage is not None and usage.completion_tokens == 8


def test_stop_strings(server):
    base = server.client.completions.create(model=SERVED, prompt="the capital of France", max_tokens=12,
                                            temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    words = text.split()
    assert len(words) >= 4
    stop = " " + words[2]
    expected = text[: text.index(stop)]
    r = server.client.completions.create(model=SERVED, prompt="the capital of France", max_tokens=12,
                                         temperature=0, stop=[stop, "zzz never"], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == expected and stop not in r.choices[0].text
    assert r.choices[0].model_extra["stop_reason"] == stop
    # streamed: the held-back text never leaks the stop string
    chunks = list(server.client.completions.create(model=SERVED, prompt="the capital of France", max_tokens=12,
                                                   temperature=0, stop=stop, stream=True,
                                                   extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------- errors
_MSG = [{"role": "user", "content": "hello"}]
ERROR_CASES = [
    # (id, url, raw body or JSON, status, param, code)
    ("negative_max_tokens", CHAT_URL, {"messages": _MSG, "max_tokens": -5}, 400, "max_tokens", "invalid_value"),
    ("zero_max_tokens", COMPLETIONS_URL, {"prompt": "the", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("absurd_max_tokens", CHAT_URL, {"messages": _MSG, "max_tokens": 10**9}, 400, "max_tokens",
     "context_length_exceeded"),
    ("absurd_max_completion_tokens", CHAT_URL, {"messages": _MSG, "max_completion_tokens": 10**6}, 400,
     "max_completion_tokens", "context_length_exceeded"),
    ("huge_int_max_tokens", COMPLETIONS_URL, {"prompt": "the", "max_tokens": 10**30}, 400, "max_tokens",
     "invalid_value"),
    ("temperature_high", CHAT_URL, {"messages": _MSG, "temperature": 5}, 400, "temperature", "invalid_value"),
    ("temperature_negative", COMPLETIONS_URL, {"prompt": "the", "temperature": -0.1}, 400, "temperature",
     "invalid_value"),
    ("top_p_zero", CHAT_URL, {"messages": _MSG, "top_p": 0}, 400, "top_p", "invalid_value"),
    ("n_zero", CHAT_URL, {"messages": _MSG, "n": 0}, 400, "n", "invalid_value"),
    ("empty_messages", CHAT_URL, {"messages": []}, 400, "messages", "invalid_value"),
    ("missing_messages", CHAT_URL, {"model": SERVED}, 400, "messages", "missing_required_parameter"),
    ("bad_role", CHAT_URL, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role",
     "invalid_value"),
    ("temperature_string", CHAT_URL, {"messages": _MSG, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("max_tokens_string", CHAT_URL, {"messages": _MSG, "max_tokens": "5"}, 400, "max_tokens", "invalid_type"),
    ("stream_string", CHAT_URL, {"messages": _MSG, "stream": "yes"}, 400, "stream", "invalid_type"),
    ("messages_not_list", CHAT_URL, {"messages": "hello"}, 400, "messages", "invalid_type"),
    ("prompt_number", COMPLETIONS_URL, {"prompt": 5}, 400, "prompt", "invalid_type"),
    ("empty_prompt", COMPLETIONS_URL, {"prompt": ""}, 400, "prompt", "invalid_value"),
    ("token_id_out_of_vocab", COMPLETIONS_URL, {"prompt": [1, 10**6]}, 400, "prompt", "invalid_value"),
    ("non_json", CHAT_URL, b"{this is not json", 400, None, "invalid_json"),
    ("json_array_body", CHAT_URL, b"[1, 2, 3]", 400, None, "invalid_type"),
    ("empty_body", COMPLETIONS_URL, b"", 400, None, "invalid_json"),
    ("n_above_max_num_seqs", CHAT_URL, {"messages": _MSG, "n": MAX_NUM_SEQS + 1}, 400, "n", "invalid_value"),
    ("negative_seed", CHAT_URL, {"messages": _MSG, "seed": -1}, 400, "seed", "invalid_value"),
    ("bad_top_k", CHAT_URL, {"messages": _MSG, "top_k": -7}, 400, "top_k", "invalid_value"),
    ("empty_stop_string", COMPLETIONS_URL, {"prompt": "the", "stop": [""]}, 400, "stop", "invalid_value"),
    ("stream_options_without_stream", CHAT_URL, {"messages": _MSG, "stream_options": {"include_usage": True}},
     400, "stream_options", "invalid_value"),
    # found by a new-user pass: whole-request checks name their field, non-text parts and mixed prompt
    # lists say what is accepted, a non-UTF-8 body is invalid JSON, and megabytes of prompt text are
    # rejected from their length (not tokenized on the engine thread first)
    ("best_of_not_n", COMPLETIONS_URL, {"prompt": "the", "best_of": 3}, 400, "best_of", "invalid_value"),
    ("image_content_part", CHAT_URL, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages.0.content",
     "invalid_value"),
    ("mixed_prompt_list", COMPLETIONS_URL, {"prompt": ["the", 5]}, 400, "prompt", "invalid_value"),
    ("non_utf8_body", COMPLETIONS_URL, b"\xff\xfe{", 400, None, "invalid_json"),
    ("megabytes_of_prompt_text", COMPLETIONS_URL, {"prompt": "water " * 200_000}, 400, "prompt",
     "context_length_exceeded"),
    ("megabytes_of_chat_text", CHAT_URL, {"messages": [{"role": "user", "content": "water " * 200_000}]}, 400,
     "messages", "context_length_exceeded"),
    ("logprobs_unsupported", CHAT_URL, {"messages": _MSG, "logprobs": True}, 400, "logprobs", "invalid_value"),
    ("unknown_model_chat", CHAT_URL, {"model": "gpt-17", "messages": _MSG}, 404, "model", "model_not_found"),
    ("unknown_model_completion", COMPLETIONS_URL, {"model": "gpt-17", "prompt": "the"}, 404, "model",
     "model_not_found"),
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_cases(server, case):
    _, url, body, status, param, code = case
    if isinstance(body, bytes):
        r = server.http.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = server.http.post(url, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param and err["code"] == code, err
    server.assert_alive()


def test_error_messages_say_what_is_accepted(server):
    r = server.http.post(COMPLETIONS_URL, json={"prompt": ["the", 5]})
    assert "list of strings, a list of token ids" in r.json()["error"]["message"]
    r = server.http.post(CHAT_URL, json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert "only text content parts" in r.json()["error"]["message"] and "'image_url'" in r.json()["error"]["message"]
    r = server.http.post(COMPLETIONS_URL, json={"prompt": "water " * 200_000})
    assert "at least" in r.json()["error"]["message"] and str(MAX_MODEL_LEN) in r.json()["error"]["message"]


def test_form_encoded_body_is_415_naming_the_header(server):
    """``curl -d '{...}'`` without ``-H 'Content-Type: application/json'`` sends form content."""
    body = json.dumps({"model": SERVED, "prompt": "the", "max_tokens": 2})
    for ctype in ("application/x-www-form-urlencoded", "text/plain"):
        r = server.http.post(COMPLETIONS_URL, content=body, headers={"content-type": ctype})
        assert r.status_code == 415, r.text
        err = r.json()["error"]
        assert err["code"] == "unsupported_media_type" and ctype in err["message"]
        assert "application/json" in err["message"]
    r = server.http.post(COMPLETIONS_URL, content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text
    server.assert_alive()


def test_request_body_over_the_limit_is_413(server):
    from vmkv.server.app import DEFAULT_MAX_REQUEST_BYTES

    big = json.dumps({"prompt": "x" * (DEFAULT_MAX_REQUEST_BYTES + 10)}).encode()
    r = server.http.post(COMPLETIONS_URL, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"]["code"] == "request_too_large"
    assert str(DEFAULT_MAX_REQUEST_BYTES) in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the streamed size is counted
        for _ in range(DEFAULT_MAX_REQUEST_BYTES // (1 << 20) + 1):
            yield b" " * (1 << 20)
    r = server.http.post(COMPLETIONS_URL, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert server.metrics()['vmkv_http_requests_total{endpoint="/v1/completions",status="413"}'] >= 2
    server.assert_alive()
    server.wait_kv_idle()


def test_errors_through_openai_client(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model=SERVED, messages=_MSG, temperature=3)
    assert e.value.status_code == 400 and "temperature" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        server.client.chat.completions.create(model="no-such-model", messages=_MSG)
    assert "no-such-model" in e.value.message and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model=SERVED, messages=[])
    with pytest.raises(openai.BadRequestError) as e:  # streaming requests fail before the stream starts
        server.client.chat.completions.create(model=SERVED, messages=_MSG, max_tokens=-1, stream=True)
    assert e.value.body["param"] == "max_tokens"
    server.assert_alive()


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_prompt_longer_than_context(server, endpoint):
    long_text = " ".join(["water"] * 200)  # 200 tokens > MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            server.client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": long_text}])
        else:
            server.client.completions.create(model=SERVED, prompt=long_text, stream=True)
    msg = e.value.message
    assert e.value.status_code == 400 and e.value.body["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in msg
    prompt_len = int(re.search(r"prompt has (\d+) tokens", msg).group(1))
    assert prompt_len >= 200
    # prompt fits but prompt + max_tokens does not: 400 naming both lengths
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=SERVED, prompt=" ".join(["water"] * 100), max_tokens=50)
    assert "100 in the prompt" in e.value.message and "50 for the completion" in e.value.message
    server.assert_alive()
    server.wait_kv_idle()


# ---------------------------------------------------------------------------- disconnects and load
def test_client_disconnect_mid_stream_frees_kv(server):
    before = server.metrics().get('vmkv_requests_finished_total{finish_reason="abort"}', 0.0)
    body = {"model": SERVED, "messages": CHAT, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with server.slowed(0.02), httpx.Client(timeout=30) as client:
        with client.stream("POST", server.base + CHAT_URL, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(8)]  # role chunk + a few tokens (with blank separators)
            assert sum(1 for g in got if g.startswith("data: {")) >= 3
            live = server.metrics()
            assert live["vmkv_kv_used_tokens"] > 0 and live["vmkv_num_requests_running"] == 1
        # leaving the block closes the connection mid-stream
    m = server.wait_kv_idle()
    assert m["vmkv_kv_used_tokens"] == 0 and m["vmkv_kv_num_seqs"] == 0
    # abort frees the KV at once; the aborted request is reported (and counted) by the next engine step
    deadline = time.time() + 15
    while (aborted := server.metrics().get('vmkv_requests_finished_total{finish_reason="abort"}', 0.0)) \
            < before + 1:
        assert time.time() < deadline, "the aborted stream was never counted"
        time.sleep(0.02)
    assert aborted == before + 1
    server.assert_alive()


def test_client_disconnect_non_streamed_aborts(server):
    before = server.metrics().get('vmkv_requests_finished_total{finish_reason="abort"}', 0.0)
    with server.slowed(0.02), pytest.raises(httpx.TimeoutException):
        httpx.post(server.base + CHAT_URL, json={"messages": CHAT, "max_tokens": 100, "ignore_eos": True},
                   timeout=0.3)
    deadline = time.time() + 15
    while server.metrics().get('vmkv_requests_finished_total{finish_reason="abort"}', 0.0) < before + 1:
        assert time.time() < deadline, "non-streamed request was not aborted after the client left"
        time.sleep(0.05)
    server.wait_kv_idle()


def test_32_concurrent_streams(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str, int]:
        stream = await client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": f"tell me a word {i}"}], max_tokens=8,
            temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, finish, tokens = "", None, -1
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, finish, tokens

    async def main() -> list:
        async with openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0,
                                      timeout=120, http_client=None) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    steps_before = server.metrics()["vmkv_engine_steps_total"]
    results = asyncio.run(main())
    assert len(results) == 32
    assert all(finish == "length" and tokens == 8 and text for text, finish, tokens in results)
    m = server.wait_kv_idle()
    assert m["vmkv_kv_used_tokens"] == 0 and m["vmkv_num_requests_running"] == 0
    assert m["vmkv_max_concurrent_seqs"] > 1  # continuous batching across HTTP requests
    # 32 x 8 tokens in far fewer than 256 steps: requests shared steps
    assert m["vmkv_engine_steps_total"] - steps_before < 32 * 8 / 2
    assert m["vmkv_time_to_first_token_seconds_count"] >= 32
    assert m["vmkv_inter_token_latency_seconds_count"] >= 32 * 7


# ---------------------------------------------------------------------------- engine failures
FATAL = "CUDA error: an illegal memory access was encountered"


def test_fatal_engine_failure_turns_into_503_and_unhealthy(tiny_model_dir):
    """A step that raises a context-poisoning CUDA error stops the engine thread: the open stream gets an
    error event and [DONE], GET and HEAD /health and new requests answer 503 with an OpenAI error body
    naming the cause, and the HTTP server stays up."""
    srv = RunningServer(tiny_model_dir, "paged")
    try:
        srv.assert_alive()
        srv.call(fail_steps, FATAL, 3)
        body = {"messages": CHAT, "max_tokens": 50, "ignore_eos": True, "stream": True}
        with srv.http.stream("POST", CHAT_URL, json=body) as r:
            assert r.status_code == 200
            events = sse_events(r.read().decode())
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][len("data: "):])["error"]
        assert err["type"] == "service_unavailable" and FATAL in err["message"]
        health = srv.http.get("/health")
        assert health.status_code == 503 and FATAL in health.json()["error"]["message"]
        assert "restart" in health.json()["error"]["message"]
        head = srv.http.head("/health")
        assert head.status_code == 503 and head.content == b""
        with pytest.raises(openai.InternalServerError) as e:
            srv.client.chat.completions.create(model=SERVED, messages=_MSG, max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "engine_unavailable"
        assert srv.http.get("/v1/models").status_code == 200  # HTTP side still answers
        assert srv.http.get("/metrics").status_code == 200
    finally:
        srv.stop()


def test_a_failed_request_gets_an_error_reply_and_the_server_runs_on(tiny_model_dir):
    """An ordinary exception while the engine works on a request fails the requests concerned (a 500
    error body, or an error event and [DONE] on a stream); the engine, /health and later requests are fine."""
    srv = RunningServer(tiny_model_dir, "paged")
    try:
        srv.call(fail_steps, "simulated bad request", 0, 1)
        with srv.http.stream("POST", CHAT_URL, json={"messages": CHAT, "max_tokens": 5, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(r.read().decode())
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][len("data: "):])["error"]
        assert err["code"] == "internal_error" and "simulated bad request" in err["message"]
        srv.wait_kv_idle()
        deadline = time.time() + 15  # no step left to run (it would take the failure meant for the next one)
        while srv.call(has_unfinished_requests):
            assert time.time() < deadline, "the failed request never left the engine"
            time.sleep(0.02)
        srv.call(fail_steps, "simulated bad request", 0, 1)
        r = srv.http.post(CHAT_URL, json={"messages": CHAT, "max_tokens": 5})
        assert r.status_code == 500 and "simulated bad request" in r.json()["error"]["message"]
        assert srv.http.get("/health").status_code == 200
        srv.assert_alive()
        srv.wait_kv_idle()
    finally:
        srv.stop()


# ---------------------------------------------------------------------------- pieces, no server
def test_request_models_are_strict_and_bounded():
    from pydantic import ValidationError

    from vmkv.server.protocol import ChatCompletionRequest, CompletionRequest

    ok = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_tokens": 3, "max_completion_tokens": 5,
        "temperature": 0, "stop": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert ok.requested_max_tokens == 5 and ok.stop_list == ["x"] and ok.include_usage
    assert ok.message_dicts() == [{"role": "user", "content": "a\nb"}]
    assert CompletionRequest.model_validate({"prompt": [[1, 2], [3]]}).prompts() == [[1, 2], [3]]
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompts() == [[1, 2]]
    for bad in ({"prompt": "x", "temperature": "1"}, {"prompt": "x", "n": 1.5}, {"prompt": "x", "stream": 1},
                {"prompt": "x", "stop": ["a"] * 17}, {"prompt": "x", "presence_penalty": 2.5},
                {"prompt": [[]]}, {"prompt": "x", "best_of": 3}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(bad)


def test_validation_message_names_the_field():
    from vmkv.server.errors import validation_message

    msg, param, code = validation_message([{"type": "less_than_equal", "loc": ("body", "temperature"),
                                            "msg": "Input should be less than or equal to 2", "input": 5}])
    assert (param, code) == ("temperature", "invalid_value") and msg == \
        "temperature: Input should be less than or equal to 2 (got 5)"
    msg, param, code = validation_message([
        {"type": "string_type", "loc": ("body", "messages", 0, "content", "str"), "msg": "Input should be a valid string",
         "input": 3},
        {"type": "list_type", "loc": ("body", "messages", 0, "content", "list[TextContentPart]"),
         "msg": "Input should be a valid list", "input": 3}])
    assert param == "messages.0.content" and code == "invalid_type" and msg.count("messages.0.content") == 1
    # a model-level check has no location: its message's leading field name is the param
    assert validation_message([{"type": "value_error", "loc": ("body",), "msg": "Value error, best_of: only 1",
                                "input": {}}])[1] == "best_of"
    assert validation_message([{"type": "value_error", "loc": ("body",), "msg": "Value error, oops",
                                "input": {}}])[1] is None
    assert validation_message([{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error",
                                "ctx": {"error": "Expecting value"}}])[2] == "invalid_json"


def test_parse_size_and_cli_defaults_from_config():
    import argparse

    from vmkv.engine.args import engine_kwargs, parse_size
    from vmkv.engine.config import CacheConfig, SchedulerConfig
    from vmkv.server.cli import add_arguments

    assert parse_size("4096") == 4096 and parse_size("2MiB") == 2 << 20 and parse_size("1.5GB") == 1_500_000_000
    for bad in ("", "12 parsecs", "0", "-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.host, args.port, args.backend) == ("127.0.0.1", 8000, CacheConfig().backend)
    assert args.max_num_seqs == SchedulerConfig().max_num_seqs
    assert args.max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens
    assert args.block_size == CacheConfig().block_size and args.layout == CacheConfig().layout
    kw = engine_kwargs(parser.parse_args(["--backend", "vmem", "--memory-bytes", "64MiB", "--page-size-bytes",
                                          "128KiB", "--no-enable-prefix-caching"]))
    assert kw["kv_backend"] == "vmem" and kw["memory_bytes"] == 64 << 20 and kw["page_size_bytes"] == 128 << 10
    assert kw["enable_prefix_caching"] is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--memory-bytes", "1GiB", "--gpu-memory-utilization", "0.5"])
