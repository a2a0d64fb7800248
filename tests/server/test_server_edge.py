"""Regression tests for the HTTP edge defects of issue 9, each against the real server.

One request must never be able to hurt the others: every sampling parameter is range-checked at the edge,
fields that would change the result but are not implemented are refused, lone surrogates and null
content are 400s, ``cache_salt`` isolates tenants in the prefix cache, oversized bodies are refused from
their header, slow clients are disconnected, a shutdown answers what it cuts short, and ``/health``
answers HEAD (as ``/v1/models`` does) and says why the engine cannot serve.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from server_helpers import (
    CHAT,
    CHAT_URL,
    COMPLETIONS_URL,
    SERVED,
    WORDS,
    RunningServer,
    ServerProcess,
    post_json,
    sse_events,
)

_MSG = [{"role": "user", "content": "hello"}]
INT32_MAX = 2**31 - 1


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ---------------------------------------------------------------------------- sampling parameter ranges
RANGE_CASES = [
    # (id, url, body, param, text the message must contain)
    ("top_k_2_pow_63", CHAT_URL, {"messages": _MSG, "top_k": 2**63}, "top_k", f"[1, {INT32_MAX}]"),
    ("top_k_2_pow_31", COMPLETIONS_URL, {"prompt": "the", "top_k": 2**31}, "top_k", "-1 or 0"),
    ("top_k_minus_2", CHAT_URL, {"messages": _MSG, "top_k": -2}, "top_k", "-1 or 0"),
    ("n_huge", CHAT_URL, {"messages": _MSG, "n": 10**6}, "n", "[1, 64]"),
    ("best_of_zero", COMPLETIONS_URL, {"prompt": "the", "best_of": 0}, "best_of", "[1, 64]"),
    ("max_tokens_2_pow_31", COMPLETIONS_URL, {"prompt": "the", "max_tokens": 2**31}, "max_tokens",
     f"[1, {INT32_MAX}]"),
    ("max_completion_tokens_zero", CHAT_URL, {"messages": _MSG, "max_completion_tokens": 0},
     "max_completion_tokens", "[1,"),
    ("temperature_nan", CHAT_URL, {"messages": _MSG, "temperature": float("nan")}, "temperature", "[0, 2]"),
    ("temperature_inf", CHAT_URL, {"messages": _MSG, "temperature": float("inf")}, "temperature", "[0, 2]"),
    ("top_p_above_1", COMPLETIONS_URL, {"prompt": "the", "top_p": 1.5}, "top_p", "(0, 1]"),
    ("min_p_above_1", CHAT_URL, {"messages": _MSG, "min_p": 2}, "min_p", "[0, 1]"),
    ("presence_penalty_3", CHAT_URL, {"messages": _MSG, "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ("frequency_penalty_minus_3", CHAT_URL, {"messages": _MSG, "frequency_penalty": -3}, "frequency_penalty",
     "[-2, 2]"),
    ("repetition_penalty_zero", CHAT_URL, {"messages": _MSG, "repetition_penalty": 0}, "repetition_penalty",
     "(0, inf)"),
    ("repetition_penalty_inf", CHAT_URL, {"messages": _MSG, "repetition_penalty": float("inf")},
     "repetition_penalty", "(0, inf)"),
    ("min_tokens_negative", CHAT_URL, {"messages": _MSG, "min_tokens": -1}, "min_tokens", f"[0, {INT32_MAX}]"),
    ("min_tokens_above_max_tokens", COMPLETIONS_URL, {"prompt": "the", "max_tokens": 3, "min_tokens": 4},
     "min_tokens", "at most max_tokens=3"),
    ("logit_bias_101", CHAT_URL, {"messages": _MSG, "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ("logit_bias_key_not_an_id", CHAT_URL, {"messages": _MSG, "logit_bias": {"x5": 1}}, "logit_bias",
     "decimal strings"),
    ("logit_bias_outside_vocab", COMPLETIONS_URL, {"prompt": "the", "logit_bias": {"5000": 1}}, "logit_bias",
     "vocabulary"),
    ("seed_2_pow_64", CHAT_URL, {"messages": _MSG, "seed": 2**64}, "seed", "[0, 9223372036854775807]"),
    ("top_logprobs_21", CHAT_URL, {"messages": _MSG, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ("stop_token_id_negative", CHAT_URL, {"messages": _MSG, "stop_token_ids": [-1]}, "stop_token_ids.0",
     f"[0, {INT32_MAX}]"),
    ("stop_token_id_2_pow_63", CHAT_URL, {"messages": _MSG, "stop_token_ids": [2, 2**63]}, "stop_token_ids.1",
     f"[0, {INT32_MAX}]"),
    ("stop_token_id_outside_vocab", CHAT_URL, {"messages": _MSG, "stop_token_ids": [5000]}, "stop_token_ids",
     "vocabulary"),
    ("too_many_stop_token_ids", CHAT_URL, {"messages": _MSG, "stop_token_ids": [1] * 1025}, "stop_token_ids",
     "1024"),
    ("stop_string_too_long", COMPLETIONS_URL, {"prompt": "the", "stop": "x" * 1025}, "stop", "1024"),
    ("too_many_stop_strings", COMPLETIONS_URL, {"prompt": "the", "stop": ["a"] * 17}, "stop", "16"),
    ("prompt_token_id_2_pow_40", COMPLETIONS_URL, {"prompt": [1, 2**40]}, "prompt", f"[0, {INT32_MAX}]"),
]


@pytest.mark.parametrize("case", RANGE_CASES, ids=[c[0] for c in RANGE_CASES])
def test_every_sampling_parameter_is_range_checked_at_the_edge(server, case):
    """top_k = 2**63 used to kill the engine thread (every request, then /health, got 503)."""
    _, url, body, param, text = case
    err = _error(post_json(server.http, url, body))
    assert (err["param"], err["code"], err["type"]) == (param, "invalid_value", "invalid_request_error"), err
    assert text in err["message"] and err["message"].startswith(param.split(".")[0]), err["message"]
    server.assert_alive()


def test_a_rejected_value_is_named_once(server):
    err = _error(post_json(server.http, CHAT_URL, {"messages": _MSG, "top_logprobs": 3}))
    assert err["param"] == "top_logprobs" and "not supported" in err["message"]
    assert err["message"].count("3") == 1, err["message"]  # was "got 3 (got 3)"
    err = _error(post_json(server.http, CHAT_URL, {"messages": _MSG, "top_k": 2**63}))
    assert err["message"].count(str(2**63)) == 1, err["message"]


def test_in_range_extensions_and_neutral_values_are_accepted(server):
    body = {"messages": _MSG, "max_tokens": 2, "top_k": INT32_MAX, "seed": 2**63 - 1, "min_p": 0,
            "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {},
            "response_format": {"type": "text"}, "tool_choice": "none", "tools": [], "top_logprobs": 0,
            "logprobs": False, "user": "u-1", "metadata": {"k": "v"}, "store": False,
            "stop_token_ids": [3], "stream": False, "n": 1}
    r = post_json(server.http, CHAT_URL, body)
    assert r.status_code == 200, r.text
    r = post_json(server.http, COMPLETIONS_URL, {"prompt": "the", "max_tokens": 2, "top_k": -1, "best_of": 1,
                                                 "echo": True, "min_tokens": 0, "suffix": None})
    assert r.status_code == 200, r.text


def test_vllm_sampling_fields_are_accepted(server):
    """Refused with "not supported" before issue 25 (item 1); now run by the sampler."""
    body = {"messages": _MSG, "max_tokens": 4, "temperature": 0, "min_tokens": 2, "min_p": 0.1,
            "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": -0.5,
            "logit_bias": {"5": 100, "6": -100.0}, "include_stop_str_in_output": True, "stop": ["x"]}
    r = post_json(server.http, CHAT_URL, body)
    assert r.status_code == 200, r.text
    r = post_json(server.http, COMPLETIONS_URL, {"prompt": "the", "max_tokens": 3, "min_tokens": 3,
                                                 "logit_bias": {"5": 100}, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [5, 5, 5]      # a bias of 100 wins every step
    server.assert_alive()


# ---------------------------------------------------------------------------- unsupported fields
UNSUPPORTED_CASES = [
    # (id, url, body, param); each would change the result and is not implemented
    ("response_format_json", CHAT_URL, {"messages": _MSG, "response_format": {"type": "json_object"}},
     "response_format"),
    ("response_format_schema", COMPLETIONS_URL, {"prompt": "the", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ("tool_choice_auto", CHAT_URL, {"messages": _MSG, "tool_choice": "auto"}, "tool_choice"),
    ("tool_choice_function", CHAT_URL, {"messages": _MSG, "tool_choice": {"type": "function",
                                                                          "function": {"name": "f"}}}, "tool_choice"),
    ("functions", CHAT_URL, {"messages": _MSG, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("function_call", CHAT_URL, {"messages": _MSG, "function_call": "auto"}, "function_call"),
    ("tools", CHAT_URL, {"messages": _MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("logprobs_chat", CHAT_URL, {"messages": _MSG, "logprobs": True}, "logprobs"),
    ("top_logprobs", CHAT_URL, {"messages": _MSG, "top_logprobs": 3}, "top_logprobs"),
    ("logprobs_completion", COMPLETIONS_URL, {"prompt": "the", "logprobs": 2}, "logprobs"),
    ("prompt_logprobs", COMPLETIONS_URL, {"prompt": "the", "prompt_logprobs": 1}, "prompt_logprobs"),
    ("suffix", COMPLETIONS_URL, {"prompt": "the", "suffix": "end"}, "suffix"),
    ("echo_chat", CHAT_URL, {"messages": _MSG, "echo": True}, "echo"),
    ("guided_json", CHAT_URL, {"messages": _MSG, "guided_json": {"type": "object"}}, "guided_json"),
    ("guided_choice", COMPLETIONS_URL, {"prompt": "the", "guided_choice": ["a", "b"]}, "guided_choice"),
    ("guided_regex", CHAT_URL, {"messages": _MSG, "guided_regex": "a+"}, "guided_regex"),
    ("structured_outputs", CHAT_URL, {"messages": _MSG, "structured_outputs": {"choice": ["a"]}},
     "structured_outputs"),
    ("use_beam_search", COMPLETIONS_URL, {"prompt": "the", "use_beam_search": True}, "use_beam_search"),
    ("bad_words", CHAT_URL, {"messages": _MSG, "bad_words": ["the"]}, "bad_words"),
    ("allowed_token_ids", CHAT_URL, {"messages": _MSG, "allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("truncate_prompt_tokens", COMPLETIONS_URL, {"prompt": "the", "truncate_prompt_tokens": 2},
     "truncate_prompt_tokens"),
    ("audio", CHAT_URL, {"messages": _MSG, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("modalities_audio", CHAT_URL, {"messages": _MSG, "modalities": ["text", "audio"]}, "modalities"),
    ("web_search_options", CHAT_URL, {"messages": _MSG, "web_search_options": {}}, "web_search_options"),
    ("chat_template", CHAT_URL, {"messages": _MSG, "chat_template": "{{ messages }}"}, "chat_template"),
    ("continue_final_message", CHAT_URL, {"messages": _MSG, "continue_final_message": True},
     "continue_final_message"),
    ("add_generation_prompt_false", CHAT_URL, {"messages": _MSG, "add_generation_prompt": False},
     "add_generation_prompt"),
    ("message_tool_calls", CHAT_URL, {"messages": [*_MSG, {"role": "assistant", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.1.tool_calls"),
    ("best_of_above_n", COMPLETIONS_URL, {"prompt": "the", "best_of": 2}, "best_of"),
]


@pytest.mark.parametrize("case", UNSUPPORTED_CASES, ids=[c[0] for c in UNSUPPORTED_CASES])
def test_fields_that_would_change_the_result_are_refused(server, case):
    """response_format, tool_choice and functions used to be accepted with 200 and silently ignored."""
    _, url, body, param = case
    err = _error(post_json(server.http, url, body))
    assert err["param"] == param and err["code"] == "invalid_value", err
    assert "not supported" in err["message"] or "only best_of == n" in err["message"], err["message"]
    # the value sent is named too, dicts and lists included (cut to 80 characters)
    assert "(got " in err["message"], err["message"]
    if param == "response_format" and url == CHAT_URL:
        assert '{"type": "json_object"}' in err["message"], err["message"]


# ---------------------------------------------------------------------------- lone surrogates
SURROGATE_CASES = [
    ("chat_content", CHAT_URL, {"messages": [{"role": "user", "content": "a \ud800 b"}]}, "messages.0.content"),
    ("chat_content_part", CHAT_URL, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "\udfff"}]}]}, "messages.0.content.1.text"),
    ("chat_name", CHAT_URL, {"messages": [{"role": "user", "content": "x", "name": "\ud800"}]}, "messages.0.name"),
    ("completion_prompt", COMPLETIONS_URL, {"prompt": "the \ud800"}, "prompt"),
    ("prompt_list_element", COMPLETIONS_URL, {"prompt": ["the", "a \udc00"]}, "prompt"),
    ("model", CHAT_URL, {"model": "\ud800", "messages": _MSG}, "model"),
    ("model_completion", COMPLETIONS_URL, {"model": "x\ud800", "prompt": "the"}, "model"),
    ("stop_string", COMPLETIONS_URL, {"prompt": "the", "stop": ["ok", "\ud800"]}, "stop"),
    ("cache_salt", CHAT_URL, {"messages": _MSG, "cache_salt": "\ud800"}, "cache_salt"),
    ("user", CHAT_URL, {"messages": _MSG, "user": "\ud800"}, "user"),
]


@pytest.mark.parametrize("case", SURROGATE_CASES, ids=[c[0] for c in SURROGATE_CASES])
def test_lone_surrogates_are_400_naming_the_field(server, case):
    """They used to be HTTP 500 (a TypeError in the tokenizer, a UnicodeEncodeError rendering the 404)."""
    _, url, body, param = case
    err = _error(post_json(server.http, url, body))
    assert err["param"] == param and err["code"] == "invalid_value", err
    assert "surrogate" in err["message"], err["message"]
    server.assert_alive()


def test_surrogate_pairs_are_fine(server):
    r = post_json(server.http, COMPLETIONS_URL, {"prompt": "the \U0001F600", "max_tokens": 1})  # a pair in JSON
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------- null content
@pytest.mark.parametrize("role", ["user", "system"])
def test_null_content_is_400(server, role):
    """``"content": null`` used to be accepted and generate until the context was full."""
    messages = [{"role": role, "content": None}] + ([] if role == "user" else _MSG)
    err = _error(post_json(server.http, CHAT_URL, {"messages": messages}))
    assert err["param"] == "messages.0.content"
    assert "expected a string or array of objects, but got null" in err["message"], err["message"]
    err = _error(post_json(server.http, CHAT_URL, {"messages": [{"role": role}]}))  # missing: the same
    assert err["param"] == "messages.0.content"


def test_assistant_null_content_needs_tool_calls_which_are_unsupported(server):
    messages = [*_MSG, {"role": "assistant", "content": None}, *_MSG]
    err = _error(post_json(server.http, CHAT_URL, {"messages": messages}))
    assert err["param"] == "messages.1.content" and "tool_calls" in err["message"]


# ---------------------------------------------------------------------------- cache_salt
def test_cache_salt_isolates_tenants_in_the_prefix_cache(server):
    """cache_salt used to be accepted and dropped, so tenant B got tenant A's cached prefix."""
    prompt = " ".join(WORDS[7 + i] for i in range(40))  # 40 tokens: two full 16-token blocks / pages

    def cached(url: str, salt: str | None) -> int:
        body = {"prompt": prompt} if url == COMPLETIONS_URL else {"messages": [{"role": "user", "content": prompt}]}
        body.update(max_tokens=1, **({"cache_salt": salt} if salt is not None else {}))
        r = post_json(server.http, url, body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    for url in (COMPLETIONS_URL, CHAT_URL):
        assert cached(url, "tenant-a") == 0
        assert cached(url, "tenant-b") == 0      # same prompt, another tenant: no hit
        assert cached(url, None) == 0            # unsalted requests are a namespace of their own
        assert cached(url, "tenant-a") >= 32     # same tenant: its own prefix is a hit
        assert cached(url, "tenant-b") >= 32
    server.wait_kv_idle()


@pytest.mark.parametrize("salt, code", [("", "invalid_value"), (5, "invalid_type"), ([], "invalid_type")])
def test_cache_salt_must_be_a_non_empty_string(server, salt, code):
    for url, body in ((CHAT_URL, {"messages": _MSG}), (COMPLETIONS_URL, {"prompt": "the"})):
        err = _error(post_json(server.http, url, {**body, "cache_salt": salt}))
        assert (err["param"], err["code"]) == ("cache_salt", code), err


# ---------------------------------------------------------------------------- body parsing messages
def test_missing_content_type_says_so(server):
    """A valid object without Content-Type used to get "request body must be a JSON object"."""
    r = server.http.post(COMPLETIONS_URL, content=json.dumps({"prompt": "the", "max_tokens": 1}).encode())
    err = _error(r, 415)
    assert err["code"] == "unsupported_media_type" and "Content-Type" in err["message"]
    assert "missing" in err["message"] and "application/json" in err["message"]


@pytest.mark.parametrize("body, text", [
    (b'{"prompt": "the", "max_tokens": ' + b"1" * 5000 + b"}", "digits"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"prompt": "the \xff"}', "not UTF-8"),
], ids=["5000_digit_integer", "100k_deep_nesting", "not_utf8"])
def test_unparsable_bodies_say_why(server, body, text):
    """The first two used to say "not valid JSON (not UTF-8 text)"."""
    err = _error(server.http.post(COMPLETIONS_URL, content=body, headers={"content-type": "application/json"}))
    assert err["code"] == "invalid_json" and text in err["message"], err["message"]
    if text != "not UTF-8":
        assert "UTF-8" not in err["message"]


# ---------------------------------------------------------------------------- /health
def test_head_health_answers_like_get(server):
    r = server.http.head("/health")
    assert r.status_code == 200 and r.content == b""
    assert server.http.get("/health").json() == {"status": "ok"}


def test_head_models_answers_like_get(server):
    """HEAD /v1/models was 405 while HEAD /health was 200 (issue 25, item 6)."""
    r = server.http.head("/v1/models")
    assert r.status_code == 200 and r.content == b"" and r.headers["content-type"] == "application/json"
    assert server.http.get("/v1/models").json()["data"][0]["id"] == SERVED


def test_openapi_schema_has_unique_operation_ids():
    """/openapi.json made FastAPI warn "Duplicate Operation ID" (one id for the GET and HEAD of /health)."""
    import warnings

    from vmkv.server.app import build_app
    from vmkv.server.async_engine import AsyncEngine

    app = build_app(AsyncEngine({}), SERVED)          # never started: the schema needs no engine
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schema = app.openapi()
    assert not [w for w in caught if "Duplicate Operation ID" in str(w.message)], [str(w.message) for w in caught]
    ops = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(ops) == len(set(ops)) and {"health", "health_head", "list_models", "list_models_head"} <= set(ops)
    assert set(schema["paths"]["/v1/models"]) == {"get", "head"} and set(schema["paths"]["/health"]) == {"get", "head"}


# ---------------------------------------------------------------------------- raw connections
def _raw(server: RunningServer, data: bytes, timeout_s: float = 20.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it (fails on timeout)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout_s) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):  # socket.timeout (a test failure) if the server keeps it open
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("body_sent", [b"", b'{"prompt": "'], ids=["no_body", "some_body"])
def test_declared_oversized_body_gets_413_from_the_header_then_close(server, body_sent):
    """A client declaring a huge body and sending nothing used to get no reply at all."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000000\r\n\r\n")
    reply = _raw(server, head + body_sent)  # the server closes the connection after its reply
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413"), reply[:300]
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert b"connection: close" in headers.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and "1000000000000 bytes" in err["message"]
    server.assert_alive()


def test_a_client_that_never_finishes_its_headers_is_disconnected(tiny_model_dir):
    srv = RunningServer(tiny_model_dir, "paged", header_timeout_s=1.0)
    try:
        assert _raw(srv, b"") == b""  # connects, sends nothing: closed, no reply
        assert _raw(srv, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ") == b""  # an unfinished head
        # a keep-alive connection: the next request head has a deadline too
        with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while not reply.endswith(b'{"status":"ok"}'):
                reply += sock.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            assert sock.recv(65536) == b""
        # the deadline is for the head only: a request running for longer than it is answered
        with srv.slowed(0.05):
            started = time.monotonic()
            r = srv.http.post(CHAT_URL, json={"messages": _MSG, "max_tokens": 40, "ignore_eos": True})
        assert r.status_code == 200 and time.monotonic() - started > 1.0
        srv.assert_alive()
    finally:
        srv.stop()


def test_header_timeout_is_a_serve_option():
    import argparse

    from vmkv.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).header_timeout == 30.0
    assert parser.parse_args(["--header-timeout", "2.5"]).header_timeout == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--header-timeout", bad])


# ---------------------------------------------------------------------------- shutdown
@pytest.mark.slow
def test_cli_serve_and_sigterm_answers_requests_still_running(tiny_model_dir):
    """``vmkv serve`` serves, and on SIGTERM the requests still running after the graceful timeout get
    a reply: they used to get HTTP 499 with an empty body (non-streamed) or be cut without a finish
    reason or [DONE] (streams), with a CancelledError traceback per stream in the log."""
    srv = ServerProcess(tiny_model_dir, "--graceful-timeout", "1", step_delay_s=0.05)  # 100 tokens: ~5 s
    try:
        r = httpx.post(srv.base + CHAT_URL, json={"model": SERVED, "messages": CHAT, "max_tokens": 3,
                                                  "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        body = {"messages": CHAT, "max_tokens": 100, "ignore_eos": True}
        replies: list[httpx.Response] = []
        plain = threading.Thread(target=lambda: replies.append(httpx.post(srv.base + CHAT_URL, json=body,
                                                                           timeout=60)))
        plain.start()
        with httpx.stream("POST", srv.base + CHAT_URL, json={**body, "stream": True}, timeout=60) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: {")
            deadline = time.time() + 30  # both requests are in the engine before the signal
            while "vmkv_num_requests_running 2.0" not in httpx.get(srv.base + "/metrics").text:
                assert time.time() < deadline, "the two requests never ran together"
                time.sleep(0.05)
            srv.proc.send_signal(signal.SIGTERM)
            events = [line for line in lines if line]
        plain.join(timeout=60)
        out, _ = srv.proc.communicate(timeout=60)
        assert events[-1] == "data: [DONE]", events[-3:]
        last = json.loads(events[-2][len("data: "):])
        assert last["error"]["type"] == "service_unavailable" and "shutting down" in last["error"]["message"]
        (reply,) = replies
        err = _error(reply, 503)
        assert err["code"] == "engine_unavailable" and "shutting down" in err["message"]
        assert srv.proc.returncode == 0, out
        assert "Traceback" not in out and "CancelledError" not in out, out
        assert "still running after the graceful timeout" in out
        assert "listening on http://127.0.0.1" in out and "vmkv serve: stopped (SIGTERM)" in out
    finally:
        srv.kill()


# ---------------------------------------------------------------------------- adversarial follow-ups
from server_helpers import MAX_NUM_SEQS  # noqa: E402

PROMPT_SHAPES = [
    # (id, body, choices expected)
    ("str", {"prompt": "the cat"}, 1),
    ("str_n2", {"prompt": "the cat", "n": 2}, 2),
    ("list_of_one_str", {"prompt": ["Hello"]}, 1),
    ("list_of_str", {"prompt": ["Hello", "the cat"]}, 2),
    ("list_of_str_n2_stop", {"prompt": ["Hello", "the cat"], "n": 2, "stop": ["zzz"]}, 4),
    ("list_of_str_stop_str", {"prompt": ["Hello", "a"], "stop": "zzz"}, 2),
    ("token_ids", {"prompt": [1, 2, 3]}, 1),
    ("token_ids_n3", {"prompt": [1, 2, 3], "n": 3}, 3),
    ("token_id_lists", {"prompt": [[1, 2], [3]]}, 2),
    ("token_id_lists_n2", {"prompt": [[1, 2], [3]], "n": 2, "stop": ["zzz"]}, 4),
]


@pytest.mark.parametrize("body, num_choices", [c[1:] for c in PROMPT_SHAPES], ids=[c[0] for c in PROMPT_SHAPES])
def test_every_valid_prompt_shape_is_served(server, body, num_choices):
    """A list of strings used to fall into the token-id check and get HTTP 500 (int <= str)."""
    r = post_json(server.http, COMPLETIONS_URL, {**body, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(num_choices))


def test_prompts_times_n_is_capped_by_max_num_seqs(server):
    """``[[1]] * 1000`` with ``n`` 64 (5 KB) used to make 64,000 sequences and block everyone for minutes."""
    err = _error(post_json(server.http, COMPLETIONS_URL, {"prompt": [[1]] * 1000, "n": 64, "max_tokens": 1}))
    assert err["param"] == "prompt" and err["code"] == "invalid_value"
    assert "1000 prompts x n=64 = 64000" in err["message"] and f"max_num_seqs={MAX_NUM_SEQS}" in err["message"]
    err = _error(post_json(server.http, COMPLETIONS_URL, {"prompt": ["a"] * (MAX_NUM_SEQS + 1), "max_tokens": 1}))
    assert err["param"] == "prompt"
    err = _error(post_json(server.http, COMPLETIONS_URL, {"prompt": "a", "n": MAX_NUM_SEQS + 1}))
    assert err["param"] == "n"
    r = post_json(server.http, COMPLETIONS_URL, {"prompt": [[1]] * (MAX_NUM_SEQS // 2), "n": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_NUM_SEQS
    server.assert_alive()


def test_cache_salt_length_is_capped(server):
    from vmkv.server.protocol import MAX_CACHE_SALT_CHARS

    err = _error(post_json(server.http, COMPLETIONS_URL, {"prompt": "the", "max_tokens": 1,
                                                          "cache_salt": "x" * (MAX_CACHE_SALT_CHARS + 1)}))
    assert err["param"] == "cache_salt" and f"at most {MAX_CACHE_SALT_CHARS} characters" in err["message"]
    r = post_json(server.http, COMPLETIONS_URL, {"prompt": "the", "max_tokens": 1,
                                                 "cache_salt": "x" * MAX_CACHE_SALT_CHARS})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("url, body", [
    (COMPLETIONS_URL, {"prompt": "the", "n": None, "stream": None, "ignore_eos": None, "echo": None,
                       "max_tokens": None, "skip_special_tokens": None, "stream_options": None, "best_of": None}),
    (CHAT_URL, {"messages": _MSG, "n": None, "stream": None, "ignore_eos": None, "max_tokens": 2,
                "skip_special_tokens": None, "logprobs": None, "temperature": None, "top_p": None}),
], ids=["completions", "chat"])
def test_null_means_the_default(server, url, body):
    r = post_json(server.http, url, body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


def test_null_text_part_names_the_text_field(server):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}
    err = _error(post_json(server.http, CHAT_URL, body))
    assert err["param"] == "messages.0.content.0.text", err
    assert _error(post_json(server.http, CHAT_URL, {"messages": [{"role": "user", "content": 5}]}))["param"] == \
        "messages.0.content"


@pytest.fixture(scope="module")
def quick_timeout_server(tiny_model_dir):
    srv = RunningServer(tiny_model_dir, "paged", header_timeout_s=1.0, body_timeout_s=1.0)
    yield srv
    srv.stop()


_POST_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_a_body_that_never_completes_gets_408_then_close(quick_timeout_server):
    """A declared body sent slowly (or never) used to hold the connection for good: the header deadline
    stopped once the head was parsed."""
    srv = quick_timeout_server
    for data in (_POST_HEAD + b"Content-Length: 100\r\n\r\n{",
                 _POST_HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n"):  # chunked, no last chunk
        started = time.monotonic()
        reply = _raw(srv, data)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"connection: close" in reply.lower()
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        assert 0.9 < time.monotonic() - started < 10
    # trickling bytes do not extend the deadline
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as sock:
        sock.sendall(_POST_HEAD + b"Content-Length: 100\r\n\r\n")
        started = time.monotonic()
        reply = b""
        while time.monotonic() - started < 5:
            try:
                sock.sendall(b" ")
            except OSError:
                break
            time.sleep(0.1)
        with __import__("contextlib").suppress(OSError):
            while chunk := sock.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 4
    srv.assert_alive()


def test_a_get_declaring_a_huge_body_is_closed(quick_timeout_server):
    """The GET is answered, and the connection, left waiting for a body, closed at the body deadline."""
    started = time.monotonic()
    reply = _raw(quick_timeout_server, b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200") and time.monotonic() - started < 10
    quick_timeout_server.assert_alive()


@pytest.mark.parametrize("data", [
    _POST_HEAD + b"Content-Length: 100\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n",
    _POST_HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"prompt\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nqq\r\n",
], ids=["cl_and_bad_chunk", "chunk_longer_than_its_size", "get_bad_chunk"])
def test_invalid_chunked_bodies_get_400_then_close(quick_timeout_server, data):
    reply = _raw(quick_timeout_server, data)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    quick_timeout_server.assert_alive()


def test_a_bad_chunk_after_the_reply_started_closes(quick_timeout_server):
    with socket.create_connection(("127.0.0.1", quick_timeout_server.port), timeout=20) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        reply = b""
        while not reply.endswith(b'{"status":"ok"}'):
            reply += sock.recv(65536)
        sock.sendall(b"qq\r\n")
        started = time.monotonic()
        while sock.recv(65536):
            pass
        assert time.monotonic() - started < 0.9  # closed for the bad chunk, not by the body deadline
    quick_timeout_server.assert_alive()


def test_body_timeout_and_port_are_checked_serve_options():
    import argparse

    from vmkv.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).body_timeout == 60.0
    assert parser.parse_args(["--body-timeout", "2.5"]).body_timeout == 2.5
    assert parser.parse_args(["--port", "0"]).port == 0 and parser.parse_args(["--port", "65535"]).port == 65535
    for flag, bad in [("--body-timeout", "0"), ("--body-timeout", "nan"), ("--port", "99999"),
                      ("--port", "-1"), ("--port", "http")]:
        with pytest.raises(SystemExit):
            parser.parse_args([flag, bad])


@pytest.fixture(scope="module")
def tokenizer_less_server():
    srv = RunningServer(None, "paged")
    yield srv
    srv.stop()


def test_return_token_ids_streams_a_chunk_per_token_for_a_model_without_text(tokenizer_less_server):
    """A random-weight model has no tokenizer: its text is empty, so without token ids a streaming
    client sees one final chunk and can time nothing (issue 12's co-location run on the H200).  With
    ``return_token_ids`` every chunk carries the new token ids; without it the JSON has no such key."""
    srv = tokenizer_less_server
    body = {"model": SERVED, "prompt": [1, 2, 3, 4, 5], "max_tokens": 5, "stream": True, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}
    r = post_json(srv.http, "/v1/completions", body)
    assert r.status_code == 200
    events = [e.removeprefix("data: ") for e in sse_events(r.text)]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert len(ids) == 5 and len([c for c in chunks if c["choices"][0].get("token_ids")]) >= 2
    full = post_json(srv.http, "/v1/completions", {**body, "stream": False}).json()
    assert full["choices"][0]["token_ids"] == ids
    plain = post_json(srv.http, "/v1/completions", {**body, "stream": False, "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0]
