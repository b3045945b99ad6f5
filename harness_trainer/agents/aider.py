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

from harness_trainer._exceptions import HarnessError
from harness_trainer.agents.base import AgentReport, AgentRun, read_file
from harness_trainer.agents.sandbox import REPO_ROOT, ExecResult, Sandbox

AIDER = REPO_ROOT / ".tools" / "aider" / "bin" / "aider"
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


class Aider:
    name = "aider"

    def check_installed(self) -> None:
        if not AIDER.exists():
            raise HarnessError(f"aider is not installed ({AIDER} is missing): run `make setup`")

    def prepare(self, run: AgentRun) -> tuple[str, dict[str, str]]:
        model = f"openai/{run.model}"
        env = {"HOME": "/home", "PWD": run.workdir, "HARNESS_TASK": run.instruction, "NO_COLOR": "1",
               "OPENAI_API_KEY": run.api_key, "OPENAI_API_BASE": run.base_url,
               "HARNESS_AIDER_SETTINGS": f"- name: {json.dumps(model)}\n  use_temperature: false\n"}
        command = (f"{NEEDS_GIT}mkdir -p /logs/agent && printf '%s' \"$HARNESS_AIDER_SETTINGS\" > {SETTINGS} && "
                   f"{SNAPSHOT}{shlex.quote(str(AIDER))} {FLAGS} --model-settings-file {SETTINGS} "
                   f"--model {shlex.quote(model)} --message \"$HARNESS_TASK\" </dev/null >/logs/agent/aider.txt 2>&1")
        return command, env

    def collect(self, sandbox: Sandbox, result: ExecResult) -> AgentReport:
        report = AgentReport(exit_status=f"exit {result.returncode}")
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
                report.tool_calls_by_name["edit"] = report.tool_calls_by_name.get("edit", 0) + 1
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
        return report


def _flush(report: AgentReport, said: list[str]) -> None:
    text = "\n".join(said).strip()
    if text:
        report.completion.append({"role": "assistant", "content": text})
    said.clear()
