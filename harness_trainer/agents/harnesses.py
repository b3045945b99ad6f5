"""Harnesses: how to run one unmodified agent program against a capture session, inside a sandbox,
and what it did, read from its own output (the contract: agents/base.py). mini-swe-agent, opencode and the
command template live here; claude-code, codex, cline, gemini-cli and qwen-code have a file each.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path

from harness_trainer._exceptions import HarnessError
from harness_trainer.agents.aider import Aider
from harness_trainer.agents.base import AgentReport, AgentRun, Harness, read_events, read_file
from harness_trainer.agents.claude_code import ClaudeCode
from harness_trainer.agents.cline import Cline
from harness_trainer.agents.codex import Codex
from harness_trainer.agents.gemini_cli import GeminiCli
from harness_trainer.agents.qwen_code import QwenCode
from harness_trainer.agents.sandbox import REPO_ROOT, ExecResult, Sandbox
from harness_trainer.agents.terminus import Terminus2

__all__ = ["HarnessError", "AgentReport", "AgentRun", "Harness", "make_harness"]

MINI = REPO_ROOT / ".venv-mini" / "bin" / "mini"
OPENCODE = REPO_ROOT / ".tools" / "opencode" / "node_modules" / ".bin" / "opencode"
# opencode's permissions and the tools each governs (its `edit` covers every tool that writes files)
OPENCODE_PERMISSIONS = {"edit": ("edit", "write", "patch", "multiedit"), "bash": ("bash",),
                        "webfetch": ("webfetch",), "external_directory": ()}


COMPACT_CONFIG = Path(__file__).with_name("mini_compact.yaml")
MINI_CLIENT = Path(__file__).with_name("mini_client.py")  # importable in the jail as harness_mini_client
OPENCODE_COMPACT = Path(__file__).with_name("opencode_compact.json")


def _agent_config(config: str | None, compact: Path, kind: str) -> Path | None:
    """--agent-config for an agent that reads a file: none or 'full' (its own set-up), 'compact' (the packaged
    file), or a path that must exist."""
    path = compact if config == "compact" else Path(config) if config not in (None, "full") else None
    if path is not None and not path.is_file():
        raise HarnessError(f"--agent-config {config}: no such file (give {kind}, or 'compact' for the packaged "
                           "short prompt)")
    return path


class MiniSweAgent:
    """mini-swe-agent (PyPI), non-interactive, talking litellm's hosted_vllm provider to the session.
    `config`: a YAML file layered over its default mini.yaml (or "compact", the packaged short prompt)."""
    name = "mini-swe-agent"

    def __init__(self, config: str | None = None):
        path = _agent_config(config, COMPACT_CONFIG, "a mini-swe-agent YAML file")
        self.config_text = path.read_text() if path else None

    def check_installed(self) -> None:
        if not MINI.exists():
            raise HarnessError(f"mini-swe-agent is not installed at {MINI}: run `make setup`")

    def prepare(self, run: AgentRun) -> tuple[str, dict[str, str]]:
        command = " ".join([
            shlex.quote(str(MINI)), "-m", shlex.quote(f"hosted_vllm/{run.model}"), "-c", "mini.yaml",
            "-c", shlex.quote(f"model.model_kwargs.api_base={run.base_url}"),
            "-c", shlex.quote(f"model.model_kwargs.api_key={run.api_key}"),
            *(["-c", "/logs/agent/config.yaml"] if self.config_text else []),
            "-c", f"agent.step_limit={run.step_limit}", "-c", shlex.quote(f"environment.cwd={run.workdir}"),
            "-y", "--exit-immediately", "-t", '"$HARNESS_TASK"', "-o", "/logs/agent/traj.json", "</dev/null"])
        env = {"HARNESS_TASK": run.instruction, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
               "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_GLOBAL_CONFIG_DIR": "/home/.mini",
               "MSWEA_CONFIGURED": "true", "OPENAI_API_KEY": run.api_key,
               "HARNESS_MINI_CLIENT": MINI_CLIENT.read_text(), "PYTHONPATH": "/home/.harness"}
        setup = ("mkdir -p /logs/agent /home/.harness && "
                 "printf '%s' \"$HARNESS_MINI_CLIENT\" > /home/.harness/harness_mini_client.py && ")
        if self.config_text:
            env["HARNESS_MINI_CONFIG"] = self.config_text
            setup += "printf '%s' \"$HARNESS_MINI_CONFIG\" > /logs/agent/config.yaml && "
        return setup + command, env

    def collect(self, sandbox: Sandbox, result: ExecResult) -> AgentReport:
        text = read_file(sandbox, "/logs/agent/traj.json")
        if not text:
            return AgentReport(exit_status="no trajectory")
        traj = json.loads(text)
        report = AgentReport(exit_status=str(traj.get("info", {}).get("exit_status", "")))
        for message in traj.get("messages", []):
            role = message.get("role")
            if role == "exit":
                continue
            report.completion.append({k: message[k] for k in ("role", "content", "tool_calls", "tool_call_id")
                                      if k in message})
            for call in message.get("tool_calls") or []:
                name = (call.get("function") or {}).get("name", "?")
                report.tool_calls_by_name[name] = report.tool_calls_by_name.get(name, 0) + 1
            extra = message.get("extra") or {}
            if role == "tool" and (extra.get("returncode") not in (0, None) or extra.get("exception_info")):
                report.tool_failure_count += 1
            if extra.get("interrupt_type") == "FormatError":  # no/unparseable tool call, or cut off
                report.invalid_tool_calls += 1
        return report


class OpenCode:
    """opencode (npm opencode-ai): an @ai-sdk/openai-compatible provider pointed at the session; the title
    (small) model is routed to the same session, so its call is captured and marked auxiliary.
    `config`: an opencode.json merged under the generated one (its agents, tools, permissions; the provider
    and model stay the session's), or "compact": the packaged short prompt with the bash tool only."""
    name = "opencode"

    def __init__(self, config: str | None = None):
        path = _agent_config(config, OPENCODE_COMPACT, "an opencode.json file")
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
                report.tool_calls_by_name[name] = report.tool_calls_by_name.get(name, 0) + 1
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


def _command(command: str | None, config: str | None) -> Harness:
    if not command:
        raise HarnessError("--harness command needs --agent-command 'TEMPLATE with {instruction}'")
    return CommandHarness(command)


# name -> make(agent_command, agent_config), as mini-swe-agent maps its environments: a new agent is its harness
# class (the Harness protocol, base.py) and one entry here. CONFIGURED: the ones that read --agent-config.
HARNESSES: dict[str, Callable[[str | None, str | None], Harness]] = {
    "mini-swe-agent": lambda command, config: MiniSweAgent(config),
    "opencode": lambda command, config: OpenCode(config),
    "claude-code": lambda command, config: ClaudeCode(config),
    "codex": lambda command, config: Codex(),
    "cline": lambda command, config: Cline(),
    "gemini-cli": lambda command, config: GeminiCli(config),
    "qwen-code": lambda command, config: QwenCode(config),
    "aider": lambda command, config: Aider(),
    "terminus-2": lambda command, config: Terminus2(),
    "command": _command,
}
CONFIGURED = ("mini-swe-agent", "opencode", "claude-code", "gemini-cli", "qwen-code")
# the ones whose own tools refuse to edit a file not read this session (the oracle reads it first, oracle.py)
READ_BEFORE_EDIT = ("qwen-code",)
# the ones with no tools, whose model edits files in the agent's own format (the oracle writes those edits)
FILE_EDITS = ("aider",)
# the ones with no tools whose model answers in the agent's own JSON of keystrokes (the oracle types the solution)
KEYSTROKES = ("terminus-2",)


def make_harness(name: str, command: str | None = None, config: str | None = None) -> Harness:
    if name not in HARNESSES:
        names = list(HARNESSES)
        raise HarnessError(f"unknown harness '{name}': choose {', '.join(names[:-1])} or {names[-1]}")
    if config and name not in CONFIGURED:
        raise HarnessError(f"--agent-config is read by the {', '.join(CONFIGURED[:-1])} and {CONFIGURED[-1]} "
                           f"harnesses, not by {name}")
    return HARNESSES[name](command, config)
