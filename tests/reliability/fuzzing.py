"""Property-based fuzzing of the capture proxy: generated requests across every route, method and dialect,
sent over a raw HTTP connection so uploads can be truncated or slow and streams cut by the client.

Every request must end in one of:
  answered   2xx, and a model call's answer has its dialect's shape (and was captured: see `run_fuzz`)
  refused    4xx whose JSON body says what was wrong (an error message, or a 409 trace's reason)
  dropped    no answer, only where the client broke the request itself (a truncated upload, a cut stream)
Anything else (a 5xx, an error without a message, a hang, a dead proxy) is a finding.

Used by tests/reliability/test_fuzz.py (1,000 requests) and bench/reliability.py (10,000+).
"""

from __future__ import annotations

import http.client
import json
import socket
import string
import time
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

GOOGLE_ROUTES = ["/v1beta/models/gemini:generateContent", "/v1beta/models/gemini:streamGenerateContent",
                 "/v1/models/gemini-x:countTokens"]
MODEL_ROUTES = ["/v1/chat/completions", "/chat/completions", "/v1/messages", "/v1/responses",
                "/v1/messages/count_tokens", *GOOGLE_ROUTES]
CONTROL_ROUTES = ["/health", "/sessions", "/sessions/{own}", "/sessions/{own}/trace", "/sessions/{own}/rollout",
                  "/sessions/{own}/policy_version", "/sessions/{other}", "/sessions/{other}/trace",
                  "/sessions/{other}/rollout", "/sessions/{gone}/trace", "/policy_version", "/v1/models", "/ca.pem"]
METHODS = ["POST", "POST", "POST", "GET", "GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
KEY_HEADERS = ["authorization", "x-api-key", "x-goog-api-key", "x-admin-key"]
STOP_TEXTS = ("Step budget exhausted; stopping.", "Context length exceeded; stopping.")


@dataclass
class Probe:
    method: str
    path: str
    key: str  # own | other | admin | gone | random | none
    key_header: str
    body: bytes
    mode: str  # whole | truncated | slow | cut
    content_type: str = "application/json"


# ---- strategies ----------------------------------------------------------------------------------------------

json_leaf = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=40)
any_json = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=5)
                        | st.dictionaries(st.text(max_size=12), inner, max_size=5), max_leaves=30)


def _message(role: str, text: str) -> dict:
    return {"role": role, "content": text}


@st.composite
def model_body(draw, route: str) -> dict:
    """A well-formed body of the route's dialect, then maybe mutated (a key dropped, retyped or added)."""
    text = draw(st.text(string.printable, min_size=1, max_size=60))
    stream = draw(st.booleans())
    if route in GOOGLE_ROUTES:
        body = {"contents": [{"role": "user", "parts": [{"text": text}]}],
                "generationConfig": {"maxOutputTokens": draw(st.integers(1, 8))}}
        if draw(st.booleans()):
            body["systemInstruction"] = {"parts": [{"text": "You are terse."}]}
    elif route.endswith("count_tokens") or route == "/v1/messages":
        body = {"model": "claude", "max_tokens": draw(st.integers(1, 8)), "messages": [_message("user", text)]}
        if draw(st.booleans()):
            body["system"] = "You are terse."
    elif route == "/v1/responses":
        body = {"model": "gpt", "input": text, "max_output_tokens": draw(st.integers(1, 8))}
    else:
        body = {"model": "tiny", "max_tokens": draw(st.integers(1, 8)),
                "messages": [_message("system", "You are terse."), _message("user", text)]}
    if not route.endswith("count_tokens") and route not in GOOGLE_ROUTES:  # Google's route says whether it streams
        body["stream"] = stream
    if draw(st.booleans()):
        body["tools"] = [{"functionDeclarations": [{"name": "bash", "parameters": {"type": "OBJECT"}}]}] \
            if route in GOOGLE_ROUTES else \
            [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    mutation = draw(st.sampled_from(["none"] * 6 + ["drop", "retype", "extra", "deep", "huge", "empty_list"]))
    key = draw(st.sampled_from(sorted(body)))
    if mutation == "drop":
        body.pop(key)
    elif mutation == "retype":
        body[key] = draw(any_json)
    elif mutation == "extra":
        body[draw(st.text(max_size=20))] = draw(any_json)
    elif mutation == "deep":  # past Python's recursion limit, or just deep
        depth = draw(st.sampled_from([50, 900, 5000, 20000]))
        body["x"] = json.loads("[" * depth + "]" * depth) if depth < 900 else None
        if depth >= 900:
            return {"__raw__": json.dumps(body)[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}"}
    elif mutation == "huge":
        words = "word " * (draw(st.sampled_from([10_000, 200_000, 1_000_000])) // 5)
        if isinstance(body.get("messages"), list):
            body["messages"].append(_message("user", words))
        elif isinstance(body.get("contents"), list):
            body["contents"].append({"role": "user", "parts": [{"text": words}]})
        else:
            body["input"] = words
    elif mutation == "empty_list":
        for k in ("messages", "input", "tools", "contents"):
            if k in body:
                body[k] = []
    return body


def encode(body) -> bytes:
    return body["__raw__"].encode() if isinstance(body, dict) and "__raw__" in body else json.dumps(body).encode()


@st.composite
def request_body(draw, route: str) -> bytes:
    kind = draw(st.sampled_from(["dialect"] * 8 + ["json", "broken", "bytes", "empty"]))
    if kind == "dialect":
        return encode(draw(model_body(route if route in MODEL_ROUTES else "/v1/chat/completions")))
    if kind == "json":
        return json.dumps(draw(any_json)).encode()
    if kind == "broken":  # a valid body cut anywhere
        whole = encode(draw(model_body("/v1/chat/completions")))
        return whole[:draw(st.integers(0, max(0, len(whole) - 1)))]
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    return b""


@st.composite
def probes(draw) -> Probe:
    family = draw(st.sampled_from(["model", "model", "model", "control", "unknown"]))
    if family == "model":
        path = draw(st.sampled_from(MODEL_ROUTES))
    elif family == "control":
        path = draw(st.sampled_from(CONTROL_ROUTES))
    else:
        path = "/" + "/".join(draw(st.lists(st.text(string.ascii_letters + string.digits + "-._~%:@!$&'()*+,;=",
                                                    min_size=1, max_size=12), max_size=4)))
    if path.endswith(":streamGenerateContent") and draw(st.booleans()):
        path += "?alt=sse"  # server-sent events; without it, one JSON array
    if draw(st.integers(0, 9)) == 0:
        path += ("&" if "?" in path else "?") + draw(st.text(string.ascii_letters + "=&%", max_size=20))
    method = draw(st.sampled_from(METHODS + ["BREW"])) if family != "model" or draw(st.integers(0, 5)) == 0 \
        else "POST"
    key = draw(st.sampled_from(["own"] * 9 + ["other", "admin", "gone", "random", "none"]))
    mode = draw(st.sampled_from(["whole"] * 16 + ["truncated", "slow", "cut"]))
    content_type = draw(st.sampled_from(["application/json"] * 8 + ["text/plain", "application/x-www-form-urlencoded"]))
    return Probe(method, path, key, draw(st.sampled_from(KEY_HEADERS)), draw(request_body(path)), mode, content_type)


# ---- sending -------------------------------------------------------------------------------------------------

@dataclass
class Answer:
    status: int | None  # None: no answer (the connection closed or timed out)
    body: bytes = b""
    content_type: str = ""
    seconds: float = 0.0
    timed_out: bool = False


def send(probe: Probe, host: str, port: int, keys: dict[str, str], timeout_s: float = 120.0) -> Answer:
    path = probe.path.format(own=keys["own"], other=keys["other"], gone=keys["gone"])
    headers = {"content-type": probe.content_type, "connection": "close"}
    if probe.key != "none":
        value = keys[probe.key]
        headers[probe.key_header] = f"Bearer {value}" if probe.key_header == "authorization" else value
    body = probe.body
    started = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.putrequest(probe.method, path, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.putheader("content-length", str(len(body) * (2 if probe.mode == "truncated" else 1) + (
            1 if probe.mode == "truncated" and not body else 0)))
        conn.endheaders()
        if probe.mode == "slow" and body:
            step = max(1, len(body) // 4)
            for i in range(0, len(body), step):
                conn.send(body[i:i + step])
                time.sleep(0.02)
        else:
            conn.send(body)
        if probe.mode == "truncated":  # the client promised more than it sends, then hangs up
            conn.sock.shutdown(socket.SHUT_WR)
            conn.sock.settimeout(10)
        response = conn.getresponse()
        if probe.mode == "cut":  # read the start of the answer, then hang up
            data = response.read(64)
            return Answer(response.status, data, response.getheader("content-type", ""),
                          time.perf_counter() - started)
        data = response.read()
        return Answer(response.status, data, response.getheader("content-type", ""), time.perf_counter() - started)
    except (TimeoutError, socket.timeout):
        return Answer(None, seconds=time.perf_counter() - started, timed_out=True)
    except (ConnectionError, http.client.HTTPException, OSError):
        return Answer(None, seconds=time.perf_counter() - started)
    finally:
        conn.close()


# ---- judging -------------------------------------------------------------------------------------------------

def _message_of(document) -> str | None:
    if not isinstance(document, dict):
        return None
    error = document.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]:
        return error["message"]
    if document.get("trainable") is False and document.get("reason"):
        return document["reason"]
    return None


def _answer_shape_ok(path: str, document) -> bool:
    route = path.split("?", 1)[0].rstrip("/")
    if route.endswith(":streamGenerateContent") and isinstance(document, list):  # the JSON-array stream
        return bool(document) and all(isinstance(d, dict) and ("candidates" in d or "error" in d) for d in document)
    if not isinstance(document, dict):
        return False
    if route.endswith(":countTokens"):
        return isinstance(document.get("totalTokens"), int)
    if route in GOOGLE_ROUTES:
        return isinstance(document.get("candidates"), list)
    if route.endswith("count_tokens"):
        return isinstance(document.get("input_tokens"), int)
    if route == "/v1/messages":
        return document.get("type") == "message" and isinstance(document.get("content"), list)
    if route == "/v1/responses":
        return isinstance(document.get("output"), list)
    return isinstance(document.get("choices"), list)


def judge(probe: Probe, answer: Answer) -> tuple[str, str | None]:
    """(outcome, finding or None)."""
    route = probe.path.split("?", 1)[0].rstrip("/")
    if answer.status is None:
        if answer.timed_out and probe.mode != "truncated":
            return "hung", f"no answer within the timeout after {answer.seconds:.0f} s"
        if probe.mode in ("truncated", "cut"):
            return "dropped", None
        return "no answer", "the proxy closed the connection without an answer"
    if answer.status >= 500:
        return f"{answer.status}", f"{answer.status}: {answer.body[:300]!r}"
    if probe.mode == "cut" or probe.method == "HEAD":
        return ("answered" if answer.status < 400 else "refused"), None
    if answer.status >= 400:
        try:
            message = _message_of(json.loads(answer.body))
        except ValueError:
            message = None
        if not message:
            return "refused", f"{answer.status} without a message saying what was wrong: {answer.body[:300]!r}"
        return "refused", None
    if route in MODEL_ROUTES and probe.method == "POST":
        if "event-stream" in answer.content_type:
            text = answer.body.decode(errors="replace")
            if "data:" not in text:
                return "answered", f"a stream without events: {text[:200]!r}"
            return ("stopped" if any(s in text for s in STOP_TEXTS) else "captured"), None
        try:
            document = json.loads(answer.body)
        except ValueError:
            return "answered", f"a model call's 200 answer is not JSON: {answer.body[:200]!r}"
        if not _answer_shape_ok(route, document):
            return "answered", f"a 200 answer not in the {route} dialect (forwarded raw?): {answer.body[:300]!r}"
        if route.endswith(("count_tokens", ":countTokens")):
            return "counted", None
        return ("stopped" if any(s in answer.body.decode(errors="replace") for s in STOP_TEXTS) else "captured"), None
    return "answered", None


# ---- a run ---------------------------------------------------------------------------------------------------

def rss_kib(pid: int) -> int:
    """Resident memory of the process and its children (the proxy runs under a process group)."""
    total = 0
    try:
        pids = [pid] + [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return 0
    for p in pids:
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


@dataclass
class FuzzReport:
    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    google: Counter = field(default_factory=Counter)  # the outcomes of Google's routes alone
    findings: list[str] = field(default_factory=list)
    captured_answers: int = 0  # 200 answers to model calls that must have been recorded
    cut_model_calls: int = 0  # model calls the client hung up on (recorded or not)
    recorded_calls: int = 0  # what the proxy's sessions hold at the end
    rss_start_kib: int = 0
    rss_end_kib: int = 0
    seconds: float = 0.0
    proxy_alive: bool = True

    def summary(self) -> dict:
        return {"requests": self.requests, "seconds": round(self.seconds, 1), "outcomes": dict(self.outcomes),
                "google": dict(self.google),
                "statuses": dict(sorted(self.statuses.items(), key=lambda kv: str(kv[0]))),
                "captured_answers": self.captured_answers, "recorded_calls": self.recorded_calls,
                "rss_start_mib": round(self.rss_start_kib / 1024, 1), "rss_end_mib": round(self.rss_end_kib / 1024, 1),
                "findings": len(self.findings), "proxy_alive": self.proxy_alive}


def run_fuzz(proxy, n: int, random_seed: int, *, time_budget_s: float | None = None,
             timeout_s: float = 120.0) -> FuzzReport:
    """`n` generated requests against a running ProxyServer (its engine real or not). Sessions are minted with a
    token cap so every generation is short; a deleted one is replaced."""
    from urllib.parse import urlsplit

    url = urlsplit(proxy.url)
    client = proxy.client

    def mint() -> str:
        return client.create_session(policy={"max_tokens_cap": 8})["id"]

    pool = {"own": mint(), "other": mint()}
    gone = mint()
    client.delete(gone)
    minted = set(pool.values())
    keys = dict(pool, gone=gone, admin=proxy.admin_key, random="sk-" + "0" * 32)
    report = FuzzReport()
    pid = proxy.managed.process.pid
    report.rss_start_kib = rss_kib(pid)
    started = time.perf_counter()

    @seed(random_seed)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate], derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(probe=probes())
    def one(probe: Probe) -> None:
        if time_budget_s is not None and time.perf_counter() - started > time_budget_s:
            return
        calls_before = 0
        if probe.method == "DELETE":  # what a delete would take with it still counts as recorded
            target = probe.path.format(own=keys["own"], other=keys["other"], gone=keys["gone"])
            calls_before = sum(client.session(key)["calls"] for key in pool.values() if key in target)
        answer = send(probe, url.hostname, url.port, keys, timeout_s)
        outcome, finding = judge(probe, answer)
        report.requests += 1
        report.outcomes[outcome] += 1
        report.statuses[answer.status] += 1
        if finding:
            report.findings.append(f"{probe.method} {probe.path} key={probe.key} mode={probe.mode} "
                                   f"body={probe.body[:120]!r}: {finding}")
        if outcome == "captured" and probe.mode in ("whole", "slow"):
            report.captured_answers += 1
        route = probe.path.split("?", 1)[0].rstrip("/")
        if route in GOOGLE_ROUTES:
            report.google[outcome] += 1
        if probe.mode == "cut" and route in MODEL_ROUTES:
            report.cut_model_calls += 1
        if probe.method == "DELETE" and answer.status == 200:  # a fuzzed delete of a pool session: replace it
            report.recorded_calls += calls_before
            for role, key in list(pool.items()):
                if key in probe.path.format(own=keys["own"], other=keys["other"], gone=keys["gone"]):
                    pool[role] = keys[role] = mint()
                    minted.add(pool[role])
        if report.requests % 200 == 0 and proxy.managed.process.poll() is not None:
            raise RuntimeError("the capture proxy died")

    try:
        one()
    except RuntimeError:
        report.proxy_alive = False
    report.seconds = time.perf_counter() - started
    report.proxy_alive = report.proxy_alive and proxy.managed.process.poll() is None
    if report.proxy_alive:
        report.rss_end_kib = rss_kib(pid)
        report.recorded_calls += sum(s["calls"] for s in client.http.get("/sessions").json()["sessions"]
                                    if s["id"] in minted)
    return report
