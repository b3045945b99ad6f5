"""opencode (npm opencode-ai), its provider the session, read back from its JSON event stream."""

from __future__ import annotations

import json
import shlex

from harness_trainer._exceptions import HarnessError
from harness_trainer.agents.base import INSIDE, AgentReport, AgentRun, agent_config, read_events
from harness_trainer.paths import TOOLS
from harness_trainer.sandboxes.base import ExecResult, Sandbox

OPENCODE = TOOLS / "opencode" / "node_modules" / ".bin" / "opencode"
OPENCODE_COMPACT = INSIDE / "opencode_compact.json"
# opencode's permissions and the tools each governs (its `edit` covers every tool that writes files)
OPENCODE_PERMISSIONS = {"edit": ("edit", "write", "patch", "multiedit"), "bash": ("bash",),
                        "webfetch": ("webfetch",), "external_directory": ()}


class OpenCode:
    """opencode (npm opencode-ai): an @ai-sdk/openai-compatible provider pointed at the session; the title
    (small) model is routed to the same session, so its call is captured and marked auxiliary.
    `config`: an opencode.json merged under the generated one (its agents, tools, permissions; the provider
    and model stay the session's), or "compact": the packaged short prompt with the bash tool only."""
    name = "opencode"

    def __init__(self, config: str | None = None):
        path = agent_config(config, OPENCODE_COMPACT, "an opencode.json file")
        try:
            self.overrides = json.loads(path.read_text()) if path else {}
        except ValueError as error:
            raise HarnessError(f"--agent-config {config}: not valid JSON ({error}); give an opencode.json file") \
                from None
        if not isinstance(self.overrides, dict):
            raise HarnessError(f"--agent-config {config}: an opencode.json holds one JSON object")

    def permission(self) -> dict[str, str]:
        """The sandbox is the boundary: opencode's own prompts for files outside its project folder (a task's
        /srv, /solution, /tmp) would be refused in a non-interactive run, a tool failure that looks like the
        model's. But opencode reads `permission: allow` as turning a tool on: granted over the compact config's
        `tools: {edit: false, ...}` it put edit, write and webfetch back into the prompt (4 tools instead of
        bash alone: the tiny model's opencode proof fell from 15/32 to 3/32 after SFT). So a permission is
        granted only where the config has none of its tools turned off."""
        off = {name for name, on in (self.overrides.get("tools") or {}).items() if on is False}
        return {permission: "allow" for permission, tools in OPENCODE_PERMISSIONS.items() if not off & set(tools)}

    def check_installed(self) -> None:
        if not OPENCODE.exists():
            raise HarnessError(f"opencode is not installed at {OPENCODE}: run `make setup` (needs npm)")

    def prepare(self, run: AgentRun) -> tuple[str, dict[str, str]]:
        config = {"permission": self.permission()} | self.overrides | {
            "$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
            "model": f"capture/{run.model}", "small_model": f"capture/{run.model}",
            "provider": {"capture": {"npm": "@ai-sdk/openai-compatible", "name": "capture",
                                     "options": {"baseURL": run.base_url, "apiKey": run.api_key},
                                     "models": {run.model: {"name": run.model, "tool_call": True,
                                                            "limit": {"context": 32768, "output": 1024}}}}}}
        env = {"HARNESS_OPENCODE_CONFIG": json.dumps(config), "HARNESS_TASK": run.instruction, "PWD": run.workdir,
               "XDG_CONFIG_HOME": "/home/.config", "XDG_DATA_HOME": "/home/.local/share",
               "XDG_CACHE_HOME": "/home/.cache", "XDG_STATE_HOME": "/home/.local/state",
               "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
               "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_SHARE": "1"}
        command = ("mkdir -p /logs/agent /home/.config/opencode && "
                   "printf '%s' \"$HARNESS_OPENCODE_CONFIG\" > /home/.config/opencode/opencode.json && "
                   f"{shlex.quote(str(OPENCODE))} run --format json \"$HARNESS_TASK\" "
                   "</dev/null >/logs/agent/events.jsonl")
        return command, env

    def collect(self, sandbox: Sandbox, result: ExecResult) -> AgentReport:
        report = AgentReport(exit_status=f"exit {result.returncode}")
        for event in read_events(sandbox):
            part = event.get("part") or {}
            if part.get("type") == "tool":
                name = part.get("tool", "?")
                report.called(name)
                if (part.get("state") or {}).get("status") == "error":
                    report.tool_failure_count += 1
                if name == "invalid":  # opencode's stand-in for a call to no tool or with bad arguments
                    report.invalid_tool_calls += 1
            elif part.get("type") == "text" and part.get("text"):
                report.completion.append({"role": "assistant", "content": part["text"]})
                if "<tool_call>" in part["text"]:  # a call the engine's parser could not read: it stayed text
                    report.invalid_tool_calls += 1
            elif part.get("type") == "step-finish" and part.get("reason") == "length":
                report.invalid_tool_calls += 1  # cut off at the token cap: whatever it was saying is lost
        return report
