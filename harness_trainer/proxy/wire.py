"""What the capture logic reads of a request and writes as an answer, apart from the front that speaks HTTP.

Two fronts carry the same logic (core.py): front.py, a small asyncio HTTP/1.1 server, for agents whose base URL
points at the proxy (every harness the trainer runs), and mitmproxy (addon.py) for agents that keep their
built-in endpoint and are given HTTPS_PROXY. mitmproxy's own request object reads like `Request` below (method,
path, lower-case header names, content, host_header), so the logic takes either; it answers with a `Reply`, which
each front writes its own way. Building mitmproxy's typechecked messages costs ~250 µs a call, more than the
capture itself at 1 KB (docs/benchmarks.md), which is why the front that carries the load does without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness_trainer import fastjson


@dataclass(slots=True)
class Request:
    method: str
    path: str  # with its query, as it came
    headers: dict[str, str]  # names in lower case
    content: bytes = b""
    host: str = "127.0.0.1"  # the address the front listens on

    @property
    def host_header(self) -> str | None:
        return self.headers.get("host")

    def get_content(self) -> bytes:
        return self.content


@dataclass(slots=True)
class Reply:
    """An answer the proxy writes itself (a control route, an error, a captured call's translated answer)."""
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)  # any beyond content-type and content-length


def json_reply(status: int, body) -> Reply:
    return Reply(status, fastjson.dumps(body))
