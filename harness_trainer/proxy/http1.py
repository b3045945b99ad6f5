"""Requests off an agent's HTTP/1.1 connection, parsed by llhttp (Node's parser, through `httptools`, as uvicorn
does): the agents are untrusted, and a maintained parser knows the framing corners (chunk extensions, obsolete
line folding, smuggling through conflicting lengths) that a hand-written one learns one bug at a time.

    requests = RequestReader(body_limit, host)
    request, keep = await requests.next(reader, writer)   # None: the agent closed between requests

Limits are the proxy's own: headers past HEAD_LIMIT bytes (431), a body past the body limit (413, by its
Content-Length before it is read, or as a chunked body grows); `Expect: 100-continue` is answered once the
headers are read. A request that is not HTTP gets a BadRequest that says what was wrong (400).
"""

from __future__ import annotations

import asyncio
from collections import deque

import httptools

from harness_trainer.proxy.wire import Request

READ_S = 600.0  # a client that sends part of a request and then nothing is dropped after this long
IDLE_S = 600.0  # a keep-alive connection with no request for this long is closed
HEAD_LIMIT = 1 << 20  # the most bytes of request line and headers read
PIECE = 1 << 16


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class RequestReader:
    """The parser of one connection and the requests it has finished (several, if the agent pipelines)."""

    def __init__(self, body_limit: int, host: str):
        self.body_limit, self.host = body_limit, host
        self.done: deque[tuple[Request, bool]] = deque()
        self.parser = httptools.HttpRequestParser(self)
        self.too_big: str | None = None
        self._new()

    def _new(self) -> None:
        self.target, self.headers, self.body, self.size = b"", {}, [], 0
        self.started = self.headers_done = self.wants_continue = False
        self.head_bytes = 0

    # llhttp's callbacks
    def on_message_begin(self) -> None:
        self.started = True

    def on_url(self, url: bytes) -> None:
        self.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1").strip()
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_headers_complete(self) -> None:
        self.headers_done = True
        length = self.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.body_limit:
            self.too_big = (f"the request body ({length} bytes) is over the proxy's limit of {self.body_limit} "
                            "bytes (--body-size-limit)")
        self.wants_continue = self.headers.get("expect", "").lower() == "100-continue"

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.body_limit:
            self.too_big = f"the request body is over the proxy's limit of {self.body_limit} bytes"
        elif self.too_big is None:
            self.body.append(body)

    def on_message_complete(self) -> None:
        target = self.target.decode("latin-1")
        if "://" in target:  # absolute form: the path is what routes
            target = "/" + target.split("://", 1)[1].partition("/")[2]
        request = Request(self.parser.get_method().decode("latin-1"), target, self.headers, b"".join(self.body),
                          self.host)
        self.done.append((request, self.parser.should_keep_alive()))
        self._new()

    async def next(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[Request | None, bool]:
        """The next request on the connection, and whether the connection stays open after it."""
        while not self.done:
            try:
                async with asyncio.timeout(READ_S if self.started else IDLE_S):
                    data = await reader.read(PIECE)
            except TimeoutError:
                if self.started:
                    raise BadRequest(408, f"the request was not finished within {READ_S:.0f} s") from None
                return None, False  # idle too long between requests: closed
            if not data:
                if self.started:
                    raise BadRequest(400, "the request ended inside its "
                                          + ("body" if self.headers_done else "headers"))
                return None, False  # closed between requests
            self._feed(data)
            if self.wants_continue and not self.done:
                self.wants_continue = False
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return self.done.popleft()

    def _feed(self, data: bytes) -> None:
        if not self.headers_done:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if not self.done:
                raise BadRequest(400, "a protocol upgrade (CONNECT, Upgrade) is not served here: send plain "
                                      "HTTP/1.1 requests") from None
        except httptools.HttpParserError as exc:
            said = str(exc) or type(exc).__name__
            if "content-length" in said.lower():
                raise BadRequest(400, f"bad content-length: {said}") from None
            line = data.split(b"\r\n", 1)[0][:100]
            raise BadRequest(400, f"not an HTTP request line and headers the proxy can read ({said}): "
                                  f"{line!r}") from None
        if self.too_big:
            raise BadRequest(413, self.too_big)
        if not self.headers_done and self.head_bytes > HEAD_LIMIT:
            raise BadRequest(431, f"the request's headers are too long (over {HEAD_LIMIT} bytes)")
