"""Google's Gemini API through the proxy, read by Google's own client library (google-genai): JSON, SSE stream
and the JSON-array stream, captured exactly like a chat completion; function calls and responses matched by id;
countTokens answered by the engine and not recorded; errors in Google's shape. The wire sample is gemini-cli's
own second request (tests/proxy/wire/gemini_cli_request.json, recorded from gemini-cli 0.61.0)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from google import genai
from google.genai import errors, types
from openenv.core.harness.training import TrainingTrace

from harness_trainer.proxy.dialects import dialect_for
from harness_trainer.proxy.google import GoogleDialect, GoogleStream

WIRE = Path(__file__).with_name("wire") / "gemini_cli_request.json"
SHELL = types.FunctionDeclaration(name="run_shell_command", description="run a command",
                                  parameters_json_schema={"type": "object",
                                                          "properties": {"command": {"type": "string"}}})


def client(proxy, session) -> genai.Client:
    return genai.Client(api_key=session["api_key"], http_options=types.HttpOptions(
        base_url=proxy.url, retry_options=types.HttpRetryOptions(attempts=1)))


def test_generate_content_json_and_sse_stream(proxy):
    session = proxy.client.create_session(policy={"max_tokens_cap": 12})
    gemini = client(proxy, session)
    history = [types.Content(role="user", parts=[types.Part(text="list files")]),
               types.Content(role="model", parts=[types.Part(function_call=types.FunctionCall(
                   id="c1", name="run_shell_command", args={"command": "ls"}))]),
               types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                   id="c1", name="run_shell_command", response={"output": "a.py"}))])]
    config = types.GenerateContentConfig(system_instruction="You are an agent.", max_output_tokens=12,
                                         tools=[types.Tool(function_declarations=[SHELL])])
    answer = gemini.models.generate_content(model="gemini-any", contents=history, config=config)
    assert answer.candidates[0].finish_reason in ("STOP", "MAX_TOKENS") and answer.model_version == "tiny"
    chunks = list(gemini.models.generate_content_stream(model="gemini-x", contents="hi", config=config))
    streamed = "".join(part.text or "" for chunk in chunks for part in chunk.candidates[0].content.parts or []
                       if not part.thought)
    calls = proxy.client.rollout(session["id"])["calls"]
    assert [c["dialect"] for c in calls] == ["google", "google"] and [c["stream"] for c in calls] == [False, True]
    first = calls[0]["request"]["messages"]
    assert first[0] == {"role": "system", "content": "You are an agent."}
    assert first[2]["tool_calls"][0] == {"id": "c1", "type": "function", "function": {
        "name": "run_shell_command", "arguments": json.dumps({"command": "ls"})}}
    assert first[3] == {"role": "tool", "tool_call_id": "c1", "content": "a.py"}
    assert calls[0]["request"]["tools"][0]["function"]["parameters"]["properties"] == {"command": {"type": "string"}}
    assert (calls[0]["message"]["content"] or "") == (answer.text or "")
    assert (calls[1]["message"]["content"] or "") == streamed
    assert chunks[-1].usage_metadata.candidates_token_count == len(calls[1]["completion_token_ids"])
    assert len(TrainingTrace.model_validate(proxy.client.trace(session["id"])).turns) == 2


def test_a_forced_function_call_comes_back_whole_and_is_echoed_by_id(proxy):
    """ANY with one allowed name forces the call (the engine's guided decoding): in the stream it arrives as
    one functionCall part, with the engine's call id, and the next request's echo of it extends the chain.
    (A forced call is refused in training sessions, so this one is an evaluation session.)"""
    session = proxy.client.create_session(policy={"max_tokens_cap": 40, "training": False})
    gemini = client(proxy, session)
    config = types.GenerateContentConfig(
        max_output_tokens=40, tools=[types.Tool(function_declarations=[SHELL])],
        tool_config=types.ToolConfig(function_calling_config=types.FunctionCallingConfig(
            mode="ANY", allowed_function_names=["run_shell_command"])))
    contents = [types.Content(role="user", parts=[types.Part(text="make a file")])]
    chunks = list(gemini.models.generate_content_stream(model="m", contents=contents, config=config))
    calls = [p.function_call for c in chunks for p in c.candidates[0].content.parts or [] if p.function_call]
    assert len(calls) == 1 and calls[0].name == "run_shell_command" and calls[0].id
    captured = proxy.client.rollout(session["id"])["calls"][0]
    assert captured["message"]["tool_calls"][0]["id"] == calls[0].id
    contents += [types.Content(role="model", parts=[types.Part(function_call=calls[0])]),
                 types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                     id=calls[0].id, name=calls[0].name, response={"output": "done"}))])]
    gemini.models.generate_content(model="m", contents=contents, config=types.GenerateContentConfig(
        max_output_tokens=4, tools=[types.Tool(function_declarations=[SHELL])]))
    first, second = proxy.client.rollout(session["id"])["calls"]
    # the echo extends the first prompt (a forced call's sampled tokens are its arguments alone, not the
    # template's call format, so the chain through free calls is the oracle's test: test_eval_command.py)
    assert second["prompt_token_ids"][:len(first["prompt_token_ids"])] == first["prompt_token_ids"]
    assert second["request"]["messages"][1]["tool_calls"][0]["id"] == calls[0].id


def test_the_json_array_stream_and_a_key_in_the_query(proxy):
    """Without `alt=sse` a stream is one JSON array, written element by element (what the REST API does)."""
    session = proxy.client.create_session(policy={"max_tokens_cap": 6})
    answer = httpx.post(f"{proxy.url}/v1beta/models/m:streamGenerateContent?key={session['api_key']}",
                        json={"contents": [{"parts": [{"text": "hi"}]}],
                              "generationConfig": {"maxOutputTokens": 6}}, timeout=60)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("application/json")
    chunks = answer.json()
    assert isinstance(chunks, list) and chunks[-1]["candidates"][0]["finishReason"] in ("STOP", "MAX_TOKENS")
    text = "".join(p.get("text", "") for c in chunks for p in c["candidates"][0]["content"]["parts"])
    assert text == (proxy.client.rollout(session["id"])["calls"][0]["message"]["content"] or "")


def test_count_tokens_is_answered_not_recorded_and_errors_are_googles(proxy, tokenizer):
    session = proxy.client.create_session()
    gemini = client(proxy, session)
    count = gemini.models.count_tokens(model="m", contents="hello there")
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    assert count.total_tokens == len(expected) and proxy.client.session(session["id"])["calls"] == 0
    stranger = client(proxy, {"api_key": "not-a-session"})
    with pytest.raises(errors.ClientError) as refused:
        stranger.models.generate_content(model="m", contents="hi")
    assert refused.value.code == 401 and refused.value.status == "UNAUTHENTICATED"
    with pytest.raises(errors.ClientError, match="candidateCount must be 1"):
        gemini.models.generate_content(model="m", contents="hi",
                                       config=types.GenerateContentConfig(candidate_count=2))
    with pytest.raises(errors.ClientError, match="text only"):
        gemini.models.generate_content(model="m", contents=[types.Part(
            inline_data=types.Blob(mime_type="image/png", data=b"\x89PNG"))])


def test_gemini_clis_own_request_translates_whole():
    """gemini-cli 0.61.0's second call as it was sent (its 30 kB system prompt and 15 tools cut to two): a
    functionCall with gemini-cli's id and a `thoughtSignature`, its functionResponse, parametersJsonSchema."""
    wire = json.loads(WIRE.read_text())
    dialect = dialect_for(wire["path"])
    assert isinstance(dialect, GoogleDialect) and dialect.wants_stream(wire["body"]) and dialect.sse
    chat = dialect.to_chat(wire["body"])
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "assistant", "tool"]
    call = chat["messages"][2]["tool_calls"][0]
    assert call["id"] == chat["messages"][3]["tool_call_id"] == "run_shell_command_1796592042069_0"
    assert json.loads(call["function"]["arguments"]) == {"command": "echo hi > out.txt"}
    assert chat["messages"][3]["content"].startswith("<untrusted_context>")
    assert [t["function"]["name"] for t in chat["tools"]] == ["read_file", "run_shell_command"]
    assert chat["temperature"] == 1 and chat["top_p"] == 0.95 and chat["top_k"] == 64


def test_calls_without_ids_pair_with_their_responses_in_order():
    contents = [{"role": "user", "parts": [{"text": "go"}]},
                {"role": "model", "parts": [{"functionCall": {"name": "a", "args": {}}},
                                            {"functionCall": {"name": "b", "args": {"x": 1}}}]},
                {"role": "user", "parts": [{"functionResponse": {"name": "b", "response": {"ok": True}}},
                                           {"functionResponse": {"name": "a", "response": {"output": "A"}}}]}]
    messages = GoogleDialect().to_chat({"contents": contents})["messages"]
    ids = [c["id"] for c in messages[1]["tool_calls"]]
    assert ids == ["call_0", "call_1"]
    assert [(m["tool_call_id"], m["content"]) for m in messages[2:]] == [("call_1", '{"ok": true}'), ("call_0", "A")]
    assert GoogleDialect().to_chat({"contents": contents}) == GoogleDialect().to_chat({"contents": contents})


def test_the_stream_holds_a_call_until_it_is_whole():
    """Chat streams a call's arguments in pieces; Google never does. Fed the pieces, the translator writes
    text at once and the call whole at the end, with the finish reason and usage."""
    stream = GoogleStream(sse=True)
    pieces = [{"choices": [{"delta": {"content": "ok "}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "k1",
                                                      "function": {"name": "run", "arguments": '{"comm'}}]}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'and": "ls"}'}}]},
                            "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}]
    out = b"".join(stream.event(b"", p) for p in pieces) + stream.done()
    events = [json.loads(e[6:]) for e in out.split(b"\r\n\r\n") if e]
    assert events[0]["candidates"][0]["content"]["parts"] == [{"text": "ok "}]
    last = events[-1]
    assert last["candidates"][0]["content"]["parts"] == [{"functionCall": {"id": "k1", "name": "run",
                                                                           "args": {"command": "ls"}}}]
    assert last["candidates"][0]["finishReason"] == "STOP" and last["usageMetadata"]["candidatesTokenCount"] == 9
    assert len(events) == 2
