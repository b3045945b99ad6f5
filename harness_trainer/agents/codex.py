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
from pathlib import Path

from harness_trainer._exceptions import HarnessError
from harness_trainer.agents.base import AgentReport, AgentRun, read_events
from harness_trainer.agents.sandbox import REPO_ROOT, ExecResult, Sandbox

CODEX_PACKAGES = REPO_ROOT / ".tools" / "codex" / "node_modules" / "@openai"
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


def codex_binary() -> Path | None:
    """The platform package's static binary, the one npm's `codex` launcher (a Node script) execs."""
    found = sorted(CODEX_PACKAGES.glob("codex-linux-*/vendor/*/bin/codex"))
    return found[0] if found else None


class Codex:
    name = "codex"

    def check_installed(self) -> None:
        if codex_binary() is None:
            raise HarnessError(f"codex is not installed under {CODEX_PACKAGES}: run `make setup` (needs npm)")

    def prepare(self, run: AgentRun) -> tuple[str, dict[str, str]]:
        # TMPDIR must not contain CODEX_HOME, or codex cannot make its helper links and every command fails.
        env = {"HOME": "/home", "CODEX_HOME": "/home/.codex", "TMPDIR": "/tmp", "PWD": run.workdir,
               "HARNESS_TASK": run.instruction, "HARNESS_CODEX_CONFIG": config_toml(run), KEY_VARIABLE: run.api_key,
               "RUST_LOG": "error", "NO_COLOR": "1", "CODEX_MANAGED_BY_NPM": "1"}
        events = "/logs/agent/events.jsonl"
        # With no server codex reconnects forever (at 0, 6, 16, 37, 78 s ...): a watcher ends it after
        # NETWORK_TRIES such messages, which still rides out a proxy restart of a few seconds.
        command = ("mkdir -p /logs/agent /home/.codex && "
                   "printf '%s' \"$HARNESS_CODEX_CONFIG\" > /home/.codex/config.toml && "
                   f"{{ {shlex.quote(str(codex_binary()))} exec --skip-git-repo-check "
                   "--dangerously-bypass-approvals-and-sandbox "
                   f"--json \"$HARNESS_TASK\" </dev/null >{events} & agent=$!; "
                   f"( while sleep 1; do [ \"$(grep -c '{NETWORK_WAIT}' {events})\" -ge {NETWORK_TRIES} ] && "
                   "kill $agent && exit; done ) & watcher=$!; "
                   "wait $agent; code=$?; kill $watcher 2>/dev/null; exit $code; }")
        return command, env

    def collect(self, sandbox: Sandbox, result: ExecResult) -> AgentReport:
        """Tool calls by name (command_execution items are its exec_command tool), failures (non-zero exit), the
        agent's messages, and a model-API failure: `turn.failed`, or a run that never completed its turn after
        `error` events (reconnecting, killed)."""
        report = AgentReport(exit_status=f"exit {result.returncode}")
        errors, completed = [], False
        for event in read_events(sandbox):
            kind, item = event.get("type"), event.get("item") or {}
            if kind == "item.completed" and item.get("type") in TOOL_ITEMS:
                name = TOOL_ITEMS[item["type"]] or item.get("tool") or "?"
                report.tool_calls_by_name[name] = report.tool_calls_by_name.get(name, 0) + 1
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
        if errors and (not completed or result.returncode != 0):
            report.failure = f"codex: {errors[-1][:300]}" + (" (stopped: no server)" if NETWORK_WAIT in errors[-1]
                                                              else "")
        return report
