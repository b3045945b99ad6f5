"""terminus-2 (Harbor's own agent class, run in the sandbox on the Harbor environment's Python): how it is pointed at
the session, and what it did, read from real runs' trajectories (terminus-2 of harbor 0.26 against a scripted
server; the pane's folder renamed /app)."""

from agent_logs import replay

from harness_trainer.agents.base import AgentRun
from harness_trainer.agents.registry import make_harness
from harness_trainer.agents.terminus import HARBOR_PYTHON, RUNNER


def test_terminus_is_pointed_at_the_session_with_harbors_own_class():
    run = AgentRun(instruction="Write hi into out.txt.", model="tiny", base_url="http://127.0.0.1:1/v1", api_key="k",
                   step_limit=7)
    command, env = make_harness("terminus-2").prepare(run)
    assert env["HARNESS_BASE_URL"] == run.base_url and env["OPENAI_API_KEY"] == "k" and env["HARNESS_MODEL"] == "tiny"
    assert env["HARNESS_MAX_TURNS"] == "7" and env["HARNESS_TASK"] == run.instruction
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"  # no price list fetched from the internet
    # the runner goes in as text (the project's source is not mounted), run by the Harbor environment's Python
    assert env["HARNESS_TERMINUS"] == RUNNER.read_text()
    assert f"{HARBOR_PYTHON} /home/.harness/terminus_run.py" in command
    assert "from harbor.agents.terminus_2 import Terminus2" in env["HARNESS_TERMINUS"]


def test_what_terminus_did_is_read_from_its_trajectory(tmp_path):
    """A run whose model answered with no JSON once (an invalid answer, re-asked), then typed two commands, then
    marked the task complete and confirmed it; and a run whose model API never answered (503 after litellm's
    retries): a failure, so the rollout is unscorable."""
    report = replay("terminus-2", "terminus_run", tmp_path / "run")
    assert report.tool_calls_by_name == {"bash_command": 2, "mark_task_complete": 2}
    assert report.invalid_tool_calls == 1 and not report.failure
    said = [m["content"] for m in report.completion]
    assert said[0].startswith("You are an AI assistant tasked with solving command-line tasks")
    assert any("echo hi > x.txt" in text and "\nhi\n" in text for text in said)  # the pane's output, as it was shown
    failed = replay("terminus-2", "terminus_api_failure", tmp_path / "failed")
    assert failed.failure.startswith("terminus-2: ServiceUnavailableError") and failed.tool_call_count == 0
