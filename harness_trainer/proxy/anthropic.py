"""Anthropic Messages (`POST /v1/messages`, as claude-code speaks it) <-> chat completions."""

from __future__ import annotations

import json
import uuid

from harness_trainer.proxy.translate import (
    BlockStream,
    copy_fields,
    function_tools,
    message_text,
    reasoning_of,
    sse,
    tool_arguments,
)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", None: "end_turn"}


def _tool_choice(choice):
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        return "auto"
    if kind == "none":
        return "none"
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ValueError(f"tool_choice {choice!r} is not an Anthropic tool choice")


ATTRIBUTION = "x-anthropic-billing-header:"


def _without_attribution(system):
    """claude-code's first system block is `x-anthropic-billing-header: cc_version=...<hash>`, the hash new on
    every call: left in, no two calls share a token prefix (each turn a new root, quadratic training rows, no
    prefix-cache hit). It says nothing to the model, so it is dropped (the adapter also turns it off)."""
    if isinstance(system, str):
        return "" if system.startswith(ATTRIBUTION) else system
    if isinstance(system, list):
        return [b for b in system if not (isinstance(b, dict) and str(b.get("text", "")).startswith(ATTRIBUTION))]
    return system


class AnthropicDialect:
    name = "anthropic"
    paths = ("/v1/messages", "/messages")
    stream_content_type = "text/event-stream"

    def wants_stream(self, body: dict) -> bool:
        return bool(body.get("stream"))

    def to_chat(self, body: dict) -> dict:
        if not isinstance(body.get("messages"), list):
            raise ValueError("'messages' must be a list")
        messages = []
        if body.get("system"):
            messages.append({"role": "system", "content": message_text(_without_attribution(body["system"]))})
        for msg in body["messages"]:
            if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant", "system"):
                raise ValueError("each message needs role 'user' or 'assistant' (or 'system', as claude-code sends)")
            if msg["role"] == "system":  # claude-code puts its agent list mid-conversation as a system message
                messages.append({"role": "system", "content": message_text(msg.get("content"))})
                continue
            content = msg.get("content")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            if not isinstance(blocks, list):
                raise ValueError("message content must be a string or a list of blocks")
            if msg["role"] == "assistant":
                calls = [{"id": b.get("id"), "type": "function",
                          "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {})}}
                         for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
                text = message_text([b for b in blocks if isinstance(b, dict) and b.get("type") == "text"])
                thought = "".join(b.get("thinking") or "" for b in blocks
                                  if isinstance(b, dict) and b.get("type") == "thinking")
                messages.append({"role": "assistant", "content": text or None,
                                 **({"tool_calls": calls} if calls else {}),
                                 **({"reasoning_content": thought} if thought else {})})
                continue
            text_parts = []
            for b in blocks:
                if isinstance(b, dict) and b.get("type") == "tool_result":
                    messages.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                                     "content": message_text(b.get("content"))})
                elif isinstance(b, dict) and b.get("type") not in ("thinking", "redacted_thinking"):
                    text_parts.append(b)
            if text_parts:
                messages.append({"role": "user", "content": message_text(text_parts)})
        chat = {"messages": messages, "stream": bool(body.get("stream"))}
        if body.get("tools"):
            chat["tools"] = function_tools(body["tools"], "input_schema")
        copy_fields(body, chat, (("max_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                                 ("top_k", "top_k"), ("stop", "stop_sequences")))
        if (choice := _tool_choice(body.get("tool_choice"))) is not None:
            chat["tool_choice"] = choice
        return chat

    def from_chat(self, answer: dict, asked: dict) -> dict:
        choice = (answer.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        content = [{"type": "thinking", "thinking": reasoning_of(message), "signature": ""}] \
            if reasoning_of(message) else []
        content += [{"type": "text", "text": message["content"]}] if message.get("content") else []
        for call in message.get("tool_calls") or []:
            fn = call.get("function") or {}
            content.append({"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                            "input": tool_arguments(fn.get("arguments"))})
        usage = answer.get("usage") or {}
        return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                "model": answer.get("model"), "content": content,
                "stop_reason": STOP_REASONS.get(choice.get("finish_reason"), "end_turn"), "stop_sequence": None,
                "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                          "output_tokens": usage.get("completion_tokens", 0)}}

    def stream_translator(self, asked: dict) -> AnthropicStream:
        return AnthropicStream(asked)

    def stop_answer(self, asked: dict, model: str, text: str, stream: bool) -> bytes:
        if not stream:
            return json.dumps({"id": f"msg_stop_{uuid.uuid4().hex[:12]}", "type": "message", "role": "assistant",
                               "model": model, "content": [{"type": "text", "text": text}],
                               "stop_reason": "end_turn", "stop_sequence": None,
                               "usage": {"input_tokens": 0, "output_tokens": 0}}).encode()
        s = AnthropicStream(asked, model=model)
        return s.start() + s.text_start() + s.text(text) + s.close() + s.finish()

    def error(self, status: int, message: str) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}


class AnthropicStream(BlockStream):
    def __init__(self, asked: dict, model: str | None = None):
        super().__init__(asked)
        self.model = model or asked.get("model")
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    def _event(self, kind: str, **data) -> bytes:
        return sse({"type": kind, **data}, event=kind)

    def start(self) -> bytes:
        return self._event("message_start", message={
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}})

    def reasoning_start(self) -> bytes:
        return self._event("content_block_start", index=self.blocks,
                           content_block={"type": "thinking", "thinking": "", "signature": ""})

    def reasoning(self, delta: str) -> bytes:
        return self._event("content_block_delta", index=self.blocks,
                           delta={"type": "thinking_delta", "thinking": delta})

    def text_start(self) -> bytes:
        return self._event("content_block_start", index=self.blocks, content_block={"type": "text", "text": ""})

    def text(self, delta: str) -> bytes:
        return self._event("content_block_delta", index=self.blocks, delta={"type": "text_delta", "text": delta})

    def tool_start(self, call_id: str, name: str) -> bytes:
        return self._event("content_block_start", index=self.blocks,
                           content_block={"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def tool_args(self, delta: str) -> bytes:
        return self._event("content_block_delta", index=self.blocks,
                           delta={"type": "input_json_delta", "partial_json": delta})

    def close(self) -> bytes:
        return self._event("content_block_stop", index=self.blocks)

    def finish(self) -> bytes:
        output = (self.usage or {}).get("completion_tokens", self.output_tokens)
        return (self._event("message_delta", delta={"stop_reason": STOP_REASONS.get(self.finish_reason, "end_turn"),
                                                    "stop_sequence": None},
                            usage={"output_tokens": output})
                + self._event("message_stop"))

    def failed(self, message: str) -> bytes:
        return self._event("error", error={"type": "api_error", "message": message})
