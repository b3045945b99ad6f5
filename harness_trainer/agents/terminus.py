"""Harbor's terminus-2 (Harbor 0.26, the agent Terminal-Bench 2's board is measured with), unmodified, as a harness.

terminus-2 is not an installed program: Harbor runs it in its own process, driving a tmux session in the task's
environment through exec. Here its own class runs inside the sandbox, on the Harbor environment's Python
(`make setup HARBOR=1`; mounted read-only like every agent's runtime), against an environment that is the sandbox
itself (terminus_run.py), so it runs in bubblewrap and in containers alike and reaches only its session.
Its model calls are OpenAI chat completions through litellm (`openai/MODEL` at the session's URL), one user
message and no tools: the model answers in terminus-2's JSON (analysis, plan, commands of keystrokes,
task_complete), which it asks to confirm once. Harbor's defaults otherwise (context summarization on: a
summary is a call of its own, another chain); not Harbor's: `max_turns` = the step limit, and no asciinema
recording (not in the image, not installable offline).
What it did comes from its trajectory (ATIF, /logs/agent/trajectory.json): each command batch and completion
mark is a tool call (`bash_command`, `mark_task_complete`), an answer it could not parse is an invalid call,
an exception from the model API is a failure (the rollout is then unscorable). It needs tmux in the image.
"""

from __future__ import annotations

import json
import shlex

from harness_trainer._exceptions import HarnessError
from harness_trainer.agents.base import INSIDE, AgentReport, AgentRun, read_file
from harness_trainer.paths import venv_python
from harness_trainer.sandboxes.base import ExecResult, Sandbox

HARBOR_PYTHON = venv_python("harbor")
RUNNER = INSIDE / "terminus_run.py"
PARSE_ERROR = "Previous response had parsing errors"
# litellm's exceptions for a model API that did not answer (a context overflow is not one: the run ends as it stood)
API_ERRORS = {"APIConnectionError", "APIError", "InternalServerError", "ServiceUnavailableError", "RateLimitError",
              "Timeout", "BadGatewayError", "APIResponseValidationError", "AuthenticationError", "NotFoundError"}


class Terminus2:
    name = "terminus-2"

    def check_installed(self) -> None:
        if not HARBOR_PYTHON.exists():
            raise HarnessError(f"terminus-2 is Harbor's own agent and runs on Harbor's Python ({HARBOR_PYTHON} is "
                               "missing): run `make setup HARBOR=1` (needs Python 3.12)")

    def prepare(self, run: AgentRun) -> tuple[str, dict[str, str]]:
        env = {"HARNESS_TASK": run.instruction, "HARNESS_BASE_URL": run.base_url, "HARNESS_MODEL": run.model,
               "HARNESS_MAX_TURNS": str(run.step_limit), "OPENAI_API_KEY": run.api_key,
               "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # else litellm fetches its price list from the internet
               "HARNESS_TERMINUS": RUNNER.read_text(), "TMUX_TMPDIR": "/tmp"}
        command = ("mkdir -p /logs/agent /home/.harness && "
                   "printf '%s' \"$HARNESS_TERMINUS\" > /home/.harness/terminus_run.py && "
                   f"{shlex.quote(str(HARBOR_PYTHON))} /home/.harness/terminus_run.py </dev/null")
        return command, env

    def collect(self, sandbox: Sandbox, result: ExecResult) -> AgentReport:
        report = AgentReport(exit_status=f"exit {result.returncode}")
        try:
            steps = json.loads(read_file(sandbox, "/logs/agent/trajectory.json") or "{}").get("steps") or []
        except ValueError:
            steps = []
        for step in steps:
            if step.get("source") == "user":
                report.completion.append({"role": "user", "content": str(step.get("message") or "")})
                continue
            if step.get("source") != "agent":
                continue
            report.completion.append({"role": "assistant", "content": str(step.get("message") or "")})
            for call in step.get("tool_calls") or []:
                report.called(call.get("function_name") or "?")
            seen = "\n".join(str(r.get("content") or "") for r in (step.get("observation") or {}).get("results") or [])
            report.invalid_tool_calls += seen.startswith(PARSE_ERROR)
            if seen:  # what the terminal (or terminus-2) answered, as the next prompt said it
                report.completion.append({"role": "user", "content": seen})
        try:
            outcome = json.loads(read_file(sandbox, "/logs/agent/result.json") or "{}")
        except ValueError:
            outcome = {}
        if error := outcome.get("error"):
            report.exit_status += f"; terminus-2 error: {error[:300]}"
            if outcome.get("error_type") in API_ERRORS:
                report.failure = f"terminus-2: {error[:300]}"
        elif result.returncode == 127:
            report.exit_status += f": {result.stderr.strip()[-300:]}"
        return report
