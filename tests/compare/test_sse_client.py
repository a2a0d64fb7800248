"""`vmkv.compare.sse_client.RawHTTPClient` (``vmkv bench serve --http-client raw``) against a local asyncio
HTTP server on a real socket: chunked SSE, sized and close-ended bodies, an error status, a timeout; and
``bench_cli.send_one`` reading the same stream through it and through httpx alike."""

import argparse
import asyncio
import json

import pytest

from vmkv.compare import bench_cli
from vmkv.compare.sse_client import HTTPProtocolError, RawHTTPClient
from vmkv.compare.workloads import Request


def _sse(n: int) -> list[bytes]:
    events = [b"data: " + json.dumps({"choices": [{"index": 0, "text": "", "token_ids": [i]}]}).encode() + b"\n\n"
              for i in range(n)]
    usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
    return events + [b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n", b"data: [DONE]\n\n"]


async def _serve(mode: str, seen: list):
    """A one-route server: ``mode`` chunked (one chunk per event, one split in two), sized, close, error, hang."""
    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        seen.append((head, json.loads(await reader.readexactly(length))))
        events = _sse(4)
        if mode == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            parts = [events[0][:7], events[0][7:]] + events[1:]
            for p in parts:
                writer.write(b"%x;ext=1\r\n%s\r\n" % (len(p), p))
                await writer.drain()
                await asyncio.sleep(0.005)
            writer.write(b"0\r\nx-trailer: 1\r\n\r\n")
        elif mode in ("sized", "close"):
            body = b"".join(events)
            size = b"content-length: %d\r\n" % len(body) if mode == "sized" else b""
            writer.write(b"HTTP/1.1 200 OK\r\n" + size + b"\r\n" + body)
        elif mode == "error":
            body = b'{"error": {"message": "bad prompt"}}'
            writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        elif mode == "hang":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(5)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"


def _run(mode: str, client, seen: list | None = None):
    seen = [] if seen is None else seen

    async def go():
        server, url = await _serve(mode, seen)
        async with server:
            req = Request("r0", [5, 6, 7], 4, meta={"prompt": [5, 6, 7], "prompt_len": 3})
            return await bench_cli.send_one(client, url, {"prompt": [5, 6, 7], "max_tokens": 4}, req,
                                            {"Authorization": "Bearer k"})

    return asyncio.run(go())


@pytest.mark.parametrize("mode", ["chunked", "sized", "close"])
def test_raw_client_reads_a_stream_as_httpx_does(mode):
    import httpx

    seen = []
    rec = _run(mode, RawHTTPClient(10), seen)
    assert rec.success and rec.output_len == 4 and rec.prompt_len == 3 and len(rec.token_times) == 4
    assert rec.token_times == sorted(rec.token_times) and rec.first_token_time >= rec.arrival_time
    head, body = seen[0]
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n") and b"Authorization: Bearer k" in head
    assert b"Content-Type: application/json" in head and body == {"prompt": [5, 6, 7], "max_tokens": 4}

    async def with_httpx():
        async with httpx.AsyncClient(timeout=10) as c:
            server, url = await _serve(mode, [])
            async with server:
                req = Request("r0", [5, 6, 7], 4, meta={"prompt": [5, 6, 7], "prompt_len": 3})
                return await bench_cli.send_one(c, url, {"prompt": [5, 6, 7], "max_tokens": 4}, req, {})

    ref = asyncio.run(with_httpx())
    assert (ref.success, ref.output_len, len(ref.token_times)) == (True, 4, 4)


def test_raw_client_reports_errors_and_timeouts():
    rec = _run("error", RawHTTPClient(10))
    assert not rec.success and rec.error.startswith("RuntimeError: HTTP 400") and "bad prompt" in rec.error
    rec = _run("hang", RawHTTPClient(0.3))
    assert not rec.success and rec.finish_time is None


def test_raw_client_refuses_what_it_cannot_speak():
    async def go(url):
        async with RawHTTPClient(5).stream("POST", url, json={}) as resp:
            return resp

    with pytest.raises(ValueError, match="http and https"):
        asyncio.run(go("ftp://127.0.0.1/x"))

    async def not_http():
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"SSH-2.0-OpenSSH\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            return await go(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/")

    with pytest.raises(HTTPProtocolError, match="not an HTTP/1.x status line"):
        asyncio.run(not_http())


def test_bench_uses_the_raw_client_unless_told_or_given_a_transport():
    import httpx

    ns = argparse.Namespace(http_client="raw", timeout_s=7.0, max_concurrency=None)
    assert isinstance(bench_cli.make_client(ns, 3), RawHTTPClient)
    assert isinstance(bench_cli.make_client(argparse.Namespace(**{**vars(ns), "http_client": "httpx"}), 3),
                      httpx.AsyncClient)
    assert isinstance(bench_cli.make_client(ns, 3, transport=httpx.MockTransport(lambda r: None)), httpx.AsyncClient)
