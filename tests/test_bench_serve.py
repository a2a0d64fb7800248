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
