"""R1 through the command a user runs (make test-reliability): `harness-train` on the embedded default with
mini-swe-agent, its proxy killed -9 after step 1 and its vLLM killed -9 mid-stream after step 2. The run must
restart both, finish every step once, exit 0, and say what happened in its log and summary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from stubs import wait_until

from harness_trainer.serving.process import free_port

pytestmark = pytest.mark.reliability


def _pid_of(marker: str, port: int) -> int | None:
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if marker in cmdline and f"--port {port}" in cmdline:
            return p.pid
    return None


def _steps(out) -> int:
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def test_harness_train_survives_its_proxy_and_engine_killed(tmp_path):
    out, engine_port, proxy_port = tmp_path / "run", free_port(), free_port()
    run = subprocess.Popen([sys.executable, "-m", "harness_trainer.commands.cli", "--harness", "mini-swe-agent",
                            "--dataset",
                            "builtin:toy-train", "--max-steps", "3", "--num-generations", "2",
                            "--max-concurrent-rollouts", "2", "--agent-step-limit", "2", "--max-completion-tokens",
                            "48", "--output-dir", str(out), "--engine-port", str(engine_port), "--proxy-port",
                            str(proxy_port), "--report-to", "none"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_until(lambda: _steps(out) >= 1, 600, "step 1")
        os.kill(_pid_of("harness_trainer.proxy.server", proxy_port), signal.SIGKILL)
        wait_until(lambda: _steps(out) >= 2, 600, "step 2")
        engine = _pid_of("vllm.entrypoints", engine_port)
        wait_until(lambda: any(" ".join(p.cmdline()).count("mini") for p in psutil.Process(run.pid).children(True)),
                   120, "an agent running")
        time.sleep(1)  # its first call is being sampled
        os.killpg(engine, signal.SIGKILL)
        output, _ = run.communicate(timeout=900)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 0, output[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and len(summary["restarts"]) == 2, summary
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert "the capture proxy exited (code -9); restarting it" in output
    assert "vLLM exited (code -9); restarting it" in output
    assert "synced again" in output
