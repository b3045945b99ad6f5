"""Start, supervise and talk to the capture proxy from the trainer's side (HTTP only, no mitmproxy import).

    with ProxyServer(upstream=engine.url, journal=run_dir / "journal") as proxy:
        session = proxy.client.create_session(max_model_calls=30)
        # agent: base_url = session["base_url"], api_key = session["api_key"]
        trace = proxy.client.trace(session["id"])   # OpenEnv TrainingTrace wire form
"""

from __future__ import annotations

import os
import secrets
import ssl
import sys
import threading
from pathlib import Path

import httpx

from harness_trainer import fastjson
from harness_trainer._exceptions import CaptureNotTrainable, ProcessError, ProxyError
from harness_trainer.paths import venv_python
from harness_trainer.serving.process import ManagedProcess, clear_folder, free_port, server_folder


def proxy_python() -> str:
    """The interpreter that has mitmproxy: $HARNESS_PROXY_PYTHON, the project's .venv-proxy, or this one."""
    if env := os.environ.get("HARNESS_PROXY_PYTHON"):
        return env
    local = venv_python("proxy")
    return str(local) if local.exists() else sys.executable


class ProxyClient:
    """The control routes, from any number of threads: each thread has an HTTP client of its own. One client
    shared by a rollout pool's 1,024 threads lost sessions at that scale ("[Errno 9] Bad file descriptor" once its
    pool's timeouts began under load: a connection closed by one thread under another's request)."""

    def __init__(self, url: str, admin_key: str | None = None, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self._headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._timeout_s = timeout_s
        self._local = threading.local()
        self._tls = ssl.create_default_context()  # read once: every thread's client shares it

    @property
    def http(self) -> httpx.Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(base_url=self.url, headers=self._headers,
                                                       timeout=self._timeout_s, verify=self._tls)
        return client

    def _call(self, method: str, path: str, **kwargs) -> dict:
        return fastjson.loads(self._body(method, path, **kwargs))  # a trace carries every token id of its rollout

    def _body(self, method: str, path: str, **kwargs) -> bytes:
        response = self.http.request(method, path, **kwargs)
        if response.status_code == 409 and "/trace" in path:
            raise CaptureNotTrainable(response.json().get("reason", response.text))
        if not response.is_success:
            raise ProxyError(f"proxy {method} {path} -> HTTP {response.status_code}: {response.text[:500]}")
        return response.content

    def create_session(self, **settings) -> dict:
        """settings: id, upstream, model, policy{training,temperature,max_tokens_cap}, max_model_calls,
        policy_version, metadata. Returns the session with its api_key and base_url."""
        return self._call("POST", "/sessions", json=settings)

    def session(self, session_id: str) -> dict:
        return self._call("GET", f"/sessions/{session_id}")

    def trace(self, session_id: str) -> dict:
        return self._call("GET", f"/sessions/{session_id}/trace")

    def trace_json(self, session_id: str, compact: bool = False) -> bytes:
        """The trace as the proxy sent it, for a model to validate straight from JSON (no dict in between: a
        rollout's trace at 200k tokens peaks at 15 MB that way, 43 MB through a dict). compact: each token once
        (traces/compact.py; `expand` gives the TrainingTrace), what the trainer fetches: a whole trace grows with
        the square of a rollout's length."""
        return self._body("GET", f"/sessions/{session_id}/trace" + ("?form=compact" if compact else ""))

    def rollout(self, session_id: str) -> dict:
        return self._call("GET", f"/sessions/{session_id}/rollout")

    def graph(self, session_id: str) -> dict:
        """The rollout document without token ids, requests and answers: links, roles, token counts."""
        return self._call("GET", f"/sessions/{session_id}/graph")

    def delete(self, session_id: str) -> dict:
        return self._call("DELETE", f"/sessions/{session_id}")

    def set_policy_version(self, version: int, session_id: str | None = None, model: str | None = None) -> dict:
        """Stamp new calls with `version`; with `model` (a LoRA adapter's name) every new call goes there."""
        path = f"/sessions/{session_id}/policy_version" if session_id else "/policy_version"
        return self._call("POST", path, json={"policy_version": version, **({"model": model} if model else {})})

    def policy_state(self) -> dict:
        """The current version and model, and how many calls are in flight per model name."""
        return self._call("GET", "/policy_version")

    def engines(self, cache: bool = True) -> list[dict]:
        """Each engine behind the proxy: url, state (ready, lost, behind), sessions, calls, tokens, in flight,
        busy and call seconds, and (cache) its prefix-cache hit rate, which asks each engine's /metrics."""
        return self._call("GET", "/engines" if cache else "/engines?cache=0")["engines"]


class ProxyServer:
    """The capture proxy as a supervised subprocess in its own environment."""

    def __init__(self, upstream: str | list[str], *, port: int = 0, forward_port: int | None = None,
                 host: str = "127.0.0.1",
                 journal: str | Path | None = None, admin_key: str | None = None, model: str | None = None,
                 confdir: str | Path | None = None, log_path: str | Path | None = None,
                 startup_timeout_s: float = 30.0):
        self.port = port or free_port()
        self.forward_port = forward_port
        self.host = host
        self.admin_key = admin_key or secrets.token_urlsafe(24)
        self.url = f"http://{host}:{self.port}"
        tmp = self._tmp = server_folder("proxy")
        self.confdir = Path(confdir) if confdir else tmp / "scratch" / "conf"
        upstreams = [upstream] if isinstance(upstream, str) else list(upstream)
        command = [proxy_python(), "-m", "harness_trainer.proxy.server",
                   *(arg for url in upstreams for arg in ("--upstream", url)),
                   "--port", str(self.port), "--host", host, "--confdir", str(self.confdir)]
        if forward_port:
            command += ["--forward-port", str(forward_port)]
        if journal:
            command += ["--journal", str(journal)]
        if model:
            command += ["--model", model]
        env = dict(os.environ, HARNESS_PROXY_ADMIN_KEY=self.admin_key, PYTHONUNBUFFERED="1")
        self.managed = ManagedProcess("capture proxy", command, env=env, log_path=Path(log_path or tmp / "proxy.log"),
                                      health_url=f"{self.url}/health", error=ProxyError)
        self.startup_timeout_s = startup_timeout_s
        self.client = ProxyClient(self.url, self.admin_key)

    def start(self) -> ProxyServer:
        try:
            self.managed.start(self.startup_timeout_s)
        except ProcessError as exc:
            raise ProxyError(str(exc)) from None
        return self

    def stop(self) -> None:
        """Stop it and remove its own folder: the CA's private key goes; a log kept there stays for post-mortems."""
        self.managed.stop()
        clear_folder(self._tmp)

    def kill(self) -> None:
        """SIGKILL without warning (for crash tests)."""
        if self.managed.process:
            os.killpg(self.managed.process.pid, 9)
            self.managed.process.wait()
            self.managed.process = None

    def __enter__(self) -> ProxyServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
