"""gemini-cli (npm @google/gemini-cli), unmodified, as Harbor's recipe drives it: `gemini --yolo --model=M
--prompt=TASK` in a trusted workspace, its API key and base URL pointed at the capture session, which it speaks
to in Google's Gemini API (the proxy's google dialect). Its settings pre-select API-key auth (headless, it cannot
ask), turn usage statistics, telemetry and update checks off, bound its retries (with no server it retries for
minutes; the proxy already retries the engine) and its turns (the step limit).

It is a Node program: `make setup` copies the host's `node` into .tools, mounted like every agent's runtime, so
a task image needs no Node (a glibc userland with libstdc++, which every Debian or Ubuntu image has). What it
did is read from its stream-json events (tool calls, failed and unknown tools, its own report of an API
failure) and from its session file (a shell command's exit code, which the events leave out).

`agent_config`: none or "full" (its own ~30 kB system prompt and 15 tools), "compact" (a short system prompt
and its shell tool alone, for small models: GEMINI_SYSTEM_MD and tools.core), or a settings.json file merged
under the generated one (the auth, endpoint and limits stay the harness's).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

from harness_trainer._exceptions import HarnessError
from harness_trainer.agents.base import INSIDE, AgentReport, AgentRun, read_file
from harness_trainer.agents.events import EVENTS, EventsHarness
from harness_trainer.paths import TOOLS
from harness_trainer.sandboxes.base import Sandbox

NODE = TOOLS / "node" / "bin" / "node"  # the Node agents' runtime (a copy of the host's)
GEMINI = TOOLS / "gemini-cli" / "node_modules" / "@google" / "gemini-cli" / "bundle" / "gemini.js"
COMPACT_PROMPT = INSIDE / "gemini_compact.md"
SHELL = "run_shell_command"
INVALID = ("tool_not_registered", "invalid_tool_params")  # its error types for a call it could not make
EXIT_CODE = re.compile(r"\nExit Code: (-?\d+)")
BLOCKED = "Command injection detected"  # what it tells the model of a command with $(), `...`, <() or >()


def merge(overrides: dict, ours: dict) -> dict:
    """A user's settings.json with ours over it, one level deep (their other keys in a section we set stay)."""
    merged = dict(overrides)
    for key, value in ours.items():
        merged[key] = {**overrides[key], **value} if isinstance(overrides.get(key), dict) else value
    return merged


def read_settings(config: str | None, agent: str) -> tuple[bool, dict]:
    """--agent-config for gemini-cli and qwen-code: (compact?, the user's settings.json or {})."""
    if config in (None, "full", "compact"):
        return config == "compact", {}
    path = Path(config)
    if not path.is_file():
        raise HarnessError(f"--agent-config {config}: no such file (give {agent}'s settings.json, 'compact' for the "
                           "packaged short prompt with its shell tool alone, or 'full')")
    try:
        overrides = json.loads(path.read_text())
    except ValueError as error:
        raise HarnessError(f"--agent-config {config}: not valid JSON ({error}); give a settings.json") from None
    if not isinstance(overrides, dict):
        raise HarnessError(f"--agent-config {config}: a settings.json holds one JSON object")
    return False, overrides


class GeminiCli(EventsHarness):
    """gemini-cli; qwen-code, its fork, is this with its own settings, variables, command and events."""
    name = "gemini-cli"
    needs = "npm and Node.js 20+"
    home = ".gemini"  # its settings folder under /home

    def __init__(self, config: str | None = None):
        self.compact, self.overrides = read_settings(config, self.name)

    def programs(self) -> list[Path | None]:
        return [GEMINI, NODE]

    def settings(self, run: AgentRun) -> dict:
        ours = {"security": {"auth": {"selectedType": "gemini-api-key"}},
                "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
                "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False, "maxAttempts": 3},
                "model": {"maxSessionTurns": int(run.step_limit)}}
        return merge(self.overrides, ours | ({"tools": {"core": [SHELL]}} if self.compact else {}))

    def variables(self, run: AgentRun) -> dict[str, str]:
        return {"GEMINI_API_KEY": run.api_key, "GOOGLE_GEMINI_BASE_URL": run.base_url.removesuffix("/v1"),
                "GEMINI_CLI_TRUST_WORKSPACE": "true",  # else --yolo falls back to asking, which headless cannot
                "GEMINI_CLI_NO_RELAUNCH": "true"}  # it would start itself again in a child Node for a larger heap

    def files(self, run: AgentRun) -> dict[str, tuple[str, str]]:
        """settings.json in its folder, and with `compact` the short system prompt beside it (the same for the fork:
        the same shell tool name)."""
        variable = f"HARNESS_{self.home.strip('.').upper()}"
        return {f"{variable}_SETTINGS": (f"/home/{self.home}/settings.json", json.dumps(self.settings(run))),
                **({f"{variable}_SYSTEM": (f"/home/{self.home}/system.md", COMPACT_PROMPT.read_text())}
                   if self.compact else {})}

    def environment(self, run: AgentRun) -> dict[str, str]:
        system = {f"{self.home.strip('.').upper()}_SYSTEM_MD": f"/home/{self.home}/system.md"} if self.compact else {}
        return self.variables(run) | system

    def command(self, run: AgentRun) -> str:
        # its session file, for the exit codes its events leave out, kept beside the events
        keep = "cp \"$(ls -t /home/.gemini/tmp/*/chats/session-*.jsonl 2>/dev/null | head -n 1)\" " \
               "/logs/agent/session.jsonl 2>/dev/null"
        return (f"{{ {shlex.quote(str(NODE))} {shlex.quote(str(GEMINI))} --yolo "
                f"--model={shlex.quote(run.model)} --prompt=\"$HARNESS_TASK\" --output-format stream-json "
                f"</dev/null >{EVENTS}; code=$?; {keep}; exit $code; }}")

    def read(self, events: Iterator[dict], report: AgentReport, sandbox: Sandbox) -> None:
        joining = False  # the last assistant message is still arriving in pieces (delta events)
        for event in events:
            kind = event.get("type")
            if kind == "message" and event.get("role") == "assistant" and event.get("content"):
                if joining and event.get("delta"):
                    report.completion[-1]["content"] += event["content"]
                else:
                    report.completion.append({"role": "assistant", "content": event["content"]})
                joining = bool(event.get("delta"))
                continue
            joining = False
            if kind == "tool_use":
                report.called(event.get("tool_name") or "?")
            elif kind == "tool_result" and event.get("status") == "error":
                report.tool_failure_count += 1
                report.invalid_tool_calls += (event.get("error") or {}).get("type") in INVALID
            elif kind == "result" and event.get("status") == "error":
                api_error(report, self.name, str((event.get("error") or {}).get("message") or "error"))
        report.tool_failure_count += failed_commands(read_file(sandbox, "/logs/agent/session.jsonl") or "")


def api_error(report: AgentReport, agent: str, message: str) -> None:
    """gemini-cli's and qwen-code's error result: said in the exit status; the rollout's failure where the model API
    failed it (not a turn limit)."""
    report.exit_status += f"; {agent} error: {message[:300]}"
    if message.startswith("[API Error"):
        report.failure = f"{agent}: {message[:300]}"


def failed_commands(session: str) -> int:
    """Shell commands that exited non-zero or that it refused to run (command substitution, which it blocks even
    with --yolo), which its events call successes; from its session file, where each tool call is written twice
    (in flight, then with its result), so they are counted by id."""
    failed = set()
    for line in session.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        for call in record.get("toolCalls") or [] if isinstance(record, dict) else []:
            if call.get("name") != SHELL or call.get("status") != "success":
                continue
            for part in call.get("result") or []:
                output = str(((part.get("functionResponse") or {}).get("response") or {}).get("output", ""))
                if output.startswith(BLOCKED) or ((code := EXIT_CODE.search(output)) and code.group(1) != "0"):
                    failed.add(call.get("id"))
    return len(failed)
