"""What every harness shares: the run it is given, the report it returns, its protocol, its errors.
Adding an agent is one small class:

    name                       what --harness calls it
    check_installed()          raise HarnessError saying how to install it
    prepare(run) -> (command, env)   a shell command run in the sandbox's workdir, and its environment;
                               may write config files into the sandbox first
    collect(sandbox, result) -> AgentReport
"""

from __future__ import annotations

import json
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from harness_trainer._exceptions import HarnessError
from harness_trainer.sandboxes.base import ExecResult, Sandbox

INSIDE = Path(__file__).with_name("inside")  # what is copied into the sandbox to run there


@dataclass
class AgentRun:
    """What the harness needs to start its agent."""
    instruction: str
    base_url: str  # the capture session's OpenAI-style base URL (ends in /v1)
    api_key: str  # the capture session id
    model: str  # the served model id
    step_limit: int = 30
    timeout_s: float = 600.0
    sandbox: Sandbox | None = None
    workdir: str = "/app"  # where its commands run: the task image's WORKDIR in a container


@dataclass
class AgentReport:
    """What the agent did, from its own output."""
    completion: list[dict] = field(default_factory=list)  # the final transcript, as chat messages
    tool_calls_by_name: dict[str, int] = field(default_factory=dict)
    tool_failure_count: int = 0  # tool calls that failed (non-zero exit, not executed)
    invalid_tool_calls: int = 0  # answers the harness rejected as malformed (no/unparseable tool call)
    exit_status: str = ""
    failure: str = ""  # the agent's own word that the model API failed it: the rollout is then unscorable

    @property
    def tool_call_count(self) -> int:
        return sum(self.tool_calls_by_name.values())

    def called(self, tool: str) -> None:
        """One more call of `tool`."""
        self.tool_calls_by_name[tool] = self.tool_calls_by_name.get(tool, 0) + 1


class Harness(Protocol):
    name: str

    def check_installed(self) -> None: ...
    def prepare(self, run: AgentRun) -> tuple[str, dict[str, str]]: ...
    def collect(self, sandbox: Sandbox, result: ExecResult) -> AgentReport: ...


def read_events(sandbox: Sandbox, inside: str = "/logs/agent/events.jsonl") -> Iterator[dict]:
    """An agent's JSON-lines log, one object a line (a line cut off or not an object, as a killed agent leaves
    its last one, is skipped)."""
    for line in (read_file(sandbox, inside) or "").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event


def read_file(sandbox: Sandbox, inside: str) -> str | None:
    """A file's text from inside the sandbox, or None when it is not there."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            sandbox.download(inside, Path(tmp) / "f")
            return (Path(tmp) / "f").read_text(errors="replace")
        except Exception:
            return None


def exit_reason(code: int, said: str = "") -> str:
    """A crashed agent (or sandbox) in words: negative codes are signals to the sandbox, 128+N to the agent; with
    its own last words where its harness kept more than the code (`said`: the report's exit status)."""
    number = -code if code < 0 else code - 128 if 128 < code < 160 else None
    try:
        killed = f" (killed by {signal.Signals(number).name}{' with its sandbox' if code < 0 else ''})" \
            if number else ""
    except ValueError:
        killed = ""
    words = f" (the agent: {said})" if said not in ("", f"exit {code}") else ""
    return f"the agent exited with code {code}{killed}; its workspace was verified as it stood{words}"


def agent_config(config: str | None, compact: Path, kind: str) -> Path | None:
    """--agent-config for an agent that reads a file: none or 'full' (its own set-up), 'compact' (the packaged
    file), or a path that must exist."""
    path = compact if config == "compact" else Path(config) if config not in (None, "full") else None
    if path is not None and not path.is_file():
        raise HarnessError(f"--agent-config {config}: no such file (give {kind}, or 'compact' for the packaged "
                           "short prompt)")
    return path
