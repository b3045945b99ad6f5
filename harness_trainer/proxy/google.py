"""Google's Gemini API (`POST /v1beta/models/{model}:generateContent` and `:streamGenerateContent`, as gemini-cli
speaks it through @google/genai) <-> chat completions.

Unlike the other dialects, the route says what is asked: the method names a stream, and `?alt=sse` asks for it as
server-sent events (each event one GenerateContentResponse); without it the stream is one JSON array written
element by element. The model in the path is ignored, as every dialect ignores the agent's model name: the
session's model answers. Google streams a function call whole, never its arguments in pieces, so the stream
holds a call back until the engine has finished it.

Function calls are matched to their responses by id where the agent sends ids (gemini-cli does), else in order
by name; a call without an id is given one from its place in the conversation, so the same history always
renders to the same prompt (one chain per rollout). `thoughtSignature` is Google's opaque token for its own
models' reasoning: dropped on the way in, never sent out.
"""

from __future__ import annotations

import json
import re
import uuid

from harness_trainer.proxy.translate import reasoning_of, tool_arguments

ROUTE = re.compile(r"^/(?:v1|v1beta|v1alpha)/models/([^/:]+):(generateContent|streamGenerateContent|countTokens)$")
FINISH = {"stop": "STOP", "length": "MAX_TOKENS", "tool_calls": "STOP", None: "STOP"}
STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
          405: "INVALID_ARGUMENT", 408: "DEADLINE_EXCEEDED", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED",
          500: "INTERNAL", 502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
GENERATION_FIELDS = (("max_tokens", "maxOutputTokens"), ("temperature", "temperature"), ("top_p", "topP"),
                     ("top_k", "topK"), ("stop", "stopSequences"), ("seed", "seed"),
                     ("presence_penalty", "presencePenalty"), ("frequency_penalty", "frequencyPenalty"))
CALLING_MODES = {"AUTO": "auto", "VALIDATED": "auto", "NONE": "none", "ANY": "required"}


def _snake(name: str) -> str:
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name)


def field(obj: dict, name: str, default=None):
    """obj's field `name` (lowerCamelCase), or its proto name in snake_case: Google's JSON parser takes both,
    and its own Python SDK sends some fields (parameters_json_schema) in snake_case."""
    value = obj.get(name)
    return value if value is not None else obj.get(_snake(name), default)


def route(path: str) -> tuple[str, str] | None:
    """(model, method) of a Gemini API path (without its query), or None."""
    match = ROUTE.match(path)
    return (match.group(1), match.group(2)) if match else None


def _lower_types(schema):
    """Gemini's `parameters` (an OpenAPI subset) spells types in capitals ("OBJECT"); JSON Schema does not."""
    if isinstance(schema, dict):
        return {k: (v.lower() if k == "type" and isinstance(v, str) else _lower_types(v)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_lower_types(v) for v in schema]
    return schema


def _tools(tools: list) -> list[dict]:
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise ValueError("each tool must be an object")
        hosted = [k for k in tool if k not in ("functionDeclarations", "function_declarations")]
        if hosted:
            raise ValueError(f"tool {hosted[0]!r} is run by Google's servers; the served model can only call "
                             "declared functions (functionDeclarations)")
        for fn in field(tool, "functionDeclarations") or []:
            if not isinstance(fn, dict) or not fn.get("name"):
                raise ValueError("each function declaration needs a name")
            schema = field(fn, "parametersJsonSchema") or _lower_types(fn.get("parameters")) \
                or {"type": "object", "properties": {}}
            out.append({"type": "function", "function": {"name": fn["name"], "description": fn.get("description", ""),
                                                          "parameters": schema}})
    return out


def _tool_choice(config) -> object:
    calling = field(config or {}, "functionCallingConfig") or {}
    mode = str(calling.get("mode") or "AUTO").upper()
    if mode not in CALLING_MODES:
        raise ValueError(f"functionCallingConfig mode {calling.get('mode')!r} is not AUTO, ANY, NONE or VALIDATED")
    names = field(calling, "allowedFunctionNames") or []
    if mode == "ANY" and len(names) == 1:
        return {"type": "function", "function": {"name": names[0]}}
    return CALLING_MODES[mode]


def _response_text(response) -> str:
    """A function's result as the tool message's text: gemini-cli's `{"output": text}` is the text itself."""
    if isinstance(response, dict) and list(response) == ["output"] and isinstance(response["output"], str):
        return response["output"]
    return json.dumps(response, ensure_ascii=False)


def _text(part: dict) -> str:
    for kind in ("inlineData", "fileData", "executableCode", "codeExecutionResult"):
        if field(part, kind) is not None:
            raise ValueError(f"'{kind}' parts are not supported: the served model reads and writes text only")
    text = part.get("text", "")
    if not isinstance(text, str):
        raise ValueError("a part's text must be a string")
    return text


def contents_messages(contents: list) -> list[dict]:
    """Gemini `contents` as chat messages: a model turn's thoughts, text and function calls make one assistant
    message; a user turn's function responses become tool messages (before its text, as the calls came first)."""
    messages: list[dict] = []
    pending: list[tuple[str, str]] = []  # (id, name) of calls not yet answered, oldest first
    made = 0  # ids given to calls that came without one
    for content in contents:
        if not isinstance(content, dict) or not isinstance(content.get("parts", []), list):
            raise ValueError("each content needs a list of parts")
        role = content.get("role") or "user"
        if role not in ("user", "model", "function"):
            raise ValueError(f"content role {role!r} is not 'user' or 'model'")
        parts = [p for p in content.get("parts") or [] if isinstance(p, dict)]
        if role == "model":
            calls, text, thought = [], [], []
            for part in parts:
                if call := field(part, "functionCall"):
                    if not isinstance(call, dict) or not call.get("name"):
                        raise ValueError("a functionCall needs a name")
                    ident = call.get("id") or f"call_{made}"
                    made += 0 if call.get("id") else 1
                    pending.append((ident, call["name"]))
                    calls.append({"id": ident, "type": "function", "function": {
                        "name": call["name"], "arguments": json.dumps(call.get("args") or {})}})
                else:
                    (thought if part.get("thought") else text).append(_text(part))
            messages.append({"role": "assistant", "content": "".join(text) or None,
                             **({"tool_calls": calls} if calls else {}),
                             **({"reasoning_content": "".join(thought)} if thought else {})})
            continue
        text = []
        for part in parts:
            if (answer := field(part, "functionResponse")) is not None:
                if not isinstance(answer, dict):
                    raise ValueError("a functionResponse must be an object")
                ident = answer.get("id") or next((i for i, name in pending if name == answer.get("name")),
                                                 f"call_{answer.get('name')}")
                pending = [(i, n) for i, n in pending if i != ident]
                messages.append({"role": "tool", "tool_call_id": ident,
                                 "content": _response_text(answer.get("response"))})
            elif not part.get("thought"):
                text.append(_text(part))
        if text:
            messages.append({"role": "user", "content": "".join(text)})
    return messages


def _system(instruction) -> str:
    if isinstance(instruction, str):
        return instruction
    if isinstance(instruction, dict):
        return "".join(_text(p) for p in instruction.get("parts") or [] if isinstance(p, dict))
    raise ValueError("systemInstruction must be a content ({parts: [...]}) or a string")


class GoogleDialect:
    """One request's dialect: the route decides streaming (`method`) and its framing (`sse`)."""
    name = "google"
    paths = ()  # matched by `route`, not by a fixed path

    def __init__(self, method: str = "generateContent", sse: bool = False):
        self.method = method
        self.sse = sse
        self.stream_content_type = "text/event-stream" if sse else "application/json"

    def wants_stream(self, body: dict) -> bool:
        return self.method == "streamGenerateContent"

    def to_chat(self, body: dict) -> dict:
        body = field(body, "generateContentRequest") or body  # countTokens may wrap a whole request
        if not isinstance(body.get("contents"), list):
            raise ValueError("'contents' must be a list")
        system = field(body, "systemInstruction")
        messages = [{"role": "system", "content": _system(system)}] if system else []
        messages += contents_messages(body["contents"])
        chat = {"messages": messages, "stream": self.wants_stream(body)}
        if tools := _tools(body.get("tools") or []):
            chat["tools"] = tools
            if (choice := _tool_choice(field(body, "toolConfig"))) != "auto":
                chat["tool_choice"] = choice
        config = field(body, "generationConfig") or {}
        if not isinstance(config, dict):
            raise ValueError("generationConfig must be an object")
        if field(config, "candidateCount", 1) != 1:
            raise ValueError("candidateCount must be 1: each call is one sample of the agent's rollout")
        for ours, theirs in GENERATION_FIELDS:
            if (value := field(config, theirs)) is not None:
                chat[ours] = value
        schema = field(config, "responseJsonSchema") or _lower_types(field(config, "responseSchema"))
        if field(config, "responseMimeType") == "application/json":
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}} \
                if schema else {"type": "json_object"}
        return chat

    def from_chat(self, answer: dict, asked: dict) -> dict:
        choice = (answer.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        parts = [{"text": reasoning_of(message), "thought": True}] if reasoning_of(message) else []
        parts += [{"text": message["content"]}] if message.get("content") else []
        parts += [_call_part(call) for call in message.get("tool_calls") or []]
        return _response(parts, FINISH.get(choice.get("finish_reason"), "STOP"), answer.get("usage") or {},
                         answer.get("model"))

    def stream_translator(self, asked: dict) -> GoogleStream:
        return GoogleStream(self.sse)

    def stop_answer(self, asked: dict, model: str, text: str, stream: bool) -> bytes:
        answer = _response([{"text": text}], "STOP", {}, model)
        if not stream:
            return json.dumps(answer).encode()
        s = GoogleStream(self.sse)
        return s.frame(answer) + s.end()

    def error(self, status: int, message: str) -> dict:
        return {"error": {"code": status, "message": message, "status": STATUS.get(status, "INTERNAL")}}


def _call_part(call: dict) -> dict:
    fn = call.get("function") or {}
    return {"functionCall": {"id": call.get("id") or f"call_{uuid.uuid4().hex[:12]}", "name": fn.get("name"),
                             "args": tool_arguments(fn.get("arguments"))}}


def _response(parts: list, finish: str | None, usage: dict, model: str | None) -> dict:
    candidate = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish:
        candidate["finishReason"] = finish
    answer = {"candidates": [candidate], "modelVersion": model, "responseId": uuid.uuid4().hex[:24]}
    if usage:
        answer["usageMetadata"] = {"promptTokenCount": usage.get("prompt_tokens", 0),
                                   "candidatesTokenCount": usage.get("completion_tokens", 0),
                                   "totalTokenCount": usage.get("total_tokens", 0)}
    return answer


class GoogleStream:
    """Chat chunks -> GenerateContentResponse chunks: text and thoughts as they come, each function call whole
    once finished, the finish reason and usage in the last; framed as SSE events or as one JSON array."""

    def __init__(self, sse: bool):
        self.sse = sse
        self.opened = False  # the JSON array's '[' is written
        self.calls: dict[int, dict] = {}  # chat tool index -> the call being assembled
        self.finish_reason: str | None = None
        self.usage: dict = {}
        self.model: str | None = None
        self.prompt_tokens = self.output_tokens = 0  # counted from the ids when the engine sends no usage

    def frame(self, answer: dict) -> bytes:
        data = json.dumps(answer, ensure_ascii=False).encode()
        if self.sse:
            return b"data: " + data + b"\r\n\r\n"
        first, self.opened = not self.opened, True
        return (b"[" if first else b",\r\n") + data

    def end(self) -> bytes:
        return b"" if self.sse else (b"" if self.opened else b"[") + b"]"

    def event(self, raw: bytes, chunk: dict | None) -> bytes:
        if chunk is None:
            return b""
        self.model = chunk.get("model") or self.model
        self.usage = chunk.get("usage") or self.usage
        self.prompt_tokens = self.prompt_tokens or len(chunk.get("prompt_token_ids") or [])
        parts = []
        for choice in chunk.get("choices") or []:
            self.output_tokens += len(choice.get("token_ids") or [])
            delta = choice.get("delta") or {}
            if thought := reasoning_of(delta):
                parts.append({"text": thought, "thought": True})
            if delta.get("content"):
                parts.append({"text": delta["content"]})
            for piece in delta.get("tool_calls") or []:
                call = self.calls.setdefault(piece.get("index", 0), {"id": None, "name": "", "arguments": ""})
                fn = piece.get("function") or {}
                call["id"] = piece.get("id") or call["id"]
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return self.frame(_response(parts, None, {}, self.model)) if parts else b""

    def done(self) -> bytes:
        parts = [_call_part({"id": c["id"], "function": c}) for _, c in sorted(self.calls.items())]
        usage = self.usage or {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.output_tokens,
                               "total_tokens": self.prompt_tokens + self.output_tokens}
        return self.frame(_response(parts, FINISH.get(self.finish_reason, "STOP"), usage, self.model)) \
            + self.end()

    def failed(self, message: str) -> bytes:
        return self.frame({"error": {"code": 500, "message": message, "status": "INTERNAL"}}) + self.end()
