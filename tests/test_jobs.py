"""`harness-train jobs`: the dry-run spec of the seed's configuration, submission through huggingface_hub to a
local stand-in for the Hub's Jobs API (the Hub is unreachable here, so this stub records what a real Hub would
receive), status/logs/cancel, and every error path before any network call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

SEED = ["--flavor", "h200x2", "--secrets", "HF_TOKEN,E2B_API_KEY", "--push-to", "me/agent-grpo", "--",
        "--harness", "mini-swe-agent", "--sandbox", "e2b", "--model", "Qwen/Qwen3-8B", "--dataset", "hf:me/tasks",
        "--num-generations", "8", "--max-concurrent-rollouts", "8", "--max-steps", "20", "--learning-rate", "1e-6",
        "--max-staleness", "4", "--agent-timeout", "300", "--agent-step-limit", "12"]
TRAIN_FLAGS = " ".join(SEED[SEED.index("--") + 1:])

# Reviewed by hand: install, engine on GPU 0 with the weight-sync dev routes, health wait, trainer on GPU 1
# attached to it with the proxy on the job's public port for E2B, then the push of the model and the traces.
EXPECTED_SPEC = {
    "image": "huggingface/trl",
    "flavor": "h200x2",
    "timeout": "4h",
    "command": ["bash", "-c", "\n".join([
        "set -euo pipefail",
        "pip install --quiet harness-trainer e2b",
        "MODEL=Qwen/Qwen3-8B",
        'CUDA_VISIBLE_DEVICES=0 harness-train serve --model "$MODEL" --port 8000 --log engine.log &',
        "until curl -sf http://127.0.0.1:8000/health >/dev/null; do sleep 5; done",
        f"CUDA_VISIBLE_DEVICES=1 harness-train train {TRAIN_FLAGS} --vllm-url http://127.0.0.1:8000 "
        '--proxy-port 8300 --public-url "https://${JOB_ID}--8300.hf.jobs"',
        "hf upload me/agent-grpo runs/train/final . --repo-type model",
        "hf upload me/agent-grpo runs/train/traces.jsonl traces.jsonl --repo-type model"])],
    "env": {"PYTHONUNBUFFERED": "1", "VLLM_SERVER_DEV_MODE": "1"},
    "secrets": ["HF_TOKEN", "E2B_API_KEY"],
    "volumes": [],
    "expose_public": [8300],
    "labels": {"app": "harness-train", "harness": "mini-swe-agent"},
}


def jobs(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "E2B_API_KEY", "HF_ENDPOINT")}
    return subprocess.run([sys.executable, "-m", "harness_trainer.commands.cli", "jobs", *args], capture_output=True,
                          text=True, timeout=120, env=clean | {"HF_HUB_OFFLINE": "0"} | (env or {}))


def test_dry_run_of_the_seed_configuration_matches_the_reviewed_spec():
    result = jobs("launch", "--dry-run", *SEED, env={"E2B_API_KEY": "e2b-secret-value"})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == EXPECTED_SPEC
    assert "e2b-secret-value" not in result.stdout


class FakeHub(BaseHTTPRequestHandler):
    """Answers like the Hub's Jobs API and records every request."""
    requests: list = []

    def _send(self, payload, content_type="application/json"):
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _job(self, spec: dict, stage: str) -> dict:
        return {"id": "job-1", "createdAt": "2026-11-29T12:00:00.000Z", "dockerImage": spec.get("dockerImage"),
                "command": spec.get("command"), "arguments": [], "environment": spec.get("environment", {}),
                "secrets": sorted(spec.get("secrets", {})), "flavor": spec.get("flavor"),
                "status": {"stage": stage, "message": None}, "owner": {"id": "u1", "name": "alice", "type": "user"}}

    def do_GET(self):
        self.requests.append(("GET", self.path, dict(self.headers), None))
        if self.path.startswith("/api/whoami"):
            self._send({"name": "alice", "type": "user", "auth": {"type": "access_token"}})
        elif self.path.startswith("/api/jobs/alice/job-1/logs"):
            self._send(b'data: {"data": "engine healthy", "timestamp": "2026-11-29T12:00:01Z"}\n\n'
                       b'data: {"data": "step 1: reward 0.25", "timestamp": "2026-11-29T12:00:02Z"}\n\n',
                       "text/event-stream")
        elif self.path.startswith("/api/jobs/alice/job-1"):
            self._send(self._job(self.server.submitted, "COMPLETED"))
        else:
            self.send_error(404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        self.requests.append(("POST", self.path, dict(self.headers), body))
        if self.path == "/api/jobs/alice":
            self.server.submitted = body
            self._send(self._job(body, "RUNNING"))
        elif self.path == "/api/jobs/alice/job-1/cancel":
            self._send({})
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture
def hub():
    FakeHub.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    server.submitted = {}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_submission_reaches_the_hub_api_with_flavor_command_env_and_secrets(hub):
    server, url = hub
    env = {"HF_ENDPOINT": url, "HF_TOKEN": "hf_token_value", "E2B_API_KEY": "e2b_key_value"}
    result = jobs("launch", *SEED, env=env)
    assert result.returncode == 0, result.stderr
    assert "submitted job job-1 (h200x2)" in result.stdout
    (post,) = [r for r in FakeHub.requests if r[0] == "POST"]
    _, path, headers, body = post
    assert path == "/api/jobs/alice" and headers["authorization"] == "Bearer hf_token_value"
    assert body["flavor"] == "h200x2" and body["dockerImage"] == "huggingface/trl"
    assert body["command"] == EXPECTED_SPEC["command"] and body["environment"] == EXPECTED_SPEC["env"]
    assert body["secrets"] == {"HF_TOKEN": "hf_token_value", "E2B_API_KEY": "e2b_key_value"}  # sent, never printed
    assert body["expose"] == {"ports": [8300], "portsPublic": [8300]} and body["timeoutSeconds"] == 4 * 3600
    assert "hf_token_value" not in result.stdout + result.stderr

    status = jobs("status", "job-1", env=env)
    assert status.returncode == 0 and "job-1  COMPLETED  h200x2" in status.stdout
    logs = jobs("logs", "job-1", env=env)
    assert logs.returncode == 0 and logs.stdout.splitlines() == ["engine healthy", "step 1: reward 0.25"]
    cancel = jobs("cancel", "job-1", env=env)
    assert cancel.returncode == 0 and ("POST", "/api/jobs/alice/job-1/cancel") in [r[:2] for r in FakeHub.requests]


@pytest.mark.parametrize("args, env, says", [
    (["--flavor", "h100x9"], {}, "unknown flavor 'h100x9'"),
    (["--flavor", "h200"], {}, "flavor h200 has 1 GPU(s): the engine takes GPU 0"),
    (["--flavor", "cpu-upgrade"], {}, "flavor cpu-upgrade has 0 GPU(s)"),
    ([], {"E2B_API_KEY": "x"}, "no Hugging Face token: set HF_TOKEN"),
    ([], {"HF_TOKEN": "hf_x"}, "secret(s) E2B_API_KEY not set in this environment"),
    (["--volume", "bucket:me/runs"], {}, "--volume bucket:me/runs: write TYPE:SOURCE:/MOUNT"),
    (["--", "--max-steps", "zero"], {}, "flags after -- are not valid (harness-train train: error: argument "
                                        "--max-steps: invalid int value: 'zero')"),
    (["--", "--vllm-url", "http://x"], {}, "leave out --vllm-url"),
])
def test_errors_before_any_network_call(hub, args, env, says):
    server, url = hub
    full = args + ["--sandbox", "e2b"] if "--" in args else args + ["--", "--sandbox", "e2b"]
    result = jobs("launch", *full, env={"HF_ENDPOINT": url, "HF_HOME": "/nonexistent-hf-home"} | env)
    assert result.returncode == 1 and says in result.stderr, result.stderr
    assert result.stderr.startswith("harness-train: ")
    assert FakeHub.requests == []  # nothing reached the "Hub"
