"""OpenAI Responses (`POST /v1/responses`, as codex speaks it) <-> chat completions. Stateless: every
request carries its whole input (`previous_response_id` is refused, since the proxy keeps no response store)."""

from __future__ import annotations

import json
import time
import uuid

from harness_trainer.proxy.translate import BlockStream, copy_fields, function_tools, message_text, reasoning_of, sse


def _tool_choice(choice):
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ValueError(f"tool_choice {choice!r} is not supported")


def input_messages(items: list) -> list[dict]:
    """The Responses API's input items as chat messages: a reasoning item opens the assistant turn that follows
    it; consecutive function calls are one assistant turn."""
    messages: list[dict] = []
    thought = ""  # a reasoning item's text, for the assistant turn it opens
    for item in items:
        if not isinstance(item, dict):
            raise ValueError("each input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise ValueError(f"input message role {item.get('role')!r} is not supported")
            messages.append({"role": role, "content": message_text(item.get("content"))})
            if role == "assistant" and thought:
                messages[-1]["reasoning_content"], thought = thought, ""
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and not thought:  # consecutive calls: one assistant turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call],
                                 **({"reasoning_content": thought} if thought else {})})
                thought = ""
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else message_text(output)})
        elif kind == "reasoning":  # kept for the turn it opens: the template decides whether to render it
            thought += "".join(part.get("text") or "" for part in item.get("content") or []
                               if isinstance(part, dict)) or \
                "".join(part.get("text") or "" for part in item.get("summary") or [] if isinstance(part, dict))
        else:
            raise ValueError(f"input item type {kind!r} is not supported")
    return messages


class ResponsesDialect:
    name = "responses"
    paths = ("/v1/responses", "/responses")
    stream_content_type = "text/event-stream"

    def wants_stream(self, body: dict) -> bool:
        return bool(body.get("stream"))

    def to_chat(self, body: dict) -> dict:
        if body.get("previous_response_id"):
            raise ValueError("previous_response_id is not supported: the capture proxy stores no responses; "
                             "send the whole conversation in 'input' (store: false)")
        items = body.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        if not isinstance(items, list):
            raise ValueError("'input' must be a string or a list of items")
        messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
        messages += input_messages(items)
        chat = {"messages": messages, "stream": bool(body.get("stream"))}
        tools = [t for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "function"]
        if tools:
            chat["tools"] = function_tools(tools, "parameters")
        copy_fields(body, chat, (("max_tokens", "max_output_tokens"), ("temperature", "temperature"),
                                 ("top_p", "top_p")))
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            chat["response_format"] = {"type": fmt.get("type")}
        if (choice := _tool_choice(body.get("tool_choice"))) is not None:
            chat["tool_choice"] = choice
        return chat

    def from_chat(self, answer: dict, asked: dict) -> dict:
        choice = (answer.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        thought = reasoning_of(message)
        output = [_reasoning_item(f"rs_{uuid.uuid4().hex[:24]}", thought)] if thought else []
        if message.get("content"):
            output.append(_message_item(f"msg_{uuid.uuid4().hex[:24]}", message["content"]))
        for call in message.get("tool_calls") or []:
            fn = call.get("function") or {}
            output.append(_call_item(f"fc_{uuid.uuid4().hex[:24]}", call.get("id"), fn.get("name"),
                                     fn.get("arguments") or ""))
        usage = answer.get("usage") or {}
        return _response(f"resp_{uuid.uuid4().hex[:24]}", answer.get("model"), output, choice.get("finish_reason"),
                         usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))

    def stream_translator(self, asked: dict) -> ResponsesStream:
        return ResponsesStream(asked)

    def stop_answer(self, asked: dict, model: str, text: str, stream: bool) -> bytes:
        if not stream:
            return json.dumps(_response(f"resp_stop_{uuid.uuid4().hex[:12]}", model,
                                        [_message_item(f"msg_{uuid.uuid4().hex[:12]}", text)], "stop", 0, 0)).encode()
        s = ResponsesStream(asked, model=model)
        return s.start() + s.text_start() + s.text(text) + s.close() + s.finish()

    def error(self, status: int, message: str) -> dict:
        return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                          "code": status}}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _response(resp_id: str, model: str | None, output: list, finish_reason: str | None, prompt: int, completion: int,
              status: str | None = None) -> dict:
    incomplete = finish_reason == "length"
    return {"id": resp_id, "object": "response", "created_at": int(time.time()), "model": model,
            "status": status or ("incomplete" if incomplete else "completed"),
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "output": output,
            "usage": {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion}}


class ResponsesStream(BlockStream):
    def __init__(self, asked: dict, model: str | None = None):
        super().__init__(asked)
        self.model = model or asked.get("model")
        self.id = f"resp_{uuid.uuid4().hex[:24]}"
        self.sequence = 0
        self.items: list[dict] = []  # finished output items, for response.completed
        self.current: dict | None = None

    def _event(self, kind: str, **data) -> bytes:
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence, **data}, event=kind)

    def start(self) -> bytes:
        shell = _response(self.id, self.model, [], None, 0, 0, status="in_progress")
        return self._event("response.created", response=shell) + self._event("response.in_progress", response=shell)

    def reasoning_start(self) -> bytes:
        self.current = _reasoning_item(f"rs_{uuid.uuid4().hex[:24]}", "", status="in_progress")
        return self._event("response.output_item.added", output_index=self.blocks, item=dict(self.current, content=[]))

    def reasoning(self, delta: str) -> bytes:
        self.current["content"][0]["text"] += delta
        return self._event("response.reasoning_text.delta", item_id=self.current["id"], output_index=self.blocks,
                           content_index=0, delta=delta)

    def text_start(self) -> bytes:
        self.current = _message_item(f"msg_{uuid.uuid4().hex[:24]}", "", status="in_progress")
        return (self._event("response.output_item.added", output_index=self.blocks,
                            item=dict(self.current, content=[]))
                + self._event("response.content_part.added", item_id=self.current["id"], output_index=self.blocks,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []}))

    def text(self, delta: str) -> bytes:
        self.current["content"][0]["text"] += delta
        return self._event("response.output_text.delta", item_id=self.current["id"], output_index=self.blocks,
                           content_index=0, delta=delta)

    def tool_start(self, call_id: str, name: str) -> bytes:
        self.current = _call_item(f"fc_{uuid.uuid4().hex[:24]}", call_id, name, "", status="in_progress")
        return self._event("response.output_item.added", output_index=self.blocks, item=dict(self.current))

    def tool_args(self, delta: str) -> bytes:
        self.current["arguments"] += delta
        return self._event("response.function_call_arguments.delta", item_id=self.current["id"],
                           output_index=self.blocks, delta=delta)

    def close(self) -> bytes:
        item, self.current = dict(self.current, status="completed"), None
        self.items.append(item)
        if item["type"] == "message":
            text = item["content"][0]["text"]
            out = (self._event("response.output_text.done", item_id=item["id"], output_index=self.blocks,
                               content_index=0, text=text)
                   + self._event("response.content_part.done", item_id=item["id"], output_index=self.blocks,
                                 content_index=0, part=item["content"][0]))
        elif item["type"] == "reasoning":
            out = self._event("response.reasoning_text.done", item_id=item["id"], output_index=self.blocks,
                              content_index=0, text=item["content"][0]["text"])
        else:
            out = self._event("response.function_call_arguments.done", item_id=item["id"], output_index=self.blocks,
                              arguments=item["arguments"])
        return out + self._event("response.output_item.done", output_index=self.blocks, item=item)

    def finish(self) -> bytes:
        usage = self.usage or {}
        final = _response(self.id, self.model, self.items, self.finish_reason,
                          usage.get("prompt_tokens", self.prompt_tokens),
                          usage.get("completion_tokens", self.output_tokens))
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return self._event(kind, response=final)

    def failed(self, message: str) -> bytes:
        """codex retries a stream that ends without response.completed as a network error; an engine failure
        must reach it as one `response.failed`, never as a cut stream."""
        final = _response(self.id, self.model, self.items, None, self.prompt_tokens, self.output_tokens,
                          status="failed")
        final["error"] = {"code": "server_error", "message": message}
        prefix, self.started = (b"" if self.started else self.start()), True
        return prefix + self._event("response.failed", response=final)
