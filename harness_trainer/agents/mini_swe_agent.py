"""mini-swe-agent (PyPI), non-interactive, pointed at the session through its own client (inside/mini_client.py)
and read back from its trajectory file."""

from __future__ import annotations

import json
import shlex

from harness_trainer._exceptions import HarnessError
from harness_trainer.agents.base import INSIDE, AgentReport, AgentRun, agent_config, read_file
from harness_trainer.paths import venv_python
from harness_trainer.sandboxes.base import ExecResult, Sandbox

MINI = venv_python("mini").with_name("mini")
COMPACT_CONFIG = INSIDE / "mini_compact.yaml"
MINI_CLIENT = INSIDE / "mini_client.py"  # importable in the jail as harness_mini_client


class MiniSweAgent:
    """mini-swe-agent (PyPI), non-interactive, talking litellm's hosted_vllm provider to the session.
    `config`: a YAML file layered over its default mini.yaml (or "compact", the packaged short prompt)."""
    name = "mini-swe-agent"

    def __init__(self, config: str | None = None):
        path = agent_config(config, COMPACT_CONFIG, "a mini-swe-agent YAML file")
        self.config_text = path.read_text() if path else None

    def check_installed(self) -> None:
        if not MINI.exists():
            raise HarnessError(f"mini-swe-agent is not installed at {MINI}: run `make setup`")

    def prepare(self, run: AgentRun) -> tuple[str, dict[str, str]]:
        command = " ".join([
            shlex.quote(str(MINI)), "-m", shlex.quote(f"hosted_vllm/{run.model}"), "-c", "mini.yaml",
            "-c", shlex.quote(f"model.model_kwargs.api_base={run.base_url}"),
            "-c", shlex.quote(f"model.model_kwargs.api_key={run.api_key}"),
            *(["-c", "/logs/agent/config.yaml"] if self.config_text else []),
            "-c", f"agent.step_limit={run.step_limit}", "-c", shlex.quote(f"environment.cwd={run.workdir}"),
            "-y", "--exit-immediately", "-t", '"$HARNESS_TASK"', "-o", "/logs/agent/traj.json", "</dev/null"])
        env = {"HARNESS_TASK": run.instruction, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
               "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_GLOBAL_CONFIG_DIR": "/home/.mini",
               "MSWEA_CONFIGURED": "true", "OPENAI_API_KEY": run.api_key,
               "HARNESS_MINI_CLIENT": MINI_CLIENT.read_text(), "PYTHONPATH": "/home/.harness"}
        setup = ("mkdir -p /logs/agent /home/.harness && "
                 "printf '%s' \"$HARNESS_MINI_CLIENT\" > /home/.harness/harness_mini_client.py && ")
        if self.config_text:
            env["HARNESS_MINI_CONFIG"] = self.config_text
            setup += "printf '%s' \"$HARNESS_MINI_CONFIG\" > /logs/agent/config.yaml && "
        return setup + command, env

    def collect(self, sandbox: Sandbox, result: ExecResult) -> AgentReport:
        text = read_file(sandbox, "/logs/agent/traj.json")
        if not text:
            return AgentReport(exit_status="no trajectory")
        traj = json.loads(text)
        report = AgentReport(exit_status=str(traj.get("info", {}).get("exit_status", "")))
        for message in traj.get("messages", []):
            role = message.get("role")
            if role == "exit":
                continue
            report.completion.append({k: message[k] for k in ("role", "content", "tool_calls", "tool_call_id")
                                      if k in message})
            for call in message.get("tool_calls") or []:
                report.called((call.get("function") or {}).get("name", "?"))
            extra = message.get("extra") or {}
            if role == "tool" and (extra.get("returncode") not in (0, None) or extra.get("exception_info")):
                report.tool_failure_count += 1
            if extra.get("interrupt_type") == "FormatError":  # no/unparseable tool call, or cut off
                report.invalid_tool_calls += 1
        return report
