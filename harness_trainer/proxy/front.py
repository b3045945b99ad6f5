"""The proxy's front for agents whose base URL points at it (every harness the trainer runs), and its control
routes: a small HTTP/1.1 server on asyncio streams over the capture logic (core.py), sending model calls to the
engines itself (upstream.py). mitmproxy serves only the forward (HTTPS_PROXY) listener (addon.py): its layers
were most of a 1 KB call's cost here (docs/benchmarks.md).

HTTP it speaks: keep-alive connections, one request at a time each; bodies by Content-Length or chunked, with
`Expect: 100-continue` answered; answers with a Content-Length, or chunked for a streamed model call.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import traceback
from http import HTTPStatus

from harness_trainer.proxy.core import Capture
from harness_trainer.proxy.inflight import CallInFlight
from harness_trainer.proxy.relay import broken_stream_event, http_chunk
from harness_trainer.proxy.upstream import LIMIT, Answer, Upstream, UpstreamError
from harness_trainer.proxy.wire import Reply, Request, json_reply

READ_S = 600.0  # a client that sends part of a request and then nothing is dropped after this long
IDLE_S = 600.0  # a keep-alive connection with no request for this long is closed
_READ_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError)


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Status"


def reply_bytes(reply: Reply, keep: bool) -> bytes:
    extra = "".join(f"{name}: {value}\r\n" for name, value in reply.headers.items())
    return b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s%s\r\n%s" % (
        reply.status, _phrase(reply.status), reply.content_type.encode(), len(reply.body), extra.encode(),
        b"" if keep else b"connection: close\r\n", reply.body)


class Front:
    def __init__(self, capture: Capture, host: str, port: int, body_limit: int):
        self.capture = capture
        self.host, self.port = host, port
        self.body_limit = body_limit
        self.upstream = Upstream()
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._connection, self.host, self.port, limit=LIMIT,
                                                 backlog=4096, reuse_address=True)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        self.upstream.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    request, keep = await self._read(reader, writer)
                except BadRequest as exc:
                    writer.write(reply_bytes(json_reply(exc.status, {"error": {"message": str(exc),
                                                                               "code": exc.status}}), False))
                    await writer.drain()
                    return
                if request is None or not await self._handle(request, writer, keep) or not keep:
                    return
        except (*_READ_ERRORS, asyncio.CancelledError):
            pass  # the agent went away, or the proxy is stopping
        finally:
            writer.close()

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[Request | None, bool]:
        """The next request on the connection, and whether the connection stays open after it."""
        try:
            async with asyncio.timeout(IDLE_S):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial.strip():
                raise BadRequest(400, "the request ended inside its headers") from None
            return None, False  # closed between requests
        except asyncio.LimitOverrunError:
            raise BadRequest(431, "the request's headers are too long") from None
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ")
        except ValueError:
            raise BadRequest(400, f"not an HTTP request line: {lines[0][:100]!r}") from None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if colon:
                name = name.strip().lower()
                headers[name] = f"{headers[name]}, {value.strip()}" if name in headers else value.strip()
        if "://" in target:  # absolute form: the path is what routes
            target = "/" + target.split("://", 1)[1].partition("/")[2]
        keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        if headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        async with asyncio.timeout(READ_S):
            body = await self._body(reader, headers)
        return Request(method, target, headers, body, self.host), keep

    async def _body(self, reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            pieces, size = [], 0
            while length := int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16):
                size += length
                if size > self.body_limit:
                    raise BadRequest(413, f"the request body is over the proxy's limit of {self.body_limit} bytes")
                pieces.append((await reader.readexactly(length + 2))[:-2])
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            return b"".join(pieces)
        try:
            length = int(headers.get("content-length") or 0)
        except ValueError:
            raise BadRequest(400, f"bad content-length {headers['content-length']!r}") from None
        if length > self.body_limit:
            raise BadRequest(413, f"the request body ({length} bytes) is over the proxy's limit of "
                                  f"{self.body_limit} bytes (--body-size-limit)")
        return await reader.readexactly(length) if length else b""

    async def _handle(self, request: Request, writer: asyncio.StreamWriter, keep: bool) -> bool:
        """Answer one request; False if the connection cannot carry another."""
        result = await self.capture.route(request, reverse=True)
        if not isinstance(result, CallInFlight):
            writer.write(reply_bytes(result or json_reply(404, {"error": {"message": "no such route"}}), keep))
            await writer.drain()
            return True

        call = result
        try:
            answer = await self.upstream.post(call.url, call.body, stream=call.stream)
            body = None if call.stream and answer.status == 200 else await answer.read()
        except Exception as exc:  # an agent always gets an answer: a 502 that says why, at worst
            why = str(exc) if isinstance(exc, UpstreamError) else \
                f"the capture proxy failed calling the engine ({type(exc).__name__}: {exc})"
            if not isinstance(exc, UpstreamError):  # a defect of the proxy: its log has the traceback
                traceback.print_exc(file=sys.stderr)
            self.capture.engine_answered(call, why)
            await self.capture.failed(call)
            writer.write(reply_bytes(json_reply(502, call.dialect.error(502, why)), keep))
            await writer.drain()
            return True
        except BaseException:  # the proxy is stopping
            if not call.released:
                await self.capture.failed(call)
            raise
        if body is None:
            return await self._stream(call, answer, writer)
        writer.write(reply_bytes(await self.capture.answer(call, answer.status, body), keep))
        await writer.drain()
        return True

    async def _stream(self, call: CallInFlight, answer: Answer, writer: asyncio.StreamWriter) -> bool:
        """A streamed 200 answer, passed on as it comes; an engine that breaks off ends it in an error event."""
        pieces = answer.pieces()
        try:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: " + call.dialect.stream_content_type.encode()
                         + b"\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
            try:
                async for data in pieces:
                    await self._pass(call, call.feed(data), writer)
            except UpstreamError as exc:
                await self._pass(call, call.feed(broken_stream_event(exc)), writer)
            await self._pass(call, call.feed(b""), writer)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            with contextlib.suppress(Exception):
                await pieces.aclose()
            answer.close()  # a stream's connection is never reused; if the agent went away, the engine's goes too
            await (self.capture.ended(call) if call.finished else self.capture.failed(call))
        return True

    async def _pass(self, call: CallInFlight, chunks: list[bytes], writer: asyncio.StreamWriter) -> None:
        """The agent's chunks (a call is journaled by the feed that finishes it, before its chunks go out)."""
        for out in chunks:
            writer.write(http_chunk(out))
        await writer.drain()
