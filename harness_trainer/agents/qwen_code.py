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

import shlex
from collections.abc import Iterator
from pathlib import Path

from harness_trainer.agents.base import AgentReport, AgentRun
from harness_trainer.agents.events import EVENTS
from harness_trainer.agents.gemini_cli import NODE, SHELL, GeminiCli, api_error, merge
from harness_trainer.paths import TOOLS
from harness_trainer.sandboxes.base import Sandbox

QWEN = TOOLS / "qwen-code" / "node_modules" / "@qwen-code" / "qwen-code" / "cli-entry.js"
# What 0.24.4 registers beside the shell tool even under tools.core (the rest of its tools are already gone).
ALWAYS_ON = ["agent", "get_goal", "list_agents", "skill", "tool_call", "tool_search", "update_goal", "enter_worktree",
             "exit_worktree", "record_artifact", "report_findings", "send_message", "task_stop"]
# read_file stays: its shell runs a plain `sed -i` as an edit, refused on a file read_file has not read this session
COMPACT = {"tools": {"core": [SHELL, "read_file"], "disabled": ALWAYS_ON},
           "skills": {"disabledLevels": ["project", "user", "extension", "bundled"]},
           "memory": {"enableManagedAutoMemory": False}}
UNKNOWN_TOOL = "not found in registry"  # its answer to a call of a tool it does not have


class QwenCode(GeminiCli):
    name = "qwen-code"
    home = ".qwen"

    def programs(self) -> list[Path | None]:
        return [QWEN, NODE]

    def settings(self, run: AgentRun) -> dict:
        # one request a try (the proxy already retries the engine); it still makes 7 tries with back-off, ≈ 95 s,
        # which no setting shortens
        model = {"maxSessionTurns": int(run.step_limit), "generationConfig": {"maxRetries": 0}}
        ours = {"privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
                "general": {"enableAutoUpdate": False},
                "model": model | ({"skipStartupContext": True} if self.compact else {})}
        return merge(self.overrides, ours | (COMPACT if self.compact else {}))

    def variables(self, run: AgentRun) -> dict[str, str]:
        return {"OPENAI_API_KEY": run.api_key, "OPENAI_BASE_URL": run.base_url, "OPENAI_MODEL": run.model,
                "QWEN_CODE_NO_RELAUNCH": "true", "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1"}

    def command(self, run: AgentRun) -> str:
        return (f"{shlex.quote(str(NODE))} {shlex.quote(str(QWEN))} --yolo --auth-type openai "
                f"--model {shlex.quote(run.model)} --prompt \"$HARNESS_TASK\" --output-format stream-json "
                f"</dev/null >{EVENTS}")

    def read(self, events: Iterator[dict], report: AgentReport, sandbox: Sandbox) -> None:
        for event in events:
            blocks = (event.get("message") or {}).get("content")
            for block in blocks if isinstance(blocks, list) else []:
                kind = block.get("type")
                if kind == "tool_use":
                    report.called(block.get("name") or "?")
                elif kind == "tool_result" and block.get("is_error"):
                    report.tool_failure_count += 1
                    report.invalid_tool_calls += UNKNOWN_TOOL in str(block.get("content"))
                elif kind == "text" and event.get("type") == "assistant" and block.get("text"):
                    report.completion.append({"role": "assistant", "content": block["text"]})
            if event.get("type") == "result" and event.get("is_error"):
                api_error(report, self.name, str((event.get("error") or {}).get("message") or event.get("subtype")))
