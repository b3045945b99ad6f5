"""The proxy's front for agents whose base URL points at it (every harness the trainer runs), and its control
routes: a small HTTP/1.1 server on asyncio streams over the capture logic (core.py), sending model calls to the
engines itself (upstream.py). mitmproxy serves only the forward (HTTPS_PROXY) listener (addon.py): its layers
were most of a 1 KB call's cost here (docs/benchmarks.md).

HTTP it speaks: keep-alive connections, one request at a time each (pipelined ones answered in order), read by
llhttp (http1.py); answers with a Content-Length, or chunked for a streamed model call.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import traceback
from http import HTTPStatus

from harness_trainer.proxy.core import Capture
from harness_trainer.proxy.http1 import BadRequest, RequestReader
from harness_trainer.proxy.inflight import CallInFlight
from harness_trainer.proxy.relay import broken_stream_event, http_chunk
from harness_trainer.proxy.upstream import LIMIT, Answer, Upstream, UpstreamError
from harness_trainer.proxy.wire import Reply, Request, json_reply

_READ_ERRORS = (OSError, asyncio.IncompleteReadError, TimeoutError)


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
        requests = RequestReader(self.body_limit, self.host)
        try:
            while True:
                try:
                    request, keep = await requests.next(reader, writer)
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
