"""A loopback relay between mitmproxy and the engine, for streamed model calls of the forward listener only.

Why: when an upstream dies mid-stream, mitmproxy closes the agent's connection before any addon can write, so
the agent sees a stream that just stops (codex then reconnects blindly; a chat client raises a protocol error).
The relay reads the engine with httpx and always ends its own stream cleanly: if the engine's stream breaks, it
appends the in-stream error event vLLM itself sends for errors, which `Capture.feed` turns into the agent's
dialect error (`response.failed`, Anthropic `error`, a chat `error` chunk). Its only client is this proxy, which
sends one POST with a Content-Length per connection, so the HTTP it speaks is that and no more.
"""

from __future__ import annotations

import asyncio
import json

import httpx

UPSTREAM_HEADER = "x-harness-upstream"  # where the relay sends the call (the session's engine)


def broken_stream_event(exc: BaseException) -> bytes:
    """The in-stream error event vLLM itself sends for errors, for a stream the engine broke off."""
    error = {"error": {"message": f"the engine's stream broke off: {exc or type(exc).__name__}", "code": 502}}
    return b"\n\ndata: " + json.dumps(error).encode() + b"\n\n"


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class StreamRelay:
    def __init__(self):
        # A new engine connection per stream: on a reused keep-alive connection vLLM's server was seen to hold a
        # stream's headers until the whole answer was generated (measured here: 3 of 4 reused calls).
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0),
                                        limits=httpx.Limits(max_keepalive_connections=0))
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        await self.client.aclose()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            headers = dict((k.strip().lower(), v.strip()) for k, v in (h.split(":", 1) for h in head[1:] if ":" in h))
            body = await reader.readexactly(int(headers.get("content-length") or 0))
            url = headers[UPSTREAM_HEADER].rstrip("/") + "/v1/chat/completions"
            await self._relay(url, body, writer)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, KeyError, ValueError):
            pass  # the proxy side went away or sent something malformed: nothing to answer
        finally:
            writer.close()

    async def _relay(self, url: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        answered = False
        try:
            async with self.client.stream("POST", url, content=body,
                                          headers={"content-type": "application/json"}) as answer:
                writer.write(f"HTTP/1.1 {answer.status_code} {answer.reason_phrase}\r\n"
                             f"content-type: {answer.headers.get('content-type', 'application/json')}\r\n"
                             "transfer-encoding: chunked\r\nconnection: close\r\n\r\n".encode())
                answered = True
                try:
                    async for data in answer.aiter_bytes():
                        writer.write(http_chunk(data))
                        await writer.drain()
                except httpx.HTTPError as exc:  # the engine broke off mid-answer
                    writer.write(http_chunk(broken_stream_event(exc)))
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except httpx.HTTPError as exc:  # no answer at all: a 502 the proxy retries like any other
            if answered:
                return
            error = json.dumps({"error": {"message": f"the engine could not be reached: {exc}"}}).encode()
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(error), error))
            await writer.drain()
