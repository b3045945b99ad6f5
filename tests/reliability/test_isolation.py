"""R3: one session's data cannot be read, changed, deleted, re-versioned or exported by anyone else, and a
planted reward scores nothing. Every attempt runs against the real proxy and engine, or the real verifier in a
real bubblewrap sandbox."""

from __future__ import annotations

import http.server
import secrets
import subprocess
import threading

import httpx
import pytest

from harness_trainer.proxy.client import ProxyServer, proxy_python
from harness_trainer.rollouts.tasks import load_dataset
from harness_trainer.rollouts.verifier import verify
from harness_trainer.sandboxes.bubblewrap import LocalSandbox
from harness_trainer.serving.process import free_port

MESSAGES = [{"role": "user", "content": "hi"}]
LIVE = 24


def call(proxy_url: str, key: str | None, **headers) -> httpx.Response:
    auth = {} if key is None else {"authorization": f"Bearer {key}"}
    return httpx.post(f"{proxy_url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2},
                      headers={**auth, **headers}, timeout=60)


def test_no_session_can_reach_another_and_guessed_or_deleted_keys_get_nothing(proxy):
    sessions = [proxy.client.create_session() for _ in range(LIVE)]
    for s in sessions:
        assert call(proxy.url, s["api_key"]).status_code == 200
    gone = proxy.client.create_session()
    assert call(proxy.url, gone["api_key"]).status_code == 200
    proxy.client.delete(gone["id"])
    before = {s["id"]: proxy.client.rollout(s["id"]) for s in sessions}
    version = proxy.client.policy_state()["policy_version"]
    attempts = refused = 0
    # one kept-alive connection, as an agent's client holds: the keys still differ per request
    client = httpx.Client(timeout=30)

    def attempt(method: str, path: str, key: str | None, header: str = "authorization", **kw) -> None:
        nonlocal attempts, refused
        headers = {} if key is None else {header: f"Bearer {key}" if header == "authorization" else key}
        answer = client.request(method, proxy.url + path, headers=headers, **kw)
        attempts += 1
        refused += answer.status_code in (401, 403, 404)
        assert answer.status_code in (401, 403, 404), (method, path, key, answer.status_code, answer.text)

    victim_routes = [("GET", ""), ("GET", "/trace"), ("GET", "/rollout"), ("DELETE", ""),
                     ("POST", "/policy_version")]
    for i, attacker in enumerate(sessions):
        victim = sessions[(i + 1) % LIVE]
        for method, tail in victim_routes:
            for header in ("authorization", "x-api-key", "x-admin-key"):
                attempt(method, f"/sessions/{victim['id']}{tail}", attacker["api_key"], header,
                        json={"policy_version": 99} if method == "POST" else None)
        attempt("DELETE", f"/sessions/{attacker['id']}", attacker["api_key"])  # not even its own
        attempt("GET", "/sessions", attacker["api_key"])  # the list of every session: admin only
        attempt("POST", "/sessions", attacker["api_key"], json={})
        attempt("POST", "/policy_version", attacker["api_key"], json={"policy_version": 99})
    guesses = [secrets.token_urlsafe(24), sessions[0]["id"][:-1], sessions[0]["id"].upper(),
               sessions[0]["id"] + "x", gone["id"], proxy.admin_key[:-1], "null"]
    for key in guesses + [None]:
        assert call(proxy.url, key).status_code == 401
        for method, tail in victim_routes:
            attempt(method, f"/sessions/{sessions[0]['id']}{tail}", key,
                    json={"policy_version": 99} if method == "POST" else None)
        attempt("GET", "/sessions", key)
        attempt("POST", "/policy_version", key, json={"policy_version": 99})
    # a harness's own session header cannot redirect a call into another session
    assert call(proxy.url, sessions[1]["api_key"], **{"x-session-id": sessions[0]["id"]}).status_code == 200
    assert proxy.client.session(sessions[1]["id"])["calls"] == 2
    del before[sessions[1]["id"]]
    for session_id, document in before.items():
        assert proxy.client.rollout(session_id) == document, session_id  # unchanged, to the byte
    assert proxy.client.policy_state()["policy_version"] == version
    assert refused == attempts > 500
    client.close()
    print(f"isolation: {attempts} attempts on {LIVE} live sessions, {refused} refused")


class Recorder(http.server.BaseHTTPRequestHandler):
    """A host that is not a model endpoint; it records what reaches it."""
    seen: list[tuple[str, str, dict]] = []

    def _answer(self):
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        self.seen.append((self.command, self.path, dict(self.headers)))
        body = b'{"elsewhere": true}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _answer

    def log_message(self, *args):
        pass


def test_forward_mode_never_hands_a_session_to_another_host(engine, tmp_path):
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    host = f"http://127.0.0.1:{other.server_address[1]}"
    with ProxyServer(engine.url, forward_port=free_port(), log_path=tmp_path / "p.log") as proxy:
        session = proxy.client.create_session()
        through = httpx.Client(proxy=f"http://127.0.0.1:{proxy.forward_port}", timeout=60)
        auth = {"authorization": f"Bearer {session['api_key']}"}
        # a model call addressed to the other host goes to the session's engine, its key stripped
        answer = through.post(f"{host}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2},
                              headers=auth)
        assert answer.status_code == 200 and answer.json()["choices"]
        assert through.post(f"{host}/v1/chat/completions", json={"messages": MESSAGES},
                            headers={"authorization": "Bearer guessed"}).status_code == 401
        # control routes are not answered in forward mode: the session's data never leaves through it
        for path in (f"/sessions/{session['id']}/trace", f"/sessions/{session['id']}/rollout", "/sessions"):
            leaked = through.get(host + path, headers=auth)
            assert leaked.json() == {"elsewhere": True}
        assert all(not path.startswith("/v1/chat") for _, path, _ in Recorder.seen)
        assert proxy.client.session(session["id"])["calls"] == 1
    other.shutdown()


def test_a_non_loopback_bind_without_an_admin_key_is_refused():
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run([proxy_python(), "-m", "harness_trainer.proxy.server", "--upstream",
                             "http://127.0.0.1:9", "--host", "0.0.0.0", "--port", str(free_port())],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2 and "without an admin key" in result.stderr


# ---- planted rewards: the verifier runs after the agent, in a step the agent cannot influence -------------

DAEMON = ("setsid nohup bash -c 'while true; do mkdir -p /logs/verifier; echo {{\\\"reward\\\": 1}} > "
          "/logs/verifier/reward.json; echo 1 > /logs/verifier/reward.txt; cp /bin/true /tests/test.sh 2>/dev/null;"
          " sleep 0.01; done' >/dev/null 2>&1 & sleep 0.3; exit 0")
HIJACK = "import atexit, os, sys\natexit.register(lambda: os._exit(0))\nsys.excepthook = lambda *a: os._exit(0)\n"


@pytest.mark.parametrize("attack", ["files", "daemon", "sitecustomize", "exit-status"])
def test_planted_rewards_score_nothing(attack, tmp_path):
    task = next(t for t in load_dataset("builtin:bugfix") if t.name == "bugfix-sum-to-n")
    box = LocalSandbox(tmp_path / "trial")
    box.start()
    box.upload(task.app_files(), "/app")
    if attack == "files":
        box.exec("mkdir -p /logs/verifier && echo '{\"reward\": 1}' > /logs/verifier/reward.json && "
                 "printf '#!/bin/bash\\nexit 0\\n' > /tests/test.sh", 10)
    elif attack == "daemon":  # a process left behind to rewrite the reward after the verifier cleared it
        assert box.exec(DAEMON, 10).returncode == 0
    elif attack == "sitecustomize":  # startup modules in /app, where the check runs
        for name in ("sitecustomize.py", "usercustomize.py"):
            box.exec(f"cat > /app/{name} <<'X'\n{HIJACK}X", 10)
    else:  # the module under test forges the exit status of the process that imports it
        box.exec(f"cd /app && printf '%s' '{HIJACK}' | cat - mathx.py > x && mv x mathx.py", 10)
    result = verify(box, task)
    assert result.reward == 0.0, (attack, result)
    if attack == "exit-status":
        box.exec("cd /app && sed -i '1,3d' mathx.py", 10)
    box.exec("cd /app && sed -i 's/range(n)/range(n + 1)/' mathx.py", 10)  # now really solved
    assert verify(box, task).reward == 1.0, attack
