"""A lean HTTP/1.1 client for streamed responses on ``asyncio`` streams, the default transport of
``vmkv bench serve`` (``--http-client raw``).

A load client that shares one event loop with every stream it times must cost little per streamed chunk,
or it becomes what a served run measures.  Measured on the project's 2-core CPU machine against a fake SSE
server (100 streams, ~9,500 chunks), :func:`vmkv.compare.bench_cli.send_one` spends about 65 us of CPU per
chunk through this client and about 115 us through ``httpx`` (``httpcore``, ``h11``, ``anyio``: a timeout
scope and several layers per read); the rest is the event loop and the ``recv`` per chunk.  At the ~7,000
chunks/s of issue 22's served run that is about 0.45 of a core against 0.8 on that machine.

:class:`RawHTTPClient` has the part of ``httpx.AsyncClient``'s interface that
:func:`vmkv.compare.bench_cli.send_one` uses: ``async with client.stream("POST", url, json=body,
headers=headers) as resp`` with ``resp.status_code``, ``await resp.aread()`` and ``async for line in
resp.aiter_lines()``.  One connection per request (``Connection: close``), ``http`` and ``https``, bodies
chunked, sized by ``Content-Length`` or ended by the close; a request that is not done ``timeout_s`` after
it started is aborted (its read raises ``ConnectionError``).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from urllib.parse import urlsplit

__all__ = ["RawHTTPClient", "RawResponse", "HTTPProtocolError"]


class HTTPProtocolError(ConnectionError):
    """The server's response is not HTTP/1.x this client can read (the message quotes it)."""


class RawResponse:
    """A response whose head has been read; the body is read by :meth:`aread` or :meth:`aiter_lines`."""

    def __init__(self, reader: asyncio.StreamReader, status_code: int, headers: dict[str, str]) -> None:
        self._reader, self.status_code, self.headers = reader, status_code, headers
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self._length = int(length) if length is not None and not self._chunked else None

    async def aiter_bytes(self):
        """The body's bytes as they arrive (de-chunked)."""
        r = self._reader
        if self._chunked:
            while True:
                size_line = await r.readline()
                if not size_line:
                    raise HTTPProtocolError("the connection closed inside a chunked body")
                try:
                    size = int(size_line.split(b";", 1)[0], 16)
                except ValueError:
                    raise HTTPProtocolError(f"bad chunk size line {size_line[:40]!r}") from None
                if size == 0:
                    while (await r.readline()) not in (b"\r\n", b"\n", b""):    # trailers
                        pass
                    return
                data = await r.readexactly(size + 2)
                yield data[:-2]
        elif self._length is not None:
            left = self._length
            while left > 0:
                data = await r.read(min(left, 1 << 16))
                if not data:
                    raise HTTPProtocolError(f"the connection closed {left} bytes before the body's end")
                left -= len(data)
                yield data
        else:
            while data := await r.read(1 << 16):
                yield data

    async def aiter_lines(self):
        """The body's lines (``\\n`` or ``\\r\\n`` ended, without the ending), as ``str``."""
        buf = b""
        async for data in self.aiter_bytes():
            buf += data
            if b"\n" not in data:
                continue
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if buf:
            yield buf.rstrip(b"\r").decode("utf-8", errors="replace")

    async def aread(self) -> bytes:
        return b"".join([d async for d in self.aiter_bytes()])


class _Stream:
    def __init__(self, client: "RawHTTPClient", method: str, url: str, body: bytes, headers: dict) -> None:
        self.client, self.method, self.url, self.body, self.headers = client, method, url, body, headers
        self._writer = None
        self._deadline = None

    async def __aenter__(self) -> RawResponse:
        u = urlsplit(self.url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"RawHTTPClient speaks http and https, not {u.scheme!r} ({self.url})")
        port = u.port or (443 if u.scheme == "https" else 80)
        ctx = ssl.create_default_context() if u.scheme == "https" else None
        loop = asyncio.get_running_loop()
        reader, self._writer = await asyncio.wait_for(
            asyncio.open_connection(u.hostname, port, ssl=ctx, limit=1 << 20), self.client.timeout_s)
        self._deadline = loop.call_later(self.client.timeout_s, self._writer.transport.abort)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        head = [f"{self.method} {path} HTTP/1.1", f"Host: {u.netloc}", "Connection: close",
                "Accept: text/event-stream", f"Content-Length: {len(self.body)}"]
        head += [f"{k}: {v}" for k, v in self.headers.items()]
        self._writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + self.body)
        status_line = await reader.readline()
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise HTTPProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return RawResponse(reader, int(parts[1]), headers)

    async def __aexit__(self, *exc) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        if self._writer is not None:
            self._writer.close()               # Connection: close; nothing more is read or sent


class RawHTTPClient:
    """``httpx.AsyncClient``'s ``stream()`` for one request per connection (module docstring).

    Args:
        timeout_s: the longest a request may take, connection to last byte (seconds).
    """

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = float(timeout_s)

    def stream(self, method: str, url: str, json=None, content: bytes | None = None,  # noqa: A002
               headers: dict | None = None) -> _Stream:
        body = content if content is not None else _dumps(json)
        hdrs = {"Content-Type": "application/json"} if json is not None else {}
        hdrs.update(headers or {})
        return _Stream(self, method, url, body, hdrs)

    async def __aenter__(self) -> "RawHTTPClient":
        return self

    async def __aexit__(self, *exc) -> None:
        return None


def _dumps(obj) -> bytes:
    return b"" if obj is None else json.dumps(obj, separators=(",", ":")).encode()
