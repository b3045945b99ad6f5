"""Real, unmodified agents through the capture proxy: mini-swe-agent (JSON, reverse mode), opencode
(streaming + its concurrent title call), and a client whose endpoint is fixed (forward mode, HTTPS_PROXY + CA).
Each run must yield a TrainingTrace that OpenEnv's own model accepts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from openenv.core.harness.training import TrainingTrace

from harness_trainer.rollouts.trace_reader import collect_trace

REPO = Path(__file__).resolve().parents[2]
MINI = REPO / ".venv-mini" / "bin" / "mini"
OPENCODE = REPO / ".tools" / "opencode" / "node_modules" / ".bin" / "opencode"


def private_env(home: Path, **extra) -> dict:
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI", "ANTHROPIC", "HARNESS"))}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
               XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local/state"), **extra)
    return env


def run_mini(session: dict, workdir: Path, home: Path, step_limit: int = 3) -> tuple[subprocess.CompletedProcess, dict]:
    traj = home / "traj.json"
    env = private_env(home, LITELLM_LOCAL_MODEL_COST_MAP="True", MSWEA_COST_TRACKING="ignore_errors",
                      MSWEA_GLOBAL_CONFIG_DIR=str(home / "mini"), MSWEA_CONFIGURED="true",
                      OPENAI_API_KEY=session["api_key"])
    result = subprocess.run(
        [str(MINI), "-m", "hosted_vllm/tiny", "-c", "mini.yaml",
         "-c", f"model.model_kwargs.api_base={session['base_url']}", "-c",
         f"model.model_kwargs.api_key={session['api_key']}",
         "-c", f"agent.step_limit={step_limit}", "-c", f"environment.cwd={workdir}", "-y", "--exit-immediately",
         "-t", "List the files in this directory.", "-o", str(traj)],
        env=env, cwd=workdir, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    return result, json.loads(traj.read_text())


def run_opencode(base_url: str, api_key: str, workdir: Path, home: Path, **extra_env) -> subprocess.CompletedProcess:
    config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
              "model": "capture/tiny", "small_model": "capture/tiny",
              "provider": {"capture": {"npm": "@ai-sdk/openai-compatible", "name": "capture",
                                       "options": {"baseURL": base_url, "apiKey": api_key},
                                       "models": {"tiny": {"name": "tiny", "tool_call": True,
                                                           "limit": {"context": 32768, "output": 32}}}}}}
    (workdir / "opencode.json").write_text(json.dumps(config))
    env = private_env(home, OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_MODELS_FETCH="1",
                      OPENCODE_DISABLE_LSP_DOWNLOAD="1", OPENCODE_DISABLE_SHARE="1",
                      # opencode finds its project by $PWD, not by its working directory
                      OPENCODE_CONFIG=str(workdir / "opencode.json"), PWD=str(workdir), **extra_env)
    return subprocess.run([str(OPENCODE), "run", "List the files in this directory."], env=env, cwd=workdir,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)


def test_mini_swe_agent_through_the_proxy(proxy, tmp_path):
    session = proxy.client.create_session(policy={"max_tokens_cap": 32})
    (tmp_path / "work").mkdir()
    result, traj = run_mini(session, tmp_path / "work", tmp_path / "home")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    trace = TrainingTrace.model_validate(proxy.client.trace(session["id"]))
    rollout = proxy.client.rollout(session["id"])
    assert len(trace.turns) == len(rollout["calls"]) >= 1
    assert traj["info"]["exit_status"] in ("RepeatedFormatError", "LimitsExceeded", "Submitted")
    for turn, call in zip(trace.turns, rollout["calls"]):
        assert not call["stream"] and call["dialect"] == "chat" and turn.metadata["n_tools"] == 1
        assert len(turn.completion_token_ids) == len(turn.per_token_logps) > 0
    # what the agent was told it sent is what was captured: its system prompt and task are in every turn
    assert trace.turns[0].request["messages"][0]["content"] == traj["messages"][0]["content"]


def test_opencode_streaming_with_auxiliary_title_call(proxy, tmp_path):
    session = proxy.client.create_session(policy={"max_tokens_cap": 32})
    (tmp_path / "work").mkdir()
    result = run_opencode(session["base_url"], session["api_key"], tmp_path / "work", tmp_path / "home")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rollout = proxy.client.rollout(session["id"])
    roles = {c["role"] for c in rollout["calls"]}
    assert roles == {"agent", "auxiliary"}, [(c["role"], c["n_tools"]) for c in rollout["calls"]]
    assert all(c["stream"] for c in rollout["calls"])
    trace = TrainingTrace.model_validate(proxy.client.trace(session["id"]))
    assert trace.turns and all(t.metadata["n_tools"] >= 5 for t in trace.turns)
    wire = proxy.client.trace_json(session["id"])  # a real agent's turns: the body as parsed is the model's dump
    assert collect_trace(lambda: wire, "a trace") == trace.model_dump(mode="json")
    # the text opencode printed is the text the engine sampled (and the proxy captured)
    agent_text = next(c["message"]["content"] for c in rollout["calls"] if c["role"] == "agent")
    lines = lambda text: text.replace("\r\n", "\n").replace("\r", "\n")  # noqa: E731  a terminal's line ends
    assert agent_text and lines(agent_text.strip()[:20]) in lines(result.stdout)  # (a sampled \r printed as \n)


FIXED_ENDPOINT_CLIENT = """
import json, os, sys, httpx
# A client whose endpoint is fixed: it always calls the real OpenAI host, over TLS.
client = httpx.Client(verify=os.environ["SSL_CERT_FILE"], timeout=120)  # honours HTTPS_PROXY
response = client.post("https://api.openai.com/v1/chat/completions",
                       headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
                       json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6})
print(json.dumps(response.json()))
"""


@pytest.fixture(scope="module")
def forward_proxy(engine, tmp_path_factory):
    from harness_trainer.proxy.client import ProxyServer
    from harness_trainer.serving.process import free_port

    with ProxyServer(engine.url, forward_port=free_port(), log_path=tmp_path_factory.mktemp("fwd") / "p.log") as p:
        yield p


def test_forward_mode_captures_a_client_with_a_fixed_endpoint(forward_proxy, tmp_path):
    session = forward_proxy.client.create_session(policy={"max_tokens_cap": 16})
    ca = httpx.get(forward_proxy.url + "/ca.pem", timeout=10).content
    (tmp_path / "ca.pem").write_bytes(ca)
    env = dict(os.environ, HTTPS_PROXY=f"http://127.0.0.1:{forward_proxy.forward_port}",
               SSL_CERT_FILE=str(tmp_path / "ca.pem"), OPENAI_API_KEY=session["api_key"], NO_PROXY="")
    result = subprocess.run([sys.executable, "-c", FIXED_ENDPOINT_CLIENT], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    answer = json.loads(result.stdout)
    assert answer["model"] == "tiny" and answer["choices"][0]["message"]["content"]
    (turn,) = TrainingTrace.model_validate(forward_proxy.client.trace(session["id"])).turns
    assert turn.response["choices"][0]["message"]["content"] == answer["choices"][0]["message"]["content"]


def test_opencode_in_forward_mode(forward_proxy, tmp_path):
    """opencode keeps a base URL on a host that is not the proxy; HTTPS_PROXY + CA route it to the session."""
    session = forward_proxy.client.create_session(policy={"max_tokens_cap": 16})
    (tmp_path / "ca.pem").write_bytes(httpx.get(forward_proxy.url + "/ca.pem", timeout=10).content)
    (tmp_path / "work").mkdir()
    result = run_opencode("https://api.openai.com/v1", session["api_key"], tmp_path / "work", tmp_path / "home",
                          HTTPS_PROXY=f"http://127.0.0.1:{forward_proxy.forward_port}",
                          NODE_EXTRA_CA_CERTS=str(tmp_path / "ca.pem"), NO_PROXY="")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    TrainingTrace.model_validate(forward_proxy.client.trace(session["id"]))
