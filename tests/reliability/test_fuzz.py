"""R2: the capture proxy under generated input, against the real engine. The whole run (10,000+ requests) is
bench/reliability.py --fuzz; here 1,000, plus regression tests for what fuzzing found."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from fuzzing import run_fuzz

from harness_trainer.proxy.client import ProxyServer

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def fuzzed_proxy(engine, tmp_path_factory):
    """Its own proxy (journal on): fuzzing mints, deletes and re-versions sessions freely."""
    root = tmp_path_factory.mktemp("fuzz")
    with ProxyServer(engine.url, journal=root / "journal", log_path=root / "proxy.log") as server:
        yield server


def test_a_thousand_generated_requests_crash_nothing_and_get_clear_answers(fuzzed_proxy):
    n = int(os.environ.get("HARNESS_FUZZ_REQUESTS", "1000"))
    report = run_fuzz(fuzzed_proxy, n, random_seed=1616)
    summary = report.summary()
    print(json.dumps(summary, indent=1))
    assert report.proxy_alive, summary
    assert report.requests >= n * 0.95, summary  # hypothesis may stop a few short of max_examples
    assert not report.findings, "\n".join(report.findings[:20])
    assert report.outcomes["captured"] > n // 20, summary  # the fuzzer did reach the engine, often
    assert report.outcomes["refused"] > n // 4, summary
    assert report.google["captured"] > n // 100 and report.google["counted"] > 0, summary  # every dialect reached
    # every answered model call went through the capture path (none was forwarded raw); a call the client cut
    # may or may not have been recorded
    assert report.captured_answers <= report.recorded_calls <= report.captured_answers + report.cut_model_calls, \
        summary
    assert report.rss_end_kib - report.rss_start_kib < 200 * 1024, summary
    assert httpx.get(fuzzed_proxy.url + "/health", timeout=5).status_code == 200


def _headers(session: dict) -> dict:
    return {"authorization": f"Bearer {session['api_key']}", "content-type": "application/json"}


@pytest.mark.parametrize("route", ["/chat/completions", "/messages", "/responses"])
def test_deeply_nested_json_is_refused_never_forwarded_raw(fuzzed_proxy, route):
    """Found by fuzzing: a RecursionError in the request hook made mitmproxy forward the request unchanged."""
    session = fuzzed_proxy.client.create_session()
    deep = "[" * 5000 + "]" * 5000
    body = '{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"hi"}],"input":"hi","x":' + deep + "}"
    before = fuzzed_proxy.client.session(session["id"])["calls"]
    answer = httpx.post(session["base_url"] + route, content=body, headers=_headers(session), timeout=30)
    assert answer.status_code == 400, answer.text
    assert "nested too deeply" in json.dumps(answer.json())
    assert "detail" not in answer.json()  # not the engine's own answer
    assert fuzzed_proxy.client.session(session["id"])["calls"] == before
    admin = {"authorization": f"Bearer {fuzzed_proxy.admin_key}"}
    assert httpx.post(fuzzed_proxy.url + "/sessions", content='{"metadata":' + deep + "}", headers=admin,
                      timeout=30).status_code == 400


def test_count_tokens_refuses_bad_input_with_4xx(fuzzed_proxy):
    """Found by fuzzing: empty messages answered 502, and other methods were accepted."""
    session = fuzzed_proxy.client.create_session()
    url = session["base_url"] + "/messages/count_tokens"
    empty = httpx.post(url, json={"model": "c", "messages": []}, headers=_headers(session), timeout=30)
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]
    for method in ("GET", "PUT", "DELETE"):
        answer = httpx.request(method, url, headers=_headers(session), timeout=30)
        assert answer.status_code == 405 and "POST" in answer.json()["error"]["message"], (method, answer.text)
    counted = httpx.post(url, json={"model": "c", "messages": MESSAGES}, headers=_headers(session), timeout=30)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


def test_model_routes_are_posts(fuzzed_proxy):
    session = fuzzed_proxy.client.create_session()
    answer = httpx.get(session["base_url"] + "/chat/completions", headers=_headers(session), timeout=30)
    assert answer.status_code == 405 and "POST" in answer.json()["error"]["message"]
