"""Long rollouts through the real proxy process with its journal: each token stored once, the proxy killed -9
mid-rollout loses no finished turn, and the traces after the restart equal those before, token for token.

The engine is bench/template_engine.py, a stub that renders the conversation as a chat template does (a real
vLLM on CPU cannot be asked for 64 turns of a growing context within the default tier's time); what it answers
is derived from each session and turn, so a mix-up between sessions shows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from harness_trainer.proxy.client import ProxyServer
from harness_trainer.proxy.store import unpacked
from harness_trainer.serving.process import free_port
from harness_trainer.traces.compact import expand
from tests.stubs import wait_until

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import template_engine  # noqa: E402

TURNS, KILL_AT, TOOL_BYTES = 64, 40, 1_000


def _engine() -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, str(BENCH / "template_engine.py"), str(port)])
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, 60, "the template engine to listen")
    return process, url


def _turns(proxy: ProxyServer, sessions: dict[str, list[dict]], upto: int) -> None:
    """Each session's agent, on from where it is to `upto` turns: it sends its whole conversation every turn."""
    with httpx.Client(timeout=60) as http:
        for sid, messages in sessions.items():
            while (done := sum(m["role"] == "assistant" for m in messages)) < upto:
                answer = http.post(f"{proxy.url}/v1/chat/completions", headers={"authorization": f"Bearer {sid}"},
                                   json={"model": "tiny", "messages": messages, "tools": template_engine.TOOLS})
                assert answer.status_code == 200, answer.text
                reply = answer.json()["choices"][0]["message"]["content"]
                assert reply == f"turn {done} of [[{sid}]]"  # its own answer, no other session's
                messages += [{"role": "assistant", "content": reply},
                             template_engine.tool_output(sid, done, TOOL_BYTES)]


def test_a_long_rollout_is_stored_once_and_survives_kill_9_token_for_token(tmp_path):
    engine, url = _engine()
    journal, port = tmp_path / "journal", free_port()
    sessions = {f"long-{k}": template_engine.first_messages(f"long-{k}") for k in range(2)}
    try:
        with ProxyServer(url, journal=journal, port=port) as first:
            for sid in sessions:
                first.client.create_session(id=sid)
            _turns(first, sessions, KILL_AT)
            before = {sid: first.client.trace(sid) for sid in sessions}
            first.kill()
        with ProxyServer(url, journal=journal, port=port) as second:
            assert {sid: second.client.trace(sid) for sid in sessions} == before
            _turns(second, sessions, TURNS)  # the same rollouts go on: their parents are in records before the kill
            for sid, messages in sessions.items():
                trace = second.client.trace(sid)
                compact = json.loads(second.client.trace_json(sid, compact=True))
                assert expand(compact) == trace
                assert trace["turns"][:KILL_AT] == before[sid]["turns"]
                _check_exact(trace, compact, messages, sid)
                _check_stored_once(journal / f"{sid}.jsonl", trace)
    finally:
        engine.kill()
        engine.wait()


def _check_exact(trace: dict, compact: dict, messages: list[dict], sid: str) -> None:
    """Every turn's prompt is the engine's rendering of what the agent sent, its completion and logprobs the
    engine's own for that session and turn, and the compact form ships each prompt token once."""
    assert len(trace["turns"]) == TURNS
    for turn, entry in enumerate(trace["turns"]):
        sent = messages[:2 + 2 * turn]
        assert entry["prompt_token_ids"] == template_engine.render(sent).tolist()
        n = len(entry["completion_token_ids"])
        assert entry["per_token_logps"] == template_engine.logprobs(sid, turn, n)
        assert entry["request"]["messages"] == sent
        assert entry["metadata"]["parent"] == (None if turn == 0 else f"{sid}:{turn - 1}")
    last = trace["turns"][-1]
    shipped = sum(len(t["prompt_suffix"]) + len(t["completion_token_ids"]) for t in compact["turns"])
    assert shipped == len(last["prompt_token_ids"]) + len(last["completion_token_ids"])


def _check_stored_once(path: Path, trace: dict) -> None:
    """The journal's calls hold each prompt id once: their suffixes add up to the last prompt (a linear rollout),
    and each request only the messages it added."""
    calls = [unpacked(json.loads(line)) for line in path.read_text().splitlines() if '"t":"call"' in line]
    assert len(calls) == TURNS
    assert sum(len(c["prompt_suffix"]) for c in calls) + sum(len(c["completion_token_ids"]) for c in calls[:-1]) \
        == len(trace["turns"][-1]["prompt_token_ids"])
    assert [c["base"] for c in calls] == [None, *range(TURNS - 1)]
    assert all(len(c["request"]["messages"]) == 2 for c in calls)  # a reply and a tool output each (the first:
    # its system and user messages)
