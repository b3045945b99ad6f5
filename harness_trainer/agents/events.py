"""The shape the agents that leave a log share (claude-code, codex, cline, gemini-cli, qwen-code, aider): their
programs must be installed, their settings files are written into the sandbox from the environment (no quoting of
what they hold), the program runs with the task in $HARNESS_TASK, and what it did is read back from its log. A
subclass says only what differs:

    programs()          what must exist on the host (None: a platform binary that was not found)
    files(run)          {variable: (path inside, text)}: written before the program starts
    environment(run)    its variables (HOME, PWD, HARNESS_TASK and NO_COLOR are set for it)
    command(run)        the program's own command line, its log under /logs/agent
    read(events, report, sandbox)   fill the report from the log's events (read_events: events.jsonl)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from harness_trainer._exceptions import HarnessError
from harness_trainer.agents.base import AgentReport, AgentRun, read_events
from harness_trainer.sandboxes.base import ExecResult, Sandbox

EVENTS = "/logs/agent/events.jsonl"


def write_files(files: dict[str, tuple[str, str]]) -> str:
    """The shell that writes each file from its variable, its folder (and /logs/agent) made first."""
    folders = sorted({"/logs/agent", *(str(PurePosixPath(path).parent) for path, _ in files.values())})
    return f"mkdir -p {' '.join(folders)} && " + "".join(
        f"printf '%s' \"${variable}\" > {path} && " for variable, (path, _) in files.items())


def platform_binary(packages: Path, pattern: str) -> Path | None:
    """The platform package's binary that npm's Node launcher runs (run directly, a task image needs no Node)."""
    found = sorted(packages.glob(pattern))
    return found[0] if found else None


class EventsHarness:
    name: str
    needs = "npm"  # what `make setup` needs to install it, said when it is missing

    def programs(self) -> list[Path | None]:
        raise NotImplementedError

    def files(self, run: AgentRun) -> dict[str, tuple[str, str]]:
        return {}

    def environment(self, run: AgentRun) -> dict[str, str]:
        return {}

    def command(self, run: AgentRun) -> str:
        raise NotImplementedError

    def read(self, events: Iterator[dict], report: AgentReport, sandbox: Sandbox) -> None:
        raise NotImplementedError

    def check_installed(self) -> None:
        for path in self.programs():
            if path is None or not path.exists():
                raise HarnessError(f"{self.name} is not installed ({path or 'its platform binary'} is missing): run "
                                   f"`make setup`{f' (needs {self.needs})' if self.needs else ''}")

    def prepare(self, run: AgentRun) -> tuple[str, dict[str, str]]:
        files = self.files(run)
        env = {"HOME": "/home", "PWD": run.workdir, "HARNESS_TASK": run.instruction, "NO_COLOR": "1",
               **self.environment(run), **{variable: text for variable, (_, text) in files.items()}}
        return write_files(files) + self.command(run), env

    def collect(self, sandbox: Sandbox, result: ExecResult) -> AgentReport:
        report = AgentReport(exit_status=f"exit {result.returncode}")
        self.read(read_events(sandbox), report, sandbox)
        return report
