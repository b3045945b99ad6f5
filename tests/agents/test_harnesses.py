"""Rollout building blocks without a model: Harbor task parsing, the verifier against a planted reward, the
harnesses' settings and what they read back, failure classes (claude-code's and codex's own included), reward
plugins."""

from __future__ import annotations

import dataclasses
import json
import textwrap
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from agent_logs import replay
from stubs import FlakyUpstream, StubHandler

from harness_trainer._exceptions import CaptureContractError, HarnessError, RewardError, TaskError
from harness_trainer.agents.command import CommandHarness
from harness_trainer.agents.registry import make_harness
from harness_trainer.proxy.client import ProxyClient, ProxyServer
from harness_trainer.proxy.engines import ENGINE_FAILED
from harness_trainer.rollouts.rewards import resolve_reward_fn, score
from harness_trainer.rollouts.session import HarnessRolloutOutcome, LocalSessionFactory, run_rollout
from harness_trainer.rollouts.tasks import load_dataset, load_task
from harness_trainer.rollouts.verifier import verify
from harness_trainer.sandboxes.bubblewrap import LocalSandbox

# ---- tasks -------------------------------------------------------------------------------------------------


def make_task(root: Path, name="t", toml='[agent]\ntimeout_sec = 30\n', test="echo 1 > /logs/verifier/reward.txt"):
    task = root / name
    (task / "tests").mkdir(parents=True)
    (task / "instruction.md").write_text("Do the thing.\n")
    (task / "task.toml").write_text(toml)
    (task / "tests" / "test.sh").write_text(f"#!/bin/bash\nmkdir -p /logs/verifier\n{test}\n")
    return task


def test_builtin_sets_parse_with_splits():
    train, heldout, bugfix = (load_dataset(f"builtin:{n}") for n in ("toy-train", "toy-heldout", "bugfix"))
    assert len(train) == 48 and len(heldout) == 16 and len(bugfix) == 5
    pairs = lambda tasks: {(t.metadata["word"], t.metadata["file"]) for t in tasks}  # noqa: E731
    assert not pairs(train) & pairs(heldout) and len(pairs(train) | pairs(heldout)) == 64
    assert {t.metadata["word"] for t in heldout} <= {t.metadata["word"] for t in train}
    assert all(t.solution and t.app_files() for t in train + bugfix)
    assert len(load_dataset("builtin:toy")) == 64


def test_task_toml_errors_name_file_and_field(tmp_path):
    bad = make_task(tmp_path, "bad", toml="[agent]\ntimeout_sec = 'soon'\n")
    with pytest.raises(TaskError, match=r"bad/task.toml \[agent\]: 'timeout_sec' must be a positive number"):
        load_task(bad)
    broken = make_task(tmp_path, "broken", toml="[agent\n")
    with pytest.raises(TaskError, match="broken/task.toml: not valid TOML"):
        load_task(broken)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match="no instruction.md"):
        load_task(tmp_path / "empty")
    assert load_task(make_task(tmp_path, "ok")).agent_timeout_s == 30.0


def test_dataset_spec_errors(tmp_path):
    with pytest.raises(TaskError, match="builtin dataset 'nope': choose toy"):
        load_dataset("builtin:nope")
    with pytest.raises(TaskError, match="Harbor registry"):
        load_dataset("terminal-bench@2.0")
    with pytest.raises(TaskError, match="unknown dataset"):
        load_dataset("no/such/folder")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(TaskError, match="holds no Harbor tasks"):
        load_dataset(str(tmp_path / "nothing"))


def test_hf_dataset_from_local_cache(tmp_path, monkeypatch):
    """A Hub dataset repo of Harbor tasks, read from the local cache (the Hub is unreachable here)."""
    from huggingface_hub import constants

    snapshot = tmp_path / "hub" / "datasets--org--tasks" / "snapshots" / ("a" * 40)
    make_task(snapshot, "task-one")
    (tmp_path / "hub" / "datasets--org--tasks" / "refs").mkdir(parents=True)
    (tmp_path / "hub" / "datasets--org--tasks" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert [t.name for t in load_dataset("hf:org/tasks")] == ["task-one"]
    with pytest.raises(TaskError, match="not in the local Hugging Face cache"):
        load_dataset("hf:org/other")

def test_planted_reward_scores_nothing(tmp_path):
    (task,) = load_dataset("builtin:toy-heldout")[:1]
    box = LocalSandbox(tmp_path / "trial")
    box.start()
    # the "agent" plants a reward and a fake verifier instead of solving the task
    box.exec("mkdir -p /logs/verifier && echo '{\"reward\": 1}' > /logs/verifier/reward.json && "
             "echo 1 > /logs/verifier/reward.txt && printf '#!/bin/bash\\nexit 0\\n' > /tests/test.sh", 10)
    assert verify(box, task).reward == 0.0
    box.exec(f"echo {task.metadata['word']} > /app/{task.metadata['file']}", 10)
    assert verify(box, task).reward == 1.0


def test_verifier_that_cannot_score_gives_none(tmp_path):
    box = LocalSandbox(tmp_path / "trial")
    box.start()
    for test, why in [("exit 3", "neither reward.json nor reward.txt"), ("echo lots > /logs/verifier/reward.txt",
                                                                        "not a number"),
                      ("echo '{\"score\": 1, \"style\": 0}' > /logs/verifier/reward.json", "and no 'reward'")]:
        task = load_task(make_task(tmp_path / why.replace(" ", "_").replace("'", ""), test=test))
        result = verify(box, task)
        assert result.reward is None and why in result.detail
    keyed = load_task(make_task(tmp_path / "keyed", test="echo '{\"score\": 0.5}' > /logs/verifier/reward.json"))
    assert verify(box, keyed, reward_key="score").reward == 0.5
    assert verify(box, keyed).reward == 0.5  # the only key is the reward, whatever its name
    flags = load_task(make_task(tmp_path / "flags", test="echo '{\"reward\": true, \"lint\": false}' > "
                                                           "/logs/verifier/reward.json"))
    result = verify(box, flags)  # booleans count as 1 and 0, as Harbor reads them
    assert result.reward == 1.0 and result.rewards == {"reward": 1.0, "lint": 0.0}


# ---- rollouts and failure classes (no model needed) ----------------------------------------------------


class TraceBreakingClient(ProxyClient):
    """A stub of the proxy's client for fault injection: a real proxy never exports a broken trace."""

    def trace_json(self, session_id, compact=False):  # answers the whole form: the reader takes either
        wire = super().trace(session_id)
        wire["turns"][0]["per_token_logps"][0] = 0.5  # a positive logprob breaks the contract
        return json.dumps(wire).encode()


CLIENT_SCRIPT = textwrap.dedent("""
    import json, os, sys, urllib.request
    text = open(sys.argv[1][1:]).read() if sys.argv[1].startswith("@") else sys.argv[1]  # @FILE: its text
    body = {"model": os.environ["OPENAI_MODEL"], "max_tokens": 4,
            "messages": [{"role": "user", "content": text}],
            "tools": [{"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]}
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", json.dumps(body).encode(),
                                 {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                  "Content-Type": "application/json"})
    print(json.load(urllib.request.urlopen(req))["choices"][0]["message"]["content"])
""")


def command_factory(proxy, tmp_path, tail: str, client=None, **kw) -> LocalSessionFactory:
    import shlex

    template = f"python3 -c {shlex.quote(CLIENT_SCRIPT)} {{instruction}}; {tail}"
    return LocalSessionFactory({"max_tokens_cap": 8}, proxy=client or proxy.client, harness=CommandHarness(template),
                               output_dir=tmp_path, **kw)


def toy():
    return load_dataset("builtin:toy-heldout")[0]


def test_rollout_ok_timeout_and_clean_stop_keep_turns_and_score(proxy, tmp_path):
    solve = "echo {word} > {file}".format(**toy().metadata)
    ok = run_rollout(command_factory(proxy, tmp_path, solve), toy())
    assert ok.status == "ok" and ok.outcome.env_reward == 1.0 and len(ok.outcome.trace) == 1
    slow = run_rollout(command_factory(proxy, tmp_path, f"{solve}; sleep 600",
                                       agent_timeout_s=3), toy())
    assert slow.status == "timeout" and slow.outcome.timed_out
    assert slow.outcome.env_reward == 1.0 and len(slow.outcome.trace) == 1  # turns and score both kept
    crashed = run_rollout(command_factory(proxy, tmp_path, f"{solve}; echo 'ConnectionResetError: reset' >&2; exit 1"),
                          toy())  # scored as it stands, with the agent's own last words (a bench's lost call)
    assert crashed.status == "ok" and crashed.outcome.env_reward == 1.0 and crashed.reason.endswith(
        "verified as it stood (the agent: exit 1: ConnectionResetError: reset)"), crashed.reason
    import shlex

    overflow = f"python3 -c \"print('word ' * 40000)\" > /tmp/big; python3 -c {shlex.quote(CLIENT_SCRIPT)} @/tmp/big"
    stopped = run_rollout(command_factory(proxy, tmp_path, f"{solve}; {overflow}"), toy())
    assert stopped.status == "ok" and stopped.outcome.env_reward == 1.0 and len(stopped.outcome.trace) == 1
    assert stopped.reason.startswith("stopped by the capture proxy: the prompt does not fit the engine")


def test_an_agent_that_stopped_on_the_engines_failure_is_unscorable(engine, tmp_path):
    """Its last call got a 503 from the engine (after the proxy's retries) and it exited: whatever the verifier
    says is not the policy's score. A failure it recovered from is only a retry."""
    import shlex

    FlakyUpstream.engine_url, FlakyUpstream.failures, FlakyUpstream.seen = engine.url, 0, 0
    stub = ThreadingHTTPServer(("127.0.0.1", 0), FlakyUpstream)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    solve, client = "echo {word} > {file}".format(**toy().metadata), f"python3 -c {shlex.quote(CLIENT_SCRIPT)}"
    try:
        with ProxyServer(f"http://127.0.0.1:{stub.server_port}", model="tiny", log_path=tmp_path / "p.log") as flaky:
            stopped = run_rollout(command_factory(flaky, tmp_path, f"{solve}; {client} down"), toy())
            assert stopped.status == "unscorable" and stopped.outcome.env_reward is None, stopped.reason
            assert stopped.reason == f"{ENGINE_FAILED}: the engine answered HTTP 503" and stopped.agent_exit == 1
            recovered = run_rollout(command_factory(flaky, tmp_path, f"{client} down; {solve}; {client} hi"), toy())
            assert recovered.status == "ok" and recovered.outcome.env_reward == 1.0, recovered.reason
            assert len(recovered.outcome.trace) == 2
    finally:
        stub.shutdown()


def test_rollout_failure_classes(proxy, tmp_path, monkeypatch):
    with pytest.raises(HarnessError, match="the agent program /no/such/agent .* does not exist"):
        LocalSessionFactory(proxy=proxy.client, harness=CommandHarness("/no/such/agent {instruction}"))
    not_started = run_rollout(LocalSessionFactory(proxy=proxy.client, harness=CommandHarness(
        "no-such-agent-program {instruction}"), output_dir=tmp_path), toy())  # a bare name: the sandbox's PATH
    assert not_started.status == "unscorable" and "did not start" in not_started.reason
    assert not_started.outcome.env_reward is None and not_started.training_trace is None
    # an agent that ran and ended before the model ever answered it (found at 1,024 in flight: its first call
    # failed in transport): the verifier's 0 is the harness's, not the policy's
    untouched = run_rollout(LocalSessionFactory(proxy=proxy.client, harness=CommandHarness(
        "sh -c 'echo Traceback >&2; echo ConnectError: refused >&2; exit 1' {instruction}"), output_dir=tmp_path),
        toy())
    assert untouched.status == "unscorable" and "no agent turns were captured" in untouched.reason
    assert untouched.reason.endswith("(the agent: exit 1: Traceback ConnectError: refused)")  # its own account
    assert untouched.outcome.env_reward is None and untouched.agent_exit == 1
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    no_sandbox = run_rollout(command_factory(proxy, tmp_path, "true", sandbox="e2b"), toy())
    assert no_sandbox.status == "unscorable" and "E2B_API_KEY" in no_sandbox.reason
    dead = ProxyClient("http://127.0.0.1:9", admin_key="x", timeout_s=2)
    no_transport = run_rollout(command_factory(proxy, tmp_path, "true", client=dead), toy())
    assert no_transport.status == "unscorable" and "capture session" in no_transport.reason
    broken = TraceBreakingClient(proxy.url, proxy.admin_key)
    with pytest.raises(CaptureContractError, match="breaks the TrainingTrace contract"):
        run_rollout(command_factory(proxy, tmp_path, "true", client=broken), toy())

class FiveHundred(StubHandler):
    """A stub engine for fault injection (the real one cannot be made to fail on demand): every call is a 500."""
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_json(500, b'{"error": {"message": "injected engine failure", "code": 500}}')


class UpstreamClient(ProxyClient):
    """Creates every capture session on another upstream (here: the failing stub)."""
    upstream = ""

    def create_session(self, **settings) -> dict:
        return super().create_session(upstream=self.upstream, model="tiny", **settings)


@pytest.mark.parametrize("harness,mode", [("claude-code", "bare"), pytest.param("codex", None, marks=pytest.mark.slow),
                                          pytest.param("gemini-cli", "compact", marks=pytest.mark.slow),
                                          pytest.param("qwen-code", "compact", marks=pytest.mark.slow),
                                          pytest.param("cline", None, marks=pytest.mark.slow)],
                         ids=["claude-code", "codex", "gemini-cli", "qwen-code", "cline"])  # back-off: slow
def test_npm_agents_failures_end_unscorable_with_the_reason(proxy, tmp_path, harness, mode):
    """No server (nothing listens at the agent's base URL) and HTTP 500 from the engine: each rollout ends
    unscorable, with the agent's own words, well inside the agent timeout (codex alone would reconnect forever)."""
    import socket
    import threading
    import time

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        closed_port = free.getsockname()[1]
    stub = ThreadingHTTPServer(("127.0.0.1", 0), FiveHundred)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    client = UpstreamClient(proxy.url, proxy.admin_key)
    client.upstream = f"http://127.0.0.1:{stub.server_port}"
    class NoServer(LocalSessionFactory):
        """Fault injection: the agent is given a base URL where nothing listens (its trial forwards only the proxy's
        port, so this one is closed inside the trial too)."""

        def agent_base_url(self, capture, task):
            return f"http://127.0.0.1:{closed_port}/v1"

    faults = {"no server": (NoServer, dict(proxy=proxy.client)), "HTTP 500": (LocalSessionFactory, dict(proxy=client))}
    # qwen-code and cline give up only after tries with back-off (≈ 95 s and 66 s, not settings): their task gets
    # the time to
    slow = harness in ("qwen-code", "cline")
    task = dataclasses.replace(toy(), agent_timeout_s=240) if slow else toy()
    try:
        for fault, (kind, wiring) in faults.items():
            factory = kind({"max_tokens_cap": 16}, harness=harness, agent_config=mode,
                           output_dir=tmp_path / fault, agent_timeout_s=240, **wiring)
            started = time.perf_counter()
            record = run_rollout(factory, task)
            assert record.status == "unscorable" and record.outcome.env_reward is None, (fault, record.reason)
            assert "model API failure" in record.reason and harness in record.reason, (fault, record.reason)
            assert time.perf_counter() - started < (200 if slow else 100), fault
    finally:
        stub.shutdown()


def test_opencode_config_is_merged_under_the_session_and_bad_ones_are_named(tmp_path):
    """--agent-config for opencode: 'compact' (a short prompt, the bash tool only), a user's opencode.json
    merged in (the provider and model stay the session's), and clear errors for a missing or broken file."""
    import json

    from harness_trainer.agents.base import AgentRun

    run = AgentRun(instruction="Write the word cookie into data.txt.", model="tiny",
                   base_url="http://127.0.0.1:1/v1", api_key="k", step_limit=3)
    config = lambda harness: json.loads(harness.prepare(run)[1]["HARNESS_OPENCODE_CONFIG"])  # noqa: E731
    full, compact = config(make_harness("opencode")), config(make_harness("opencode", config="compact"))
    assert "agent" not in full and "tools" not in full
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in compact["agent"]["build"]["prompt"]
    assert compact["tools"]["write"] is False and "bash" not in compact["tools"]
    # a permission opencode grants turns its tools back on: none is granted over a tool the config turned off
    assert compact["permission"] == {"bash": "allow", "external_directory": "allow"}
    assert full["permission"] == {"edit": "allow", "bash": "allow", "webfetch": "allow", "external_directory": "allow"}
    assert compact["provider"] == full["provider"] and compact["model"] == "capture/tiny"
    own = tmp_path / "opencode.json"
    own.write_text(json.dumps({"model": "elsewhere/big", "permission": {"bash": "allow"}}))
    mine = config(make_harness("opencode", config=str(own)))
    assert mine["permission"] == {"bash": "allow"} and mine["model"] == "capture/tiny"
    with pytest.raises(HarnessError, match="no such file"):
        make_harness("opencode", config=str(tmp_path / "missing.json"))
    own.write_text("{not json")
    with pytest.raises(HarnessError, match="not valid JSON"):
        make_harness("opencode", config=str(own))
    with pytest.raises(HarnessError, match="read by the mini-swe-agent, opencode, claude-code, gemini-cli and qwen"):
        make_harness("codex", config="compact")


def test_gemini_cli_settings_and_what_it_did(tmp_path):
    """gemini-cli's settings: API-key auth pre-selected, statistics and updates off, retries and turns bounded,
    'compact' its shell tool alone with a short system prompt, a user's settings.json merged under ours. What it
    did, read from a real run's events and session file (gemini-cli 0.61.0 against a scripted server: a command
    that worked, one that exited 2, one it blocked for its command substitution, an unknown tool)."""
    import json

    from harness_trainer.agents.base import AgentRun

    run = AgentRun(instruction="Write hi into out.txt.", model="tiny", base_url="http://127.0.0.1:1/v1", api_key="k",
                   step_limit=7)
    command, env = make_harness("gemini-cli", config="compact").prepare(run)
    settings = json.loads(env["HARNESS_GEMINI_SETTINGS"])
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key"
    assert settings["model"]["maxSessionTurns"] == 7
    assert settings["privacy"]["usageStatisticsEnabled"] is False and settings["general"]["maxAttempts"] == 3
    assert settings["tools"] == {"core": ["run_shell_command"]} and "COMPLETE_TASK" in env["HARNESS_GEMINI_SYSTEM"]
    assert env["GOOGLE_GEMINI_BASE_URL"] == "http://127.0.0.1:1" and env["GEMINI_API_KEY"] == "k"
    assert "--yolo" in command and "GEMINI_SYSTEM_MD" not in make_harness("gemini-cli").prepare(run)[1]
    own = tmp_path / "settings.json"
    own.write_text(json.dumps({"general": {"vimMode": True, "maxAttempts": 10}, "ui": {"theme": "x"}}))
    mine = json.loads(make_harness("gemini-cli", config=str(own)).prepare(run)[1]["HARNESS_GEMINI_SETTINGS"])
    assert mine["general"]["vimMode"] is True and mine["general"]["maxAttempts"] == 3 and mine["ui"] == {"theme": "x"}
    with pytest.raises(HarnessError, match="no such file"):
        make_harness("gemini-cli", config=str(tmp_path / "missing.json"))
    report = replay("gemini-cli", "gemini_cli_run", tmp_path)
    assert report.tool_calls_by_name == {"run_shell_command": 3, "no_such_tool": 1}
    assert report.tool_failure_count == 3 and report.invalid_tool_calls == 1  # exit 2, blocked, unknown tool
    assert report.completion == [{"role": "assistant", "content": "Done."}] and not report.failure


# ---- rewards ------------------------------------------------------------------------------------------------


def outcome(reward, calls=3):
    return HarnessRolloutOutcome(env_reward=reward, completion=[], trace=[], tool_call_count=calls,
                                 tool_failure_count=0, tool_calls_by_name={"bash": calls}, timed_out=False)


def test_reward_plugins(tmp_path, monkeypatch):
    assert resolve_reward_fn(None)(outcome(0.5)) == 0.5
    bonus = resolve_reward_fn("verifier+tools")
    assert bonus(outcome(1.0, calls=3)) == pytest.approx(1.0 + 0.3 * 0.8)
    assert bonus(outcome(0.0, calls=1)) == 0.0 and bonus(outcome(None)) is None
    (tmp_path / "my_rewards.py").write_text(
        "def short(o):\n    return None if o.env_reward is None else -o.tool_call_count\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_reward_fn("my_rewards:short")
    assert score(fn, outcome(1.0, calls=4)) == -4.0 and score(fn, outcome(None)) is None
    assert resolve_reward_fn(lambda o: 2.0)(outcome(0)) == 2.0
    with pytest.raises(RewardError, match="cannot import"):
        resolve_reward_fn("my_rewards:missing")
    with pytest.raises(RewardError, match="must return a finite number"):
        score(lambda o: float("nan"), outcome(1.0))


def test_qwen_code_settings_and_what_it_did(tmp_path):
    """qwen-code's settings (statistics and updates off, retries and turns bounded; 'compact': its shell and read tools,
    no skills, auto-memory or start-up context) and what it did, read from a real run's stream-json events
    (qwen-code 0.24.4 against a scripted server: a command that worked, one that exited 2, one with command
    substitution, which qwen-code runs, an unknown tool)."""
    import json

    from harness_trainer.agents.base import AgentRun

    run = AgentRun(instruction="Write hi into out.txt.", model="tiny", base_url="http://127.0.0.1:1/v1", api_key="k",
                   step_limit=5)
    command, env = make_harness("qwen-code", config="compact").prepare(run)
    settings = json.loads(env["HARNESS_QWEN_SETTINGS"])
    assert settings["model"]["maxSessionTurns"] == 5 and settings["model"]["skipStartupContext"] is True
    assert settings["tools"]["core"] == ["run_shell_command", "read_file"] and "skill" in settings["tools"]["disabled"]
    assert env["OPENAI_BASE_URL"] == run.base_url and env["OPENAI_API_KEY"] == "k" and "QWEN_SYSTEM_MD" in env
    assert "--yolo --auth-type openai" in command
    full = json.loads(make_harness("qwen-code").prepare(run)[1]["HARNESS_QWEN_SETTINGS"])
    assert "tools" not in full and "skipStartupContext" not in full["model"]
    report = replay("qwen-code", "qwen_code_run", tmp_path)
    assert report.tool_calls_by_name == {"run_shell_command": 3, "no_such_tool": 1}
    assert report.tool_failure_count == 2 and report.invalid_tool_calls == 1  # exit 2, the unknown tool
    assert report.completion == [{"role": "assistant", "content": "Done."}] and not report.failure


def test_cline_is_pointed_at_the_session_and_what_it_did_is_read(tmp_path):
    """cline's own auth command names the session as its OpenAI-compatible provider; what it did, read from a real
    run's --json events (cline 3.0.65 against a scripted server: a command that worked, one that exited 2, one
    with command substitution, an unknown tool)."""
    from harness_trainer.agents.base import AgentRun

    run = AgentRun(instruction="-n is not a flag here", model="tiny", base_url="http://127.0.0.1:1/v1", api_key="k")
    command, env = make_harness("cline").prepare(run)
    assert "auth -p openai -k \"$HARNESS_CAPTURE_KEY\" -m tiny -b http://127.0.0.1:1/v1" in command
    assert "--json -m tiny -- \"$HARNESS_TASK\"" in command and env["HARNESS_CAPTURE_KEY"] == "k"
    report = replay("cline", "cline_run", tmp_path)
    assert report.tool_calls_by_name == {"run_commands": 3, "no_such_tool": 1}
    assert report.tool_failure_count == 2 and report.invalid_tool_calls == 1  # exit 2, the unknown tool
    assert report.completion == [{"role": "assistant", "content": "Done."}] and not report.failure
