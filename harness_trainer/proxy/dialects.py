"""Client dialects. Every model call is sent upstream as an OpenAI chat completion; a dialect translates the
agent's request into that form and the engine's answer (JSON, or SSE event by event) back into the agent's.

Only translation lives here: no I/O, no capture. Chat completions is the identity dialect; the others
(anthropic.py, responses.py, google.py) build on translate.py. Google's is found by its route's pattern, the
others by their fixed paths.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Protocol

from harness_trainer.proxy.anthropic import AnthropicDialect
from harness_trainer.proxy.capture import strip_injected
from harness_trainer.proxy.google import GoogleDialect, route
from harness_trainer.proxy.responses import ResponsesDialect
from harness_trainer.proxy.translate import sse


class DialectStream(Protocol):
    """One answer's SSE stream, rewritten event by event into the agent's dialect."""

    def event(self, raw: bytes, chunk: dict | None) -> bytes: ...
    def done(self) -> bytes: ...
    def failed(self, message: str) -> bytes: ...


class Dialect(Protocol):
    """What the proxy needs of a client dialect (the addon calls nothing else): the routes it answers, the
    request as a chat completion and back, its stream, the clean stop and the error in its own shape."""
    name: str
    paths: tuple[str, ...]
    stream_content_type: str

    def to_chat(self, body: dict) -> dict: ...
    def wants_stream(self, body: dict) -> bool: ...
    def from_chat(self, answer: dict, asked: dict) -> dict: ...
    def stream_translator(self, asked: dict) -> DialectStream: ...
    def stop_answer(self, asked: dict, model: str, text: str, stream: bool) -> bytes: ...
    def error(self, status: int, message: str) -> dict: ...


class ChatDialect:
    """OpenAI chat completions: the request goes up as is; the answer comes back minus injected fields."""
    name = "chat"
    paths = ("/v1/chat/completions", "/chat/completions")
    stream_content_type = "text/event-stream"

    def to_chat(self, body: dict) -> dict:
        return body

    def wants_stream(self, body: dict) -> bool:
        return bool(body.get("stream"))

    def from_chat(self, answer: dict, asked: dict) -> dict:
        return strip_injected(answer, asked)

    def stream_translator(self, asked: dict) -> ChatStream:
        return ChatStream(asked)

    def stop_answer(self, asked: dict, model: str, text: str, stream: bool) -> bytes:
        ident, now = f"chatcmpl-stop-{uuid.uuid4().hex[:12]}", int(time.time())
        if not stream:
            return json.dumps({
                "id": ident, "object": "chat.completion", "created": now, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}).encode()
        chunk = {"id": ident, "object": "chat.completion.chunk", "created": now, "model": model}
        return (sse(dict(chunk, choices=[{"index": 0, "delta": {"role": "assistant", "content": text},
                                          "finish_reason": None}]))
                + sse(dict(chunk, choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]))
                + sse("[DONE]"))

    def error(self, status: int, message: str) -> dict:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return {"error": {"message": message, "type": kind, "code": status}}


class ChatStream:
    """Per-event rewrite of a chat SSE stream: drop the injected fields the agent did not ask for."""

    def __init__(self, asked: dict):
        self.asked = asked
        self.passthrough = bool(asked.get("return_token_ids") and asked.get("logprobs"))

    def event(self, raw: bytes, chunk: dict | None) -> bytes:
        if chunk is None or self.passthrough:
            return raw + b"\n\n"
        choices = chunk.get("choices") or []
        if choices and not chunk.get("usage") and all(
                not c.get("delta") and not c.get("finish_reason") for c in choices):
            # With logprobs on, vLLM sends an empty delta for a token that ends inside a UTF-8 character
            # (its text comes with the next token); without them it sends nothing. Match that.
            return b""
        return sse(strip_injected(chunk, self.asked))

    def done(self) -> bytes:
        return sse("[DONE]")

    def failed(self, message: str) -> bytes:
        return sse({"error": {"message": message, "type": "server_error", "code": 500}})


DIALECTS: list[Dialect] = [ChatDialect(), AnthropicDialect(), ResponsesDialect()]
BY_PATH: dict[str, Dialect] = {path: dialect for dialect in DIALECTS for path in dialect.paths}  # the registry


def dialect_for(path: str) -> Dialect | None:
    """The dialect a request's path (with its query) speaks, or None (not a model call)."""
    bare, _, query = path.partition("?")
    bare = bare.rstrip("/")
    if (found := BY_PATH.get(bare)) is not None:
        return found
    if (google := route(bare)) is not None and google[1] != "countTokens":
        return GoogleDialect(google[1], sse="alt=sse" in query.split("&"))
    return None
