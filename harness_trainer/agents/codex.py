"""codex (npm @openai/codex), unmodified: `codex exec --json` with a private CODEX_HOME whose config.toml names
one model provider, the capture session, spoken to in the Responses API (codex refuses chat completions; it
ignores OPENAI_BASE_URL, so the config file is the only way in). The served model's own name is used: codex
adds catalogue-only tools (apply_patch as a grammar tool, tool_search) for its own model names. Its sandbox is
bypassed because ours already holds it (a sandbox inside bubblewrap is a second bwrap), retries are bounded
because with no server at all it never gives up, and stdin is closed because it reads it when not a TTY.
Its native binary (static, musl) is run directly, not npm's Node launcher: a task image needs no Node for it.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path

from harness_trainer.agents.base import AgentReport, AgentRun
from harness_trainer.agents.events import EVENTS, EventsHarness, platform_binary
from harness_trainer.paths import TOOLS
from harness_trainer.sandboxes.base import Sandbox

CODEX_PACKAGES = TOOLS / "codex" / "node_modules" / "@openai"
KEY_VARIABLE = "HARNESS_CAPTURE_KEY"
NETWORK_WAIT, NETWORK_TRIES = "waiting for network", 3
# its --json item types that are tool calls -> the tool the model called (None: the item names it)
TOOL_ITEMS = {"command_execution": "exec_command", "file_change": "apply_patch", "web_search": "web_search",
              "mcp_tool_call": None}


def config_toml(run: AgentRun) -> str:
    return "\n".join([
        f"model = {json.dumps(run.model)}",
        'model_provider = "capture"',
        "check_for_update_on_startup = false",
        "[model_providers.capture]",
        'name = "capture"',
        f"base_url = {json.dumps(run.base_url)}",
        'wire_api = "responses"',
        f'env_key = "{KEY_VARIABLE}"',
        "request_max_retries = 2",
        "stream_max_retries = 2",
        "[analytics]",
        "enabled = false", ""])


def codex_binary() -> Path | None:  # static (musl)
    return platform_binary(CODEX_PACKAGES, "codex-linux-*/vendor/*/bin/codex")


class Codex(EventsHarness):
    name = "codex"

    def programs(self) -> list[Path | None]:
        return [codex_binary()]

    def files(self, run: AgentRun) -> dict[str, tuple[str, str]]:
        return {"HARNESS_CODEX_CONFIG": ("/home/.codex/config.toml", config_toml(run))}

    def environment(self, run: AgentRun) -> dict[str, str]:
        # TMPDIR must not contain CODEX_HOME, or codex cannot make its helper links and every command fails.
        return {"CODEX_HOME": "/home/.codex", "TMPDIR": "/tmp", KEY_VARIABLE: run.api_key, "RUST_LOG": "error",
                "CODEX_MANAGED_BY_NPM": "1"}

    def command(self, run: AgentRun) -> str:
        # With no server codex reconnects forever (at 0, 6, 16, 37, 78 s ...): a watcher ends it after
        # NETWORK_TRIES such messages, which still rides out a proxy restart of a few seconds.
        return (f"{{ {shlex.quote(str(codex_binary()))} exec --skip-git-repo-check "
                "--dangerously-bypass-approvals-and-sandbox "
                f"--json \"$HARNESS_TASK\" </dev/null >{EVENTS} & agent=$!; "
                f"( while sleep 1; do [ \"$(grep -c '{NETWORK_WAIT}' {EVENTS})\" -ge {NETWORK_TRIES} ] && "
                "kill $agent && exit; done ) & watcher=$!; "
                "wait $agent; code=$?; kill $watcher 2>/dev/null; exit $code; }")

    def read(self, events: Iterator[dict], report: AgentReport, sandbox: Sandbox) -> None:
        """Tool calls by name (command_execution items are its exec_command tool), failures (non-zero exit), the
        agent's messages, and a model-API failure: `turn.failed`, or a run that never completed its turn after
        `error` events (reconnecting, killed)."""
        errors, completed = [], False
        for event in events:
            kind, item = event.get("type"), event.get("item") or {}
            if kind == "item.completed" and item.get("type") in TOOL_ITEMS:
                report.called(TOOL_ITEMS[item["type"]] or item.get("tool") or "?")
                if item.get("status") == "failed" or item.get("exit_code") not in (0, None):
                    report.tool_failure_count += 1
            elif kind == "item.completed" and item.get("type") == "agent_message" and item.get("text"):
                report.completion.append({"role": "assistant", "content": item["text"]})
            elif kind == "turn.completed":
                completed = True
            elif kind == "turn.failed":
                errors.append(str((event.get("error") or {}).get("message", "turn failed")))
            elif kind == "error":
                errors.append(str(event.get("message", "")))
        if errors and (not completed or report.exit_status != "exit 0"):
            report.failure = f"codex: {errors[-1][:300]}" + (" (stopped: no server)" if NETWORK_WAIT in errors[-1]
                                                              else "")
