"""The capture proxy against the real vLLM: exact capture (JSON and streamed), true streaming, sampling
policy, budgets, auth and isolation, malformed input, context overflow, journal recovery after kill -9."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openenv.core.harness.training import TrainingTrace
from stubs import Link

from harness_trainer._exceptions import CaptureNotTrainable
from harness_trainer.proxy.client import ProxyClient, ProxyServer
from harness_trainer.rollouts.trace_reader import collect_trace
from harness_trainer.serving.process import free_port

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run",
                                          "parameters": {"type": "object",
                                                         "properties": {"command": {"type": "string"}}}}}]
MESSAGES = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix the bug."}]


def post(session, body, **kw):
    return httpx.post(session["base_url"] + "/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {session['api_key']}"}, **kw)


def stream_events(session, body):
    """(arrival times, parsed data payloads) of a streamed call."""
    times, events = [], []
    with httpx.stream("POST", session["base_url"] + "/chat/completions", json=dict(body, stream=True),
                      headers={"x-api-key": session["api_key"]}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                times.append(time.perf_counter())
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return times, events


def test_json_capture_equals_what_vllm_returned(proxy):
    session = proxy.client.create_session()
    body = {"model": "hosted_vllm/mangled", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 12,
            "logprobs": True, "return_token_ids": True}  # the agent asks too, so it sees vLLM's own fields
    answer = post(session, body).json()
    trace = TrainingTrace.model_validate(proxy.client.trace(session["id"]))
    (turn,) = trace.turns
    assert answer["model"] == "tiny"
    assert turn.prompt_token_ids == answer["prompt_token_ids"]
    assert turn.completion_token_ids == answer["choices"][0]["token_ids"]
    assert turn.per_token_logps == [c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]]
    assert turn.metadata["n_tools"] == 1 and turn.metadata["requested_sampling_params"] == {"max_tokens": 12}
    assert turn.metadata["sampling_params"]["top_p"] == 1.0 and turn.metadata["sampling_params"]["temperature"] == 1.0
    # the rollout pool keeps the body as parsed (rollouts/trace_reader.py: collect_trace), not a model dumped back: the
    # proxy must write every field the model has, with its value as the model holds it
    wire = proxy.client.trace_json(session["id"])
    assert collect_trace(lambda: wire, "a trace") == TrainingTrace.model_validate_json(wire).model_dump(mode="json")


def test_injected_fields_are_hidden_from_an_agent_that_did_not_ask(proxy):
    session = proxy.client.create_session()
    answer = post(session, {"messages": MESSAGES, "max_tokens": 4}).json()
    assert answer["prompt_token_ids"] is None and answer["choices"][0]["token_ids"] is None  # as vLLM says
    assert answer["choices"][0]["logprobs"] is None
    _, events = stream_events(session, {"messages": MESSAGES, "max_tokens": 4})
    for event in events[:-1]:
        assert event.get("prompt_token_ids") is None
        assert all(c.get("token_ids") is None and c.get("logprobs") is None for c in event["choices"])
    assert events[-1] == "[DONE]"


def test_streamed_capture_is_exact_and_truly_streamed(engine, tmp_path):
    """Truly streamed, shown without a clock: a Link (tests/stubs.py) between the proxy and the engine holds the
    engine's answer after its first event; that event must reach the agent while the rest is still held (a
    proxy that buffered would send nothing). Timing it instead lost when vLLM-CPU released a stream whole."""
    link = Link(int(engine.url.rsplit(":", 1)[1]))
    body = {"messages": MESSAGES, "max_tokens": 64, "min_tokens": 64, "logprobs": True, "return_token_ids": True}
    with ProxyServer(link.url, model="tiny", log_path=tmp_path / "proxy.log") as proxy:
        session = proxy.client.create_session()
        link.pause_streams()
        events: list = []
        with httpx.stream("POST", session["base_url"] + "/chat/completions", json=dict(body, stream=True),
                          headers={"x-api-key": session["api_key"]}, timeout=300) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    break
            assert events and not link._released.is_set()  # one event arrived; the engine's rest is held
            link.release()
            events += [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines
                       if line.startswith("data: ")]
        trace = proxy.client.trace(session["id"])
    link.cut()
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    ids = [i for e in chunks for c in e["choices"] for i in c.get("token_ids") or []]
    logps = [x["logprob"] for e in chunks for c in e["choices"] for x in (c.get("logprobs") or {}).get("content") or []]
    (turn,) = TrainingTrace.model_validate(trace).turns
    assert turn.prompt_token_ids == chunks[0]["prompt_token_ids"]
    assert turn.completion_token_ids == ids and turn.per_token_logps == logps and len(ids) == 64


@pytest.mark.parametrize("extra, reason", [
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"n": 2}, "n=2"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "json_schema"),
    ({"tool_choice": {"type": "function", "function": {"name": "bash"}}}, "forces a tool call"),
    ({"temperature": 0}, "temperature 0"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
])
def test_training_policy_refuses_constrained_sampling(proxy, extra, reason):
    session = proxy.client.create_session()
    response = post(session, {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2, **extra})
    assert response.status_code == 400 and reason in response.json()["error"]["message"]
    assert proxy.client.session(session["id"])["calls"] == 0


def test_neutral_sampling_and_token_cap_are_enforced(proxy):
    session = proxy.client.create_session(policy={"temperature": 0.7, "max_tokens_cap": 5})
    post(session, {"messages": MESSAGES, "top_p": 0.5, "top_k": 3, "presence_penalty": 1.0, "max_tokens": 99})
    (turn,) = proxy.client.trace(session["id"])["turns"]
    sent = turn["metadata"]["sampling_params"]
    assert sent["top_p"] == 1.0 and sent["top_k"] == -1 and sent["presence_penalty"] == 0.0
    assert sent["temperature"] == 0.7 and sent["max_tokens"] == 5 and len(turn["completion_token_ids"]) <= 5
    assert turn["metadata"]["requested_sampling_params"]["top_p"] == 0.5


def test_the_graph_is_the_rollout_without_its_tokens(proxy):
    session = proxy.client.create_session()
    post(session, {"messages": MESSAGES, "max_tokens": 3})
    (full,), (graph,) = proxy.client.rollout(session["id"])["calls"], proxy.client.graph(session["id"])["calls"]
    assert not {"prompt_token_ids", "completion_token_ids", "per_token_logps", "request", "message"} & set(graph)
    assert graph["prompt_tokens"] == len(full["prompt_token_ids"]) and graph["completion_tokens"] == \
        len(full["completion_token_ids"])
    assert {k: v for k, v in full.items() if k in graph} == {k: v for k, v in graph.items() if k in full}


def test_budget_exhausted_is_a_clean_unrecorded_stop(proxy):
    session = proxy.client.create_session(max_model_calls=1)
    post(session, {"messages": MESSAGES, "max_tokens": 2})
    answer = post(session, {"messages": MESSAGES + [{"role": "user", "content": "more"}], "max_tokens": 2}).json()
    assert answer["choices"][0]["message"]["content"] == "Step budget exhausted; stopping."
    _, events = stream_events(session, {"messages": MESSAGES, "max_tokens": 2})
    assert events[0]["choices"][0]["delta"]["content"] == "Step budget exhausted; stopping." and events[-1] == "[DONE]"
    assert len(proxy.client.rollout(session["id"])["calls"]) == 1
    assert proxy.client.session(session["id"])["stops"] == ["model-call budget of 1 used up"]


def test_context_overflow_is_a_clean_stop(proxy):
    session = proxy.client.create_session()
    huge = [{"role": "user", "content": "word " * 40000}]
    answer = post(session, {"messages": huge, "max_tokens": 2}).json()
    assert answer["choices"][0]["message"]["content"] == "Context length exceeded; stopping."
    summary = proxy.client.session(session["id"])
    assert summary["calls"] == 0 and summary["stops"][0].startswith("the prompt does not fit the engine")


def test_auth_admin_and_isolation(proxy):
    a, b = proxy.client.create_session(), proxy.client.create_session()
    post(a, {"messages": MESSAGES, "max_tokens": 2})
    assert post({"base_url": a["base_url"], "api_key": "nobody"}, {"messages": MESSAGES}).status_code == 401
    anonymous = httpx.Client(base_url=proxy.url, timeout=10)
    assert anonymous.post("/sessions", json={}).status_code == 401
    assert anonymous.get(f"/sessions/{a['id']}/trace").status_code == 401
    as_b = ProxyClient(proxy.url, admin_key=b["api_key"])
    with pytest.raises(Exception, match="403"):
        as_b.trace(a["id"])
    with pytest.raises(Exception, match="403"):
        as_b.delete(b["id"])
    with pytest.raises(CaptureNotTrainable, match="no agent turns"):
        as_b.trace(b["id"])  # its own: readable, and empty
    assert len(ProxyClient(proxy.url, admin_key=a["api_key"]).trace(a["id"])["turns"]) == 1
    proxy.client.delete(b["id"])
    assert post(b, {"messages": MESSAGES, "max_tokens": 2}).status_code == 401


def test_malformed_requests_get_4xx_and_never_crash(proxy):
    session = proxy.client.create_session()
    headers = {"authorization": f"Bearer {session['api_key']}", "content-type": "application/json"}
    url = session["base_url"] + "/chat/completions"
    cases = [b"{not json", b"[1, 2]", b'"text"', b"", json.dumps({"messages": "hi"}).encode(),
             json.dumps({"messages": []}).encode(), json.dumps({"messages": MESSAGES, "max_tokens": "many"}).encode(),
             json.dumps({"messages": MESSAGES, "temperature": "hot"}).encode(), b"\xff\xfe\x00garbage"]
    for body in cases:
        response = httpx.post(url, content=body, headers=headers, timeout=60)
        assert 400 <= response.status_code < 500, (body, response.status_code, response.text)
    huge = httpx.post(url, content=b"x" * (40 * 1024 * 1024), headers=headers, timeout=60)
    assert huge.status_code == 413
    for method, path in [("GET", "/nope"), ("POST", "/v1/embeddings"), ("PUT", "/sessions"),
                         ("GET", "/sessions/unknown-id/trace")]:
        assert httpx.request(method, proxy.url + path, headers={"authorization": f"Bearer {proxy.admin_key}"},
                             timeout=10).status_code in (401, 404, 405)
    assert proxy.client.http.post("/sessions", json={"max_model_calls": "ten"}).status_code == 400
    assert httpx.get(proxy.url + "/health", timeout=5).status_code == 200


def test_journal_recovers_every_finished_turn_after_kill_9(engine, tmp_path):
    with ProxyServer(engine.url, journal=tmp_path / "journal") as first:
        session = first.client.create_session(id="crash-me", policy_version=3)
        for n in range(3):
            post(session, {"messages": MESSAGES + [{"role": "user", "content": f"step {n}"}], "max_tokens": 3,
                           "tools": TOOLS})
        before = first.client.trace("crash-me")
        first.kill()
    with ProxyServer(engine.url, journal=tmp_path / "journal") as second:
        assert second.client.trace("crash-me") == before
        assert {t["metadata"]["policy_version"] for t in before["turns"]} == {3}
        second.client.set_policy_version(4)
        assert second.client.session("crash-me")["policy_version"] == 4
        second.client.delete("crash-me")
        second.kill()
    with ProxyServer(engine.url, journal=tmp_path / "journal") as third:  # no session left: the version is kept
        assert third.client.policy_state()["policy_version"] == 4
        assert third.client.create_session()["policy_version"] == 4


def test_a_stopped_proxy_leaves_no_ca_key_behind(tmp_path):
    """mitmproxy's CA (private key included; made for the forward port) lives in the proxy's own temp folder:
    gone once it stops; its log stays only where the caller gave no log path. The upstream is never called."""
    with ProxyServer("http://127.0.0.1:9", forward_port=free_port(), log_path=tmp_path / "proxy.log") as given:
        assert (given.confdir / "mitmproxy-ca.pem").exists()
    assert not given._tmp.exists() and (tmp_path / "proxy.log").exists()
    with ProxyServer("http://127.0.0.1:9") as own:
        pass
    assert (own._tmp / "proxy.log").exists() and not own.confdir.exists()


KILLED = """
import os
from harness_trainer.proxy.client import ProxyServer
from harness_trainer.serving.process import free_port
proxy = ProxyServer("http://127.0.0.1:9", forward_port=free_port()).start()
print(proxy._tmp, flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_killed_runs_ca_key_is_cleared_by_the_next_proxy(tmp_path):
    """A run killed by SIGKILL cannot stop its proxy (the tether does) nor clear its folder: the next proxy
    started on the machine clears it, the CA key with it, and keeps the dead run's log for its post-mortem."""
    killed = subprocess.run([sys.executable, "-c", KILLED], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    folder = Path(killed.stdout.strip())
    assert (folder / "scratch" / "conf" / "mitmproxy-ca.pem").exists()  # nothing of the dead run could clear it
    with ProxyServer("http://127.0.0.1:9", log_path=tmp_path / "proxy.log"):
        assert not (folder / "scratch").exists()
    assert (folder / "proxy.log").exists()

def _visible(answer: dict) -> dict:
    """What an agent acts on: drop per-request identifiers."""
    return {k: v for k, v in answer.items() if k not in ("id", "created", "system_fingerprint")}


def test_agent_sees_exactly_what_it_would_see_without_the_proxy(proxy, engine):
    """Same request and seed, direct vs proxied: the agent-visible answer is identical (JSON and stream)."""
    session = proxy.client.create_session()
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 16, "seed": 1234,
            "temperature": 1.0}
    direct = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=120).json()
    proxied = post(session, body).json()
    assert _visible(proxied) == _visible(direct)
    _, streamed = stream_events(session, body)
    with httpx.stream("POST", f"{engine.url}/v1/chat/completions", json=dict(body, stream=True), timeout=120) as r:
        direct_events = [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
                         for line in r.iter_lines() if line.startswith("data: ")]
    folded = _folded(direct_events)
    assert folded["finish"] and folded["last"] == "[DONE]" and (folded["text"].get("content") or folded["tool_calls"])
    assert _folded(streamed) == folded


def _folded(events: list) -> dict:
    """A stream as an agent acts on it, whatever its chunking. vLLM puts one token or several in a chunk depending
    on how far its detokenizer lags its engine (under load, several: ' ``riple' direct, ' ``' + 'riple' proxied),
    so chunk boundaries race the clock; what the chunks add up to does not."""
    chunks = [_visible(e) for e in events if isinstance(e, dict)]
    text: dict[str, str] = {}
    calls: dict[int, dict] = {}
    for choice in (c for e in chunks for c in e.get("choices") or []):
        for key, value in (choice.get("delta") or {}).items():
            if isinstance(value, str):
                text[key] = text.get(key, "") + value
        for call in (choice.get("delta") or {}).get("tool_calls") or []:
            slot = calls.setdefault(call.get("index", 0), {"id": "", "name": "", "arguments": ""})
            function = call.get("function") or {}
            slot["id"] += call.get("id") or ""
            slot["name"] += function.get("name") or ""
            slot["arguments"] += function.get("arguments") or ""
    return {"chunks": sorted({(e.get("object"), e.get("model")) for e in chunks}), "text": text, "tool_calls": calls,
            "finish": [c["finish_reason"] for e in chunks for c in e.get("choices") or [] if c.get("finish_reason")],
            "usage": [e["usage"] for e in chunks if e.get("usage")], "last": events[-1]}
