"""aider (PyPI aider-chat), unmodified, as Harbor's recipe drives it: the workspace snapshotted into git first
(aider finds files through its repository: an image without git is refused, saying so), then `aider --yes-always --model
openai/M --message TASK --chat-history-file ...`, OPENAI_API_KEY and OPENAI_API_BASE pointed at the capture
session. Its own virtual environment in .tools/aider runs on the Python install that every sandbox mounts.

aider has no tools: it edits files by writing them in its edit format (`whole` for a model it does not know, as
ours is: the whole new file under its path) and never runs a command itself — the shell commands it suggests
are declined under --yes-always, as in Harbor. Unlike Harbor's recipe, auto-commits are off (a commit message
is one more model call, which trains nothing), aider's histories and .gitignore stay out of the workspace, and
its model settings send no temperature (aider sends 0 for a model it does not know, and greedy decoding has no
logprobs to learn from: the run's sampling decides). Its one other request, for litellm's price list, fails at
once in a sandbox with no network.

What it did is read from its chat history: each "Applied edit to F" is an `edit`, an answer it could not apply
(not in its format, or a SEARCH that matched nothing) is a failed one, and a model API error it did not retry
(it retries with back-off for about a minute) is the API failing it.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

from harness_trainer.agents.base import AgentReport, AgentRun, read_file
from harness_trainer.agents.events import EventsHarness
from harness_trainer.paths import TOOLS
from harness_trainer.sandboxes.base import Sandbox

AIDER = TOOLS / "aider" / "bin" / "aider"
HISTORY = "/logs/agent/aider.chat.history.md"
SETTINGS = "/home/.aider.model.settings.yml"
# Without git aider sees none of the workspace's files (it can only make new ones): where Harbor's recipe runs it
# anyway, which scores a task it could not see as a plausible 0, the run is refused (exit 127: unscorable, saying why)
NEEDS_GIT = ("command -v git >/dev/null 2>&1 || { echo 'aider needs git in the image: it finds the task files "
             "through a git repository. Add git to the image, or run an agent with a shell tool' >&2; exit 127; }; ")
# Harbor's: a workspace that is not a repository yet becomes one, so aider can see (and add) its files
SNAPSHOT = ("if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then "
            "{ git init -q && timeout 120 git add -A && git -c user.name=Agent -c user.email=agent@localhost "
            "commit -q --no-verify --allow-empty -m 'Task files before agent run'; } "
            "|| echo 'could not snapshot the workspace for aider' >&2; fi; ")
FLAGS = ("--yes-always --no-auto-commits --no-gitignore --no-check-update --analytics-disable "
         "--no-show-model-warnings --no-show-release-notes --no-pretty --no-fancy-input --no-detect-urls "
         f"--chat-history-file {HISTORY} --input-history-file /logs/agent/aider.input.history")
NOT_APPLIED = ("did not conform to the edit format", "failed to match")
API_ERROR = re.compile(r"^litellm\.\w+Error")


class Aider(EventsHarness):
    name = "aider"
    needs = ""

    def programs(self) -> list[Path | None]:
        return [AIDER]

    def files(self, run: AgentRun) -> dict[str, tuple[str, str]]:
        return {"HARNESS_AIDER_SETTINGS": (SETTINGS, f"- name: {json.dumps(f'openai/{run.model}')}\n"
                                                     "  use_temperature: false\n")}

    def environment(self, run: AgentRun) -> dict[str, str]:
        return {"OPENAI_API_KEY": run.api_key, "OPENAI_API_BASE": run.base_url}

    def command(self, run: AgentRun) -> str:
        return (f"{NEEDS_GIT}{SNAPSHOT}{shlex.quote(str(AIDER))} {FLAGS} --model-settings-file {SETTINGS} "
                f"--model {shlex.quote(f'openai/{run.model}')} --message \"$HARNESS_TASK\" "
                "</dev/null >/logs/agent/aider.txt 2>&1")

    def read(self, events: Iterator[dict], report: AgentReport, sandbox: Sandbox) -> None:
        """Its chat history, not an events file: aider's notes (lines starting >) say what was applied, what
        failed and which API errors were retried; the rest is what the model said."""
        errors, retries, last_error = 0, 0, ""
        said: list[str] = []
        for line in (read_file(sandbox, HISTORY) or "").splitlines():
            note = line[1:].strip() if line.startswith(">") else None
            if note is None:  # aider's own answer text (its user's lines start with ####)
                if not line.startswith("#### ") and not line.startswith("# aider chat started"):
                    said.append(line)
                continue
            _flush(report, said)
            if note.startswith("Applied edit to "):
                report.called("edit")
            elif any(text in note for text in NOT_APPLIED):
                report.tool_failure_count += 1
                report.invalid_tool_calls += "did not conform" in note
            elif API_ERROR.match(note):
                errors += 1
                last_error = note
            elif note.startswith("Retrying in "):
                retries += 1
        _flush(report, said)
        if errors > retries:  # its last error was not retried: the model API failed the run
            report.failure = f"aider: {last_error[:300]}"
            report.exit_status += f"; aider error: {last_error[:300]}"


def _flush(report: AgentReport, said: list[str]) -> None:
    text = "\n".join(said).strip()
    if text:
        report.completion.append({"role": "assistant", "content": text})
    said.clear()
