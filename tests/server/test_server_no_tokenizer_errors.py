"""A model without a tokenizer (random weights): requests that need one get a 400 naming the field
that needs it (``stop`` for stop strings, ``prompt`` for a text prompt), and the server keeps serving."""

from __future__ import annotations

import pytest

from server_helpers import SERVED, RunningServer, post_json


@pytest.fixture(scope="module", params=["paged", "vmem"])
def no_tokenizer_server(request):
    srv = RunningServer(None, request.param)
    yield srv
    srv.stop()


def test_stop_strings_without_a_tokenizer_name_the_stop_field(no_tokenizer_server):
    srv = no_tokenizer_server
    r = post_json(srv.http, "/v1/completions", {"model": SERVED, "prompt": [1, 2, 3], "max_tokens": 2,
                                                "stop": ["a"]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "stop" and err["code"] == "invalid_value"
    assert "tokenizer" in err["message"] and "'a'" in err["message"] and "stop_token_ids" in err["message"]
    ok = post_json(srv.http, "/v1/completions", {"model": SERVED, "prompt": [1, 2, 3], "max_tokens": 2,
                                                 "stop_token_ids": [5]})
    assert ok.status_code == 200


def test_text_prompt_without_a_tokenizer_says_to_send_token_ids_as_prompt(no_tokenizer_server):
    srv = no_tokenizer_server
    r = post_json(srv.http, "/v1/completions", {"model": SERVED, "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and "list of token ids" in err["message"]
    assert "prompt_token_ids" not in err["message"]       # not a field of this API
    ok = post_json(srv.http, "/v1/completions", {"model": SERVED, "prompt": [1, 2], "max_tokens": 2})
    assert ok.status_code == 200
