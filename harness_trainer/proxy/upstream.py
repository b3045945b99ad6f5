"""HTTP/1.1 from the proxy to its engines, on asyncio streams: the one request the front sends (a POST of a chat
completion with a Content-Length) and the answers an OpenAI-compatible server gives (Content-Length, chunked, or
read to the close). httpx costs ~0.3 ms a call in Python, more than the rest of a 1 KB call's capture.

JSON answers reuse keep-alive connections (a connection the engine closed while idle is retried once on a new
one, before any byte of the answer); each stream has a new connection: on a reused keep-alive connection vLLM's
server was seen to hold a stream's headers until the whole answer was generated (relay.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

CONNECT_S = 10.0
READ_S = 600.0  # an answer may take this long to start, and a stream this long between two chunks
IDLE_PER_ENGINE = 512  # keep-alive connections kept per engine; past it, a finished one is closed
LIMIT = 1 << 20  # longest header line or chunk-size line read at once


class UpstreamError(Exception):
    """The engine could not be reached, or its answer broke off or could not be read."""


class Answer:
    def __init__(self, upstream: Upstream, key: tuple[str, int], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, head: bytes, reusable: bool):
        self._upstream, self._key, self._reader, self._writer = upstream, key, reader, writer
        lines = head.decode("latin-1").split("\r\n")
        try:
            self.status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            self.close()
            raise UpstreamError(f"the engine's answer has no status line: {lines[0][:100]!r}") from None
        self.headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name:
                self.headers[name.strip().lower()] = value.strip()
        self.content_type = self.headers.get("content-type", "")
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        length = self.headers.get("content-length")
        self._length = int(length) if length is not None and not self._chunked else None
        self._reusable = reusable and (self._chunked or self._length is not None) \
            and self.headers.get("connection", "").lower() != "close"

    async def read(self) -> bytes:
        """The whole body; the connection goes back to the pool once it is read."""
        if self._length is None:
            body = b"".join([piece async for piece in self.pieces()])
        else:
            try:
                async with asyncio.timeout(READ_S):
                    body = await self._reader.readexactly(self._length)
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                self.close()
                raise UpstreamError(f"the engine's answer broke off ({type(exc).__name__}: {exc})") from exc
        self.done()
        return body

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives (a stream's SSE bytes)."""
        reader = self._reader
        try:
            if self._chunked:
                while True:
                    async with asyncio.timeout(READ_S):
                        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                        if size == 0:
                            while await reader.readuntil(b"\r\n") != b"\r\n":
                                pass  # trailers
                            return
                        piece = (await reader.readexactly(size + 2))[:-2]
                    yield piece
            elif self._length is not None:
                left = self._length
                while left:
                    async with asyncio.timeout(READ_S):
                        piece = await reader.read(min(left, 1 << 16))
                    if not piece:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(piece)
                    yield piece
            else:
                while True:
                    async with asyncio.timeout(READ_S):
                        piece = await reader.read(1 << 16)
                    if not piece:
                        return
                    yield piece
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError) as exc:
            self._reusable = False
            self.close()
            raise UpstreamError(f"the engine's answer broke off ({type(exc).__name__}: {exc})") from exc

    def done(self) -> None:
        """The body was read to its end: the connection is kept for the next call if it may be."""
        if self._reusable:
            self._upstream.give_back(self._key, self._reader, self._writer)
        else:
            self._writer.close()

    def close(self) -> None:
        self._reusable = False
        self._writer.close()


class Upstream:
    def __init__(self):
        self._idle: dict[tuple[str, int], list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    async def post(self, url: str, body: bytes, *, stream: bool) -> Answer:
        parts = urlsplit(url)
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        head = (b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                % ((parts.path or "/").encode(), parts.netloc.encode(), len(body)))
        for attempt in range(2):
            # the second try is on a new connection: two kept ones can both have been closed by the engine (a call
            # that found two so was cut off unanswered at 1,024 sessions: the loop then ran out of tries)
            idle = None if stream or attempt else self._take(key)
            try:
                if idle is None:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(*key, limit=LIMIT), CONNECT_S)
                else:
                    reader, writer = idle
                writer.write(head)
                writer.write(body)
                async with asyncio.timeout(READ_S):
                    await writer.drain()
                    answer_head = await reader.readuntil(b"\r\n\r\n")
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError) as exc:
                if idle is not None:
                    idle[1].close()
                    continue  # closed by the engine while it sat idle: once more, on a new connection
                raise UpstreamError(f"the engine could not be reached at {url} ({type(exc).__name__}: "
                                    f"{exc or 'no answer'})") from exc
            return Answer(self, key, reader, writer, answer_head, reusable=not stream)
        raise AssertionError("unreachable: the second try is on a new connection")

    def _take(self, key: tuple[str, int]):
        idle = self._idle.get(key)
        while idle:
            reader, writer = idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer
            writer.close()
        return None

    def give_back(self, key: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < IDLE_PER_ENGINE and not reader.at_eof():
            idle.append((reader, writer))
        else:
            writer.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for _, writer in idle:
                writer.close()
        self._idle.clear()
