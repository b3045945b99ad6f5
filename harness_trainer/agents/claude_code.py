"""claude-code (npm @anthropic-ai/claude-code), unmodified: its Anthropic Messages calls go to the capture
session (the proxy's anthropic dialect), every model name it may ask for (main, small/haiku, sub-agent) is the
served model, non-essential traffic and the per-call attribution header are off (that header's hash would make
every turn a new root: see proxy/anthropic.py), and it runs non-interactively as root with only its Bash tool
allowed. `agent_config="bare"` is its own slim mode (`--bare --tools Bash`: one tool, a 3 KB request) for small
models whose context cannot hold the full tool set (≈ 70k characters); the default keeps the full set.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path

from harness_trainer._exceptions import HarnessError
from harness_trainer.agents.base import AgentReport, AgentRun
from harness_trainer.agents.events import EVENTS, EventsHarness
from harness_trainer.paths import TOOLS
from harness_trainer.sandboxes.base import Sandbox

CLAUDE = TOOLS / "claude-code" / "node_modules" / ".bin" / "claude"
MODES = ("full", "bare")


class ClaudeCode(EventsHarness):
    name = "claude-code"

    def __init__(self, mode: str | None = None):
        if (mode or "full") not in MODES:
            raise HarnessError(f"--agent-config {mode!r} for claude-code: choose full (all its tools) or bare "
                               "(its slim mode, one Bash tool: for small models)")
        self.mode = mode or "full"

    def programs(self) -> list[Path | None]:
        return [CLAUDE]

    def environment(self, run: AgentRun) -> dict[str, str]:
        model = run.model
        return {"ANTHROPIC_BASE_URL": run.base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": run.api_key,
                "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
                "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
                "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "CLAUDE_CODE_SUBAGENT_MODEL": model,
                "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
                "CLAUDE_CODE_MAX_RETRIES": "2"}

    def command(self, run: AgentRun) -> str:
        slim = " --bare --tools Bash" if self.mode == "bare" else ""
        return (f"{shlex.quote(str(CLAUDE))} -p \"$HARNESS_TASK\" --allowedTools Bash"
                f"{slim} --max-turns {int(run.step_limit)} --output-format stream-json --verbose "
                f"</dev/null >{EVENTS}")

    def read(self, events: Iterator[dict], report: AgentReport, sandbox: Sandbox) -> None:
        """Tool calls by name (tool_use blocks), failures (tool_result is_error) and the final result, from its
        stream-json events."""
        for event in events:
            blocks = (event.get("message") or {}).get("content") or []
            for block in blocks if isinstance(blocks, list) else []:
                if block.get("type") == "tool_use":
                    report.called(block.get("name", "?"))
                elif block.get("type") == "tool_result" and block.get("is_error"):
                    report.tool_failure_count += 1
                elif block.get("type") == "text" and event.get("type") == "assistant" and block.get("text"):
                    report.completion.append({"role": "assistant", "content": block["text"]})
            if event.get("type") == "result" and event.get("is_error"):
                text = str(event.get("result"))[:300]
                report.exit_status += f"; claude-code error: {text}"
                if event.get("api_error_status") or text.startswith("API Error"):  # not max-turns: the API failed it
                    report.failure = f"claude-code: {text}"
