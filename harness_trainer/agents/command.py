"""`--harness command`: any CLI that honours OPENAI_BASE_URL / OPENAI_API_KEY, from a command template."""

from __future__ import annotations

import shlex
from pathlib import Path

from harness_trainer._exceptions import HarnessError
from harness_trainer.agents.base import AgentReport, AgentRun, Harness
from harness_trainer.sandboxes.base import ExecResult, Sandbox


class CommandHarness:
    """Any CLI that honours OPENAI_BASE_URL / OPENAI_API_KEY, from a template with {instruction}, {model},
    {base_url}, {api_key} (shell-quoted when substituted)."""
    name = "command"

    def __init__(self, template: str):
        if "{instruction}" not in template:
            raise HarnessError("a command harness template must contain {instruction}")
        self.template = template

    def check_installed(self) -> None:
        """A program named by path must exist (a bare name is left to the sandbox's PATH)."""
        try:
            program = shlex.split(self.template)[0]
        except (ValueError, IndexError):
            raise HarnessError(f"--agent-command {self.template!r} is not a valid shell command line") from None
        if "/" in program and not Path(program).exists():
            raise HarnessError(f"the agent program {program} (from --agent-command) does not exist: install the "
                               "agent there, or fix the path in the template")

    def prepare(self, run: AgentRun) -> tuple[str, dict[str, str]]:
        values = {"instruction": run.instruction, "model": run.model, "base_url": run.base_url,
                  "api_key": run.api_key}
        command = self.template  # plain replacement: the template may hold other braces (JSON, scripts)
        for key, value in values.items():
            command = command.replace("{" + key + "}", shlex.quote(value))
        return command, {"OPENAI_BASE_URL": run.base_url, "OPENAI_API_KEY": run.api_key, "OPENAI_MODEL": run.model}

    def collect(self, sandbox: Sandbox, result: ExecResult) -> AgentReport:
        # a program that failed says why on stderr (a connect error, a traceback): its last lines kept with the exit
        said = " ".join(result.stderr.strip().splitlines()[-3:])[-400:] if result.returncode else ""
        return AgentReport(completion=[{"role": "assistant", "content": result.stdout[-8000:]}],
                           exit_status=f"exit {result.returncode}" + (f": {said}" if said else ""))


def command_harness(command: str | None, config: str | None) -> Harness:
    if not command:
        raise HarnessError("--harness command needs --agent-command 'TEMPLATE with {instruction}'")
    return CommandHarness(command)
