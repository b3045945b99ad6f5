"""The harnesses by name (`--harness`): how each unmodified agent program is made (the contract: base.py), and
what the oracle needs to know of each to answer in its format.
"""

from __future__ import annotations

from collections.abc import Callable

from harness_trainer._exceptions import HarnessError
from harness_trainer.agents.aider import Aider
from harness_trainer.agents.base import Harness
from harness_trainer.agents.claude_code import ClaudeCode
from harness_trainer.agents.cline import Cline
from harness_trainer.agents.codex import Codex
from harness_trainer.agents.command import command_harness
from harness_trainer.agents.gemini_cli import GeminiCli
from harness_trainer.agents.mini_swe_agent import MiniSweAgent
from harness_trainer.agents.opencode import OpenCode
from harness_trainer.agents.qwen_code import QwenCode
from harness_trainer.agents.terminus import Terminus2
from harness_trainer.choices import choose

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
    "command": command_harness,
}
CONFIGURED = ("mini-swe-agent", "opencode", "claude-code", "gemini-cli", "qwen-code")
# the ones whose own tools refuse to edit a file not read this session (the oracle reads it first, oracle.py)
READ_BEFORE_EDIT = ("qwen-code",)
# the ones with no tools, whose model edits files in the agent's own format (the oracle writes those edits)
FILE_EDITS = ("aider",)
# the ones with no tools whose model answers in the agent's own JSON of keystrokes (the oracle types the solution)
KEYSTROKES = ("terminus-2",)


def make_harness(name: str, command: str | None = None, config: str | None = None) -> Harness:
    choose("harness", name, HARNESSES, HarnessError)
    if config and name not in CONFIGURED:
        raise HarnessError(f"--agent-config is read by the {', '.join(CONFIGURED[:-1])} and {CONFIGURED[-1]} "
                           f"harnesses, not by {name}")
    return HARNESSES[name](command, config)
