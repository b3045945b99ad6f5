"""What the block-streaming dialects (Anthropic Messages, OpenAI Responses) share: SSE framing, the chunk ->
content-block state machine, and the small field and content conversions. Pure functions, no I/O."""

from __future__ import annotations

import json
import uuid

from harness_trainer import fastjson


def sse(data: dict | str, event: str | None = None) -> bytes:
    payload = data.encode() if isinstance(data, str) else fastjson.dumps(data)
    return (f"event: {event}\n" if event else "").encode() + b"data: " + payload + b"\n\n"


class BlockStream:
    """Turns chat-completion chunks into a sequence of content blocks for dialects that stream blocks
    (Anthropic Messages, OpenAI Responses): text blocks and tool-call blocks, opened, filled and closed in
    order. Subclasses render `start`, `text`, `tool_start`, `tool_args`, `close`, `finish` as their events."""

    def __init__(self, asked: dict):
        self.asked = asked
        self.open: tuple[str, int] | None = None  # ("reasoning", -1), ("text", -1) or ("tool", chat tool index)
        self.blocks = 0  # blocks opened so far
        self.started = False
        self.finish_reason: str | None = None
        self.usage: dict = {}
        self.prompt_tokens = 0
        self.output_tokens = 0

    def event(self, raw: bytes, chunk: dict | None) -> bytes:
        if chunk is None:
            return b""
        out = []
        if not self.started:
            self.started = True
            self.prompt_tokens = len(chunk.get("prompt_token_ids") or [])
            out.append(self.start())
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or []:
            self.output_tokens += len(choice.get("token_ids") or [])
            delta = choice.get("delta") or {}
            if thought := reasoning_of(delta):
                if self.open != ("reasoning", -1):
                    out.append(self._close())
                    self.open = ("reasoning", -1)
                    out.append(self.reasoning_start())
                out.append(self.reasoning(thought))
            if delta.get("content"):
                if self.open != ("text", -1):
                    out.append(self._close())
                    self.open = ("text", -1)
                    out.append(self.text_start())
                out.append(self.text(delta["content"]))
            for call in delta.get("tool_calls") or []:
                key = ("tool", call.get("index", 0))
                fn = call.get("function") or {}
                if self.open != key:
                    out.append(self._close())
                    self.open = key
                    out.append(self.tool_start(call.get("id") or f"call_{uuid.uuid4().hex[:12]}", fn.get("name") or ""))
                if fn.get("arguments"):
                    out.append(self.tool_args(fn["arguments"]))
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return b"".join(out)

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        closing = self.close()
        self.open = None
        self.blocks += 1
        return closing

    def done(self) -> bytes:
        prefix = b"" if self.started else self.start()
        self.started = True
        return prefix + self._close() + self.finish()

    # rendered by subclasses
    def start(self) -> bytes: raise NotImplementedError
    def reasoning_start(self) -> bytes: raise NotImplementedError
    def reasoning(self, delta: str) -> bytes: raise NotImplementedError
    def text_start(self) -> bytes: raise NotImplementedError
    def text(self, delta: str) -> bytes: raise NotImplementedError
    def tool_start(self, call_id: str, name: str) -> bytes: raise NotImplementedError
    def tool_args(self, delta: str) -> bytes: raise NotImplementedError
    def close(self) -> bytes: raise NotImplementedError
    def finish(self) -> bytes: raise NotImplementedError
    def failed(self, message: str) -> bytes: raise NotImplementedError  # the dialect's in-stream error event


def reasoning_of(message: dict) -> str:
    """The reasoning text of a chat message or delta (vLLM >= 0.10 names it `reasoning`)."""
    return message.get("reasoning") or message.get("reasoning_content") or ""


def function_tools(tools: list, schema_key: str) -> list[dict]:
    """A dialect's flat tool list ({name, description, <schema_key>}) as chat-completions functions."""
    return [{"type": "function", "function": {
        "name": t.get("name"), "description": t.get("description", ""),
        "parameters": t.get(schema_key) or {"type": "object", "properties": {}}}}
        for t in tools if isinstance(t, dict) and t.get("name")]


def copy_fields(body: dict, chat: dict, pairs: tuple[tuple[str, str], ...]) -> None:
    """chat[ours] = body[theirs] for each (ours, theirs) the agent set."""
    for ours, theirs in pairs:
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]


def tool_arguments(text: str):
    try:
        value = json.loads(text or "{}")
        return value if isinstance(value, dict) else {"value": value}
    except json.JSONDecodeError:
        return {"_raw": text}


def message_text(content) -> str:
    """Text of a content given as a string or a list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"content must be a string or a list of parts, not {type(content).__name__}")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, dict) and part.get("type") in ("image", "input_image", "image_url", "document"):
            raise ValueError(f"'{part['type']}' content is not supported: the served model reads text only")
    return "".join(texts)
