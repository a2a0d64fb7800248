"""`vmkv bench serve` against an in-process fake OpenAI-compatible server (httpx.MockTransport)."""

import argparse
import asyncio
import json

import httpx
import pytest

from vmkv.compare import bench_cli


def _args(**kw):
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    argv = ["serve", "--base-url", "http://fake", "--model", "m", "--num-prompts", "5", "--input-len", "8",
            "--output-len", "4"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


def _fake_server(seen: list, fail_every: int = 0):
    async def stream(n_tokens: int, chat: bool):
        for i in range(n_tokens):
            await asyncio.sleep(0.002)
            choice = {"index": 0, "delta": {"content": f"t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
        usage = {"prompt_tokens": 8, "completion_tokens": n_tokens, "total_tokens": 8 + n_tokens}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        seen.append(body)
        if fail_every and len(seen) % fail_every == 0:
            return httpx.Response(400, json={"error": {"message": "bad"}})
        return httpx.Response(200, content=stream(body["max_tokens"], "messages" in body),
                              headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_requests_are_seeded_and_sized():
    a, b = bench_cli.build_requests(_args()), bench_cli.build_requests(_args())
    assert [r.meta["prompt"] for r in a] == [r.meta["prompt"] for r in b]
    assert all(len(r.meta["prompt"].split()) == 8 for r in a)
    toks = bench_cli.build_requests(_args(prompt_format="tokens", vocab_size=1000))
    assert all(len(r.meta["prompt"]) == 8 and all(100 <= t < 1000 for t in r.meta["prompt"]) for r in toks)
    with pytest.raises(ValueError, match="vocab-size"):
        bench_cli.build_requests(_args(prompt_format="tokens"))


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_measures_stream(endpoint, tmp_path):
    seen = []
    args = _args(endpoint=endpoint, out=tmp_path, request_rate=200.0)
    assert bench_cli.run(args, transport=_fake_server(seen)) == 0
    assert len(seen) == 5 and all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 4 for b in seen)
    res = json.loads((tmp_path / "bench.json").read_text())
    m = res["metrics"]
    assert m["completed"] == 5 and m["failed"] == 0
    assert m["total_output_tokens"] == 20 and m["total_input_tokens"] == 40
    # 4 chunks 2 ms apart: 3 gaps per request, TPOT ~ ITL >= 2 ms
    assert m["itl_ms"]["n"] == 15 and m["itl_ms"]["min"] >= 1.5
    assert m["tpot_ms"]["mean"] == pytest.approx(m["itl_ms"]["mean"], rel=1e-6)
    assert all(len(r["token_times"]) == 4 for r in res["raw"])
    assert res["environment"]["command"]


def test_model_discovery_and_failures():
    seen = []
    args = _args(num_prompts=4)
    args.model = None
    assert bench_cli.run(args, transport=_fake_server(seen, fail_every=2)) == 1  # failures give exit code 1
    assert {b["model"] for b in seen} == {"fake-model"}
    recs, _ = asyncio.run(bench_cli.run_benchmark(bench_cli.build_requests(args), args, "fake-model",
                                                  _fake_server([], fail_every=2)))
    failed = [r for r in recs if not r.success]
    assert len(failed) == 2 and "HTTP 400" in failed[0].error


def _card_server(seen: list, card: dict):
    """A fake server whose ``/v1/models`` lists ``card``; completions stream one token-id chunk per token."""
    async def stream(n_tokens: int):
        for i in range(n_tokens):
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'token_ids': [i]}]})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [card]})
        body = json.loads(request.content)
        seen.append(body)
        return httpx.Response(200, content=stream(body["max_tokens"]), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_token_prompts_take_the_vocabulary_size_from_the_model_card(tmp_path):
    """``--prompt-format tokens`` without ``--vocab-size`` reads ``vocab_size`` from ``GET /v1/models``
    (vmkv's server gives it); the prompts are then the ones ``--vocab-size`` would have given."""
    seen = []
    args = _args(prompt_format="tokens", out=tmp_path)
    args.model = None
    card = {"id": "random-tiny", "object": "model", "max_model_len": 256, "vocab_size": 512}
    assert bench_cli.run(args, transport=_card_server(seen, card)) == 0
    assert len(seen) == 5 and {b["model"] for b in seen} == {"random-tiny"}
    expected = bench_cli.build_requests(_args(prompt_format="tokens", vocab_size=512))
    assert sorted(map(tuple, (b["prompt"] for b in seen))) == sorted(tuple(r.meta["prompt"]) for r in expected)
    assert all(b["return_token_ids"] for b in seen)
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["args"]["vocab_size"] == 512 and res["metrics"]["completed"] == 5
    # --model given: the card of that model is the one read
    seen.clear()
    args = _args(prompt_format="tokens")
    args.model = "random-tiny"
    assert bench_cli.run(args, transport=_card_server(seen, card)) == 0 and len(seen) == 5


@pytest.mark.parametrize("card", [{"id": "other-server-model", "object": "model"},
                                  {"id": "m", "object": "model", "vocab_size": "512"}])
def test_token_prompts_without_a_vocabulary_size_anywhere_are_an_error(card, capsys):
    """A server whose card has no integer ``vocab_size`` (another server) still needs ``--vocab-size``."""
    seen = []
    args = _args(prompt_format="tokens")
    args.model = None
    assert bench_cli.run(args, transport=_card_server(seen, card)) == 2 and seen == []
    out = capsys.readouterr().out
    assert "--prompt-format tokens needs --vocab-size" in out and "/v1/models gives none" in out


def test_token_prompts_are_the_compare_engine_workload():
    """``vmkv bench serve --prompt-format tokens`` sends the requests ``vmkv compare engine`` runs for the
    same flags (one generator: :func:`vmkv.compare.workloads.generate`)."""
    from vmkv.compare.workloads import WorkloadSpec, generate

    args = _args(prompt_format="tokens", vocab_size=128256, input_len="sharegpt-in", output_len="64..512",
                 request_rate=24.0, num_prompts=40, seed=3)
    sent = bench_cli.build_requests(args)
    ref = generate(WorkloadSpec(num_requests=40, input_len="sharegpt-in", output_len="64..512", request_rate=24.0,
                                seed=3), 128256)
    assert [(r.meta["prompt"], r.output_len, r.arrival_s) for r in sent] == \
        [(r.prompt_token_ids, r.output_len, r.arrival_s) for r in ref]
