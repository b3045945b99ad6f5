"""qwen-code (npm @qwen-code/qwen-code, a fork of gemini-cli that speaks chat completions), unmodified, as
Harbor's recipe drives it: `qwen --yolo --auth-type openai --model M --prompt=TASK`, OPENAI_API_KEY and
OPENAI_BASE_URL pointed at the capture session. Its settings turn usage statistics, telemetry and updates off and
bound its retries and turns; it runs on the same copied node as gemini-cli (a task image needs no Node).

What it did is read from its stream-json events, which are claude-code's shape: tool_use blocks, tool_result
blocks with `is_error` (a non-zero exit included), the result's `[API Error: ...]` when the model API failed it.

`agent_config`: none or "full" (its own ≈ 14k-token prompt, 14 tools and its skills list), "compact" (a short
system prompt, its shell and read_file tools, no skills, auto-memory or start-up context: ≈ 1.1k tokens, the two
tools' own descriptions being most of it), or a settings.json file merged under the generated one.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from harness_trainer._exceptions import HarnessError
from harness_trainer.agents.base import AgentReport, AgentRun, read_events
from harness_trainer.agents.gemini_cli import NODE, SHELL, merge, read_settings
from harness_trainer.agents.sandbox import REPO_ROOT, ExecResult, Sandbox

QWEN = REPO_ROOT / ".tools" / "qwen-code" / "node_modules" / "@qwen-code" / "qwen-code" / "cli-entry.js"
COMPACT_PROMPT = Path(__file__).with_name("gemini_compact.md")  # the same two lines: the same shell tool name
# What 0.24.4 registers beside the shell tool even under tools.core (the rest of its tools are already gone).
ALWAYS_ON = ["agent", "get_goal", "list_agents", "skill", "tool_call", "tool_search", "update_goal", "enter_worktree",
             "exit_worktree", "record_artifact", "report_findings", "send_message", "task_stop"]
# read_file stays: its shell runs a plain `sed -i` as an edit, refused on a file read_file has not read this session
COMPACT = {"tools": {"core": [SHELL, "read_file"], "disabled": ALWAYS_ON},
           "skills": {"disabledLevels": ["project", "user", "extension", "bundled"]},
           "memory": {"enableManagedAutoMemory": False}}
UNKNOWN_TOOL = "not found in registry"  # its answer to a call of a tool it does not have


def settings(run: AgentRun, overrides: dict, compact: bool) -> dict:
    # one request a try (the proxy already retries the engine); it still makes 7 tries with back-off, ≈ 95 s, which
    # no setting shortens
    model = {"maxSessionTurns": int(run.step_limit), "generationConfig": {"maxRetries": 0}}
    ours = {"privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
            "general": {"enableAutoUpdate": False},
            "model": model | ({"skipStartupContext": True} if compact else {})}
    return merge(overrides, ours | (COMPACT if compact else {}))


class QwenCode:
    name = "qwen-code"

    def __init__(self, config: str | None = None):
        self.compact, self.overrides = read_settings(config, "qwen-code")

    def check_installed(self) -> None:
        for path in (QWEN, NODE):
            if not path.exists():
                raise HarnessError(f"qwen-code is not installed ({path} is missing): run `make setup` (needs npm "
                                   "and Node.js 20+)")

    def prepare(self, run: AgentRun) -> tuple[str, dict[str, str]]:
        env = {"HOME": "/home", "PWD": run.workdir, "HARNESS_TASK": run.instruction,
               "HARNESS_QWEN_SETTINGS": json.dumps(settings(run, self.overrides, self.compact)),
               "OPENAI_API_KEY": run.api_key, "OPENAI_BASE_URL": run.base_url, "OPENAI_MODEL": run.model,
               "QWEN_CODE_NO_RELAUNCH": "true", "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1", "NO_COLOR": "1"}
        write = "mkdir -p /logs/agent /home/.qwen && " \
                "printf '%s' \"$HARNESS_QWEN_SETTINGS\" > /home/.qwen/settings.json && "
        if self.compact:
            env |= {"HARNESS_QWEN_SYSTEM": COMPACT_PROMPT.read_text(), "QWEN_SYSTEM_MD": "/home/.qwen/system.md"}
            write += "printf '%s' \"$HARNESS_QWEN_SYSTEM\" > /home/.qwen/system.md && "
        command = (f"{write}{shlex.quote(str(NODE))} {shlex.quote(str(QWEN))} --yolo --auth-type openai "
                   f"--model {shlex.quote(run.model)} --prompt \"$HARNESS_TASK\" --output-format stream-json "
                   "</dev/null >/logs/agent/events.jsonl")
        return command, env

    def collect(self, sandbox: Sandbox, result: ExecResult) -> AgentReport:
        report = AgentReport(exit_status=f"exit {result.returncode}")
        for event in read_events(sandbox):
            blocks = (event.get("message") or {}).get("content")
            for block in blocks if isinstance(blocks, list) else []:
                kind = block.get("type")
                if kind == "tool_use":
                    name = block.get("name") or "?"
                    report.tool_calls_by_name[name] = report.tool_calls_by_name.get(name, 0) + 1
                elif kind == "tool_result" and block.get("is_error"):
                    report.tool_failure_count += 1
                    report.invalid_tool_calls += UNKNOWN_TOOL in str(block.get("content"))
                elif kind == "text" and event.get("type") == "assistant" and block.get("text"):
                    report.completion.append({"role": "assistant", "content": block["text"]})
            if event.get("type") == "result" and event.get("is_error"):
                message = str((event.get("error") or {}).get("message") or event.get("subtype"))[:300]
                report.exit_status += f"; qwen-code error: {message}"
                if message.startswith("[API Error"):  # not a turn limit: the model API failed it
                    report.failure = f"qwen-code: {message}"
        return report
