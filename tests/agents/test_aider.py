"""aider: how it is pointed at the session, and what it did, read from real runs' chat histories (aider 0.86.2
against a scripted server)."""

from agent_logs import replay

from harness_trainer.agents.base import AgentRun
from harness_trainer.agents.registry import make_harness


def test_aider_is_pointed_at_the_session_with_no_temperature_of_its_own():
    run = AgentRun(instruction="Write hi into out.txt.", model="tiny", base_url="http://127.0.0.1:1/v1", api_key="k")
    command, env = make_harness("aider").prepare(run)
    assert env["OPENAI_API_BASE"] == run.base_url and env["OPENAI_API_KEY"] == "k"
    assert env["HARNESS_AIDER_SETTINGS"] == '- name: "openai/tiny"\n  use_temperature: false\n'  # greedy: no logprobs
    assert "--yes-always" in command and "--no-auto-commits" in command and "--model openai/tiny" in command
    assert command.index("git init") < command.index("--yes-always")  # the workspace snapshotted first, as Harbor
    assert "--chat-history-file /logs/agent/" in command and "--input-history-file /logs/agent/" in command


def test_what_aider_did_is_read_from_its_chat_history(tmp_path):
    """A run whose model answered out of format once (a failed, invalid edit), then named the file (aider added it)
    and wrote it whole (an applied edit); and a run whose API never answered (its last error not retried)."""
    report = replay("aider", "aider_run", tmp_path / "run")
    assert report.tool_calls_by_name == {"edit": 1}
    assert report.tool_failure_count == 1 and report.invalid_tool_calls == 1 and not report.failure
    said = [m["content"] for m in report.completion]
    assert said[:2] == ["```\nx = 1\n```", "I need to edit mathx.py."] and said[2].startswith("mathx.py\n```")
    failed = replay("aider", "aider_api_failure", tmp_path / "failed")
    assert failed.failure.startswith("aider: litellm.InternalServerError") and failed.tool_call_count == 0
