"""Anthropic Messages and OpenAI Responses through the proxy, JSON and streamed, read by the vendors' own client
libraries (Google's Gemini API: test_google_dialect.py); each call is captured exactly like a chat completion.
Also: tool definitions and tool history translate, count_tokens is answered by the engine and not recorded,
upstream faults are retried."""

from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer

import anthropic
import httpx
import openai
import pytest
from openenv.core.harness.training import TrainingTrace
from stubs import FlakyUpstream, StubHandler

from harness_trainer.proxy.client import ProxyServer

BASH = {"name": "bash", "description": "run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}


def anthropic_client(proxy, session):
    return anthropic.Anthropic(base_url=proxy.url, api_key=session["api_key"], max_retries=0)


def test_anthropic_json_and_stream(proxy):
    session = proxy.client.create_session(policy={"max_tokens_cap": 12})
    client = anthropic_client(proxy, session)
    history = [{"role": "user", "content": "list files"},
               {"role": "assistant", "content": [{"type": "text", "text": "ok"},
                                                 {"type": "tool_use", "id": "t1", "name": "bash",
                                                  "input": {"command": "ls"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py"}]}]
    message = client.messages.create(model="claude-any", max_tokens=12, system="You are an agent.",
                                      messages=history, tools=[BASH])
    assert message.type == "message" and message.model == "tiny"
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with client.messages.stream(model="claude-x", max_tokens=12, messages=[{"role": "user", "content": "hi"}],
                                tools=[BASH]) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    calls = proxy.client.rollout(session["id"])["calls"]
    assert [c["dialect"] for c in calls] == ["anthropic", "anthropic"] and [c["stream"] for c in calls] == [False, True]
    first = calls[0]["request"]["messages"]
    assert first[0] == {"role": "system", "content": "You are an agent."}
    assert first[2]["tool_calls"][0]["function"] == {"name": "bash", "arguments": json.dumps({"command": "ls"})}
    assert first[3] == {"role": "tool", "tool_call_id": "t1", "content": "a.py"}
    assert calls[0]["request"]["tools"][0]["function"]["parameters"] == BASH["input_schema"]
    assert (calls[1]["message"]["content"] or "") == streamed_text
    assert final.usage.output_tokens == len(calls[1]["completion_token_ids"])
    trace = TrainingTrace.model_validate(proxy.client.trace(session["id"]))
    assert len(trace.turns) == 2


def test_claude_codes_attribution_hash_and_mid_conversation_system_message(proxy):
    """What claude-code sends: a first system block with a per-call hash (dropped, so consecutive calls share
    their prefix and become one chain) and a `role: system` message inside `messages` (kept, as a system turn)."""
    session = proxy.client.create_session(policy={"max_tokens_cap": 4})
    client = anthropic_client(proxy, session)
    history = [{"role": "user", "content": "list files"}, {"role": "system", "content": "Agents: none."},
               {"role": "user", "content": "go"}]
    for nonce in ("1a2b3", "9f8e7"):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{nonce};"},
                  {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
        client.messages.create(model="claude-opus-4-8", max_tokens=4, system=system, tools=[BASH], messages=history)
        history = history + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    calls = proxy.client.rollout(session["id"])["calls"]
    first, second = (c["request"]["messages"] for c in calls)
    assert first[0] == {"role": "system", "content": "You are Claude Code."}
    assert first[2] == {"role": "system", "content": "Agents: none."} and first == second[:len(first)]
    a, b = calls[0]["prompt_token_ids"], calls[1]["prompt_token_ids"]
    shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    assert shared >= len(a) - 5  # all but the generation prompt: the second call extends the first


def test_anthropic_count_tokens_is_answered_not_recorded(proxy, tokenizer):
    session = proxy.client.create_session()
    count = anthropic_client(proxy, session).messages.count_tokens(
        model="claude-x", messages=[{"role": "user", "content": "hello there"}])
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    assert count.input_tokens == len(expected)
    assert proxy.client.session(session["id"])["calls"] == 0


def test_responses_json_and_stream(proxy):
    session = proxy.client.create_session(policy={"max_tokens_cap": 12})
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    tools = [{"type": "function", "name": "bash", "description": "run", "parameters": BASH["input_schema"]}]
    items = [{"role": "user", "content": "list files"},
             {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": "{\"command\": \"ls\"}"},
             {"type": "function_call_output", "call_id": "c1", "output": "a.py"}]
    response = client.responses.create(model="gpt-5", instructions="You are an agent.", input=items, tools=tools,
                                       max_output_tokens=12, store=False)
    assert response.object == "response" and response.model == "tiny"
    events = list(client.responses.create(model="gpt-5", input="hi", tools=tools, stream=True, store=False))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    calls = proxy.client.rollout(session["id"])["calls"]
    assert [c["dialect"] for c in calls] == ["responses", "responses"]
    first = calls[0]["request"]["messages"]
    assert first[0]["role"] == "system" and first[2]["tool_calls"][0]["id"] == "c1"
    assert first[3] == {"role": "tool", "tool_call_id": "c1", "content": "a.py"}
    assert (calls[1]["message"]["content"] or "") == streamed
    assert response.output_text == (calls[0]["message"]["content"] or "")
    TrainingTrace.model_validate(proxy.client.trace(session["id"]))


def test_responses_refuses_server_side_state(proxy):
    session = proxy.client.create_session()
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="m", input="hi", previous_response_id="resp_1")


def test_dialect_budget_stops_are_in_the_agents_dialect(proxy):
    session = proxy.client.create_session(max_model_calls=0)
    message = anthropic_client(proxy, session).messages.create(model="c", max_tokens=5,
                                                              messages=[{"role": "user", "content": "hi"}])
    assert message.content[0].text == "Step budget exhausted; stopping."
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    events = list(client.responses.create(model="m", input="hi", stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Step budget exhausted; stopping."


def test_upstream_faults_are_retried_then_passed_through(engine, tmp_path):
    FlakyUpstream.engine_url, FlakyUpstream.failures, FlakyUpstream.seen = engine.url, 2, 0
    stub = ThreadingHTTPServer(("127.0.0.1", 0), FlakyUpstream)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    try:
        with ProxyServer(f"http://127.0.0.1:{stub.server_port}", model="tiny", log_path=tmp_path / "p.log") as proxy:
            session = proxy.client.create_session()
            headers = {"authorization": f"Bearer {session['api_key']}"}
            ok = httpx.post(session["base_url"] + "/chat/completions", headers=headers, timeout=60,
                            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            assert ok.status_code == 200 and FlakyUpstream.seen == 3  # two 503s, then the answer
            assert len(proxy.client.trace(session["id"])["turns"]) == 1
            bad = httpx.post(session["base_url"] + "/chat/completions", headers=headers, timeout=60,
                             json={"messages": [{"role": "user", "content": "bad"}], "max_tokens": 3})
            assert bad.status_code == 422 and bad.json()["error"]["message"] == "upstream says no"
            assert proxy.client.session(session["id"])["engine_failure"] is None  # the engine did answer
            FlakyUpstream.failures, FlakyUpstream.seen = 99, 0
            down = httpx.post(session["base_url"] + "/chat/completions", headers=headers, timeout=60,
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            assert down.status_code == 503 and FlakyUpstream.seen == 4  # 1 + 3 retries, then passed through
            assert proxy.client.session(session["id"])["calls"] == 1
            assert proxy.client.session(session["id"])["engine_failure"] == "the engine answered HTTP 503"
    finally:
        stub.shutdown()


def test_a_call_no_engine_answers_is_the_sessions_engine_failure(tmp_path):
    """The rollout of an agent that stopped on it is unscorable (rollouts/session.py); no engine needed."""
    with ProxyServer("http://127.0.0.1:9", model="tiny", log_path=tmp_path / "p.log") as proxy:
        session = proxy.client.create_session()
        down = httpx.post(session["base_url"] + "/chat/completions", timeout=60,
                          headers={"authorization": f"Bearer {session['api_key']}"},
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert down.status_code == 502 and "could not be reached" in down.json()["error"]["message"]
        assert "could not be reached" in proxy.client.session(session["id"])["engine_failure"]
    assert f"session {session['id']}: no answer from the engine" in (tmp_path / "p.log").read_text()  # its log says


class CutStreamUpstream(StubHandler):
    """A stub upstream for fault injection: relays the real engine's stream for `keep` events, then either
    drops the connection mid-body (an engine that died: no terminating chunk) or sends vLLM's in-stream error
    event and [DONE]."""
    engine_url, keep, mode = "", 3, "cut"
    protocol_version = "HTTP/1.1"

    do_GET = FlakyUpstream.do_GET

    def do_POST(self):
        payload = self.rfile.read(int(self.headers["content-length"]))
        with httpx.stream("POST", self.engine_url + self.path, content=payload, timeout=60,
                          headers={"content-type": "application/json"}) as answer:
            events = [e for e in answer.read().split(b"\n\n") if e.strip()]
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        sent = [event + b"\n\n" for event in events[:self.keep]]
        if self.mode == "error":
            sent.append(b'data: {"error": {"message": "engine fell over", "code": 500}}\n\ndata: [DONE]\n\n')
        for data in sent:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        if self.mode == "error":
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self.close_connection = True  # "cut": closed with no terminating chunk


@pytest.mark.parametrize("mode", ["cut", "error"])
def test_a_stream_the_engine_breaks_ends_in_the_dialects_error_event(engine, tmp_path, mode):
    """Never a stream that just stops: codex and claude-code retry on their dialect's error event."""
    CutStreamUpstream.engine_url, CutStreamUpstream.mode = engine.url, mode
    stub = ThreadingHTTPServer(("127.0.0.1", 0), CutStreamUpstream)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    hi = [{"role": "user", "content": "hi"}]
    asks = {"chat": ("/v1/chat/completions", {"messages": hi, "max_tokens": 16}),
            "anthropic": ("/v1/messages?beta=true", {"messages": hi, "max_tokens": 16}),
            # the Responses API's own name for the limit: `max_tokens` there is ignored, and the answer would run to EOS
            "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 16}),
            "google": ("/v1beta/models/m:streamGenerateContent?alt=sse",
                       {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": 16}})}
    try:
        with ProxyServer(f"http://127.0.0.1:{stub.server_port}", model="tiny", log_path=tmp_path / "p.log") as proxy:
            session = proxy.client.create_session()
            for dialect, (path, body) in asks.items():
                answer = httpx.post(proxy.url + path, headers={"authorization": f"Bearer {session['api_key']}"},
                                    json={"model": "m", "stream": True, **body}, timeout=60)
                events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
                last = events[-1]
                if dialect == "chat":
                    assert "error" in last and "[DONE]" not in answer.text, answer.text
                elif dialect == "anthropic":
                    assert last["type"] == "error" and "message_stop" not in answer.text, answer.text
                elif dialect == "google":  # no finish reason before the error: @google/genai throws on it
                    assert last["error"]["status"] == "INTERNAL" and "finishReason" not in answer.text, answer.text
                else:
                    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
                    assert "response.completed" not in answer.text and events[0]["type"] == "response.created"
                expected = "engine fell over" if mode == "error" else "stream broke off"
                assert expected in json.dumps(last)
            calls = proxy.client.rollout(session["id"])["calls"]
            assert len(calls) == 4 and all(c["problem"] for c in calls)  # recorded, never trained on
            assert proxy.client.session(session["id"])["engine_failure"] == "the stream broke off"
    finally:
        stub.shutdown()
