"""cline (npm cline, its CLI), unmodified: `cline auth -p openai -k KEY -m MODEL -b BASE_URL` names the capture
session as its OpenAI-compatible provider (Harbor's recipe has no base URL to give it; the CLI's own auth command
does), then `cline --json -m MODEL -- TASK` runs the task non-interactively with its tools auto-approved (its
default). Its native binary (Bun inside, glibc only) is run directly, not npm's Node launcher: a task image
needs no Node. It has no turn limit of its own; the session's call budget stops it. The background daemon a run
starts is stopped when it ends.

What it did is read from its --json events: each tool call's start and end (a command that failed says
`success: false`; a call of a tool it does not have is rejected before execution), its text, and its run's
`finishReason: error` with the error event before it when the model API failed it.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from harness_trainer._exceptions import HarnessError
from harness_trainer.agents.base import AgentReport, AgentRun, read_events
from harness_trainer.agents.sandbox import REPO_ROOT, ExecResult, Sandbox

CLINE_PACKAGES = REPO_ROOT / ".tools" / "cline" / "node_modules" / "@cline"
KEY_VARIABLE = "HARNESS_CAPTURE_KEY"
UNKNOWN_TOOL = "NoSuchToolError"  # in its answer to a call of a tool it does not have
# A run starts a "hub" daemon in a session of its own that outlives it (12 minutes and counting, alone on a host);
# it is stopped when the run ends, found through /proc since an image may have no pkill.
STOP_HUB = ("for p in /proc/[0-9]*; do case \"$(tr '\\0' ' ' <$p/cmdline 2>/dev/null)\" in "
            "*--cline-hub-daemon*) kill -9 ${p#/proc/} 2>/dev/null;; esac; done")


def cline_binary() -> Path | None:
    """The platform package's binary, the one npm's `cline` launcher (a Node script) runs."""
    found = sorted(CLINE_PACKAGES.glob("cli-linux-*/bin/cline"))
    return found[0] if found else None


class Cline:
    name = "cline"

    def check_installed(self) -> None:
        if cline_binary() is None:
            raise HarnessError(f"cline is not installed under {CLINE_PACKAGES}: run `make setup` (needs npm)")

    def prepare(self, run: AgentRun) -> tuple[str, dict[str, str]]:
        cline, model = shlex.quote(str(cline_binary())), shlex.quote(run.model)
        env = {"HOME": "/home", "PWD": run.workdir, "HARNESS_TASK": run.instruction, KEY_VARIABLE: run.api_key,
               "NO_COLOR": "1"}
        command = (f"mkdir -p /logs/agent && {cline} auth -p openai -k \"${KEY_VARIABLE}\" -m {model} "
                   f"-b {shlex.quote(run.base_url)} >/logs/agent/auth.log 2>&1 && "
                   f"{{ {cline} --json -m {model} -- \"$HARNESS_TASK\" </dev/null >/logs/agent/events.jsonl; "
                   f"code=$?; {STOP_HUB}; exit $code; }}")
        return command, env

    def collect(self, sandbox: Sandbox, result: ExecResult) -> AgentReport:
        report = AgentReport(exit_status=f"exit {result.returncode}")
        errors = []
        for event in read_events(sandbox):
            inner = event.get("event") if isinstance(event.get("event"), dict) else {}
            kind, content = inner.get("type"), inner.get("contentType")
            if kind == "content_start" and content == "tool":
                name = inner.get("toolName") or "?"
                report.tool_calls_by_name[name] = report.tool_calls_by_name.get(name, 0) + 1
            elif kind == "content_end" and content == "tool":
                output = inner.get("output")
                results = output if isinstance(output, list) else [output]
                if any(isinstance(r, dict) and (r.get("success") is False or r.get("error")) for r in results):
                    report.tool_failure_count += 1
                    report.invalid_tool_calls += UNKNOWN_TOOL in str(output)
            elif kind == "content_end" and content == "text" and inner.get("text"):
                report.completion.append({"role": "assistant", "content": inner["text"]})
            elif kind == "error":
                errors.append(str((inner.get("error") or {}).get("message") or "error"))
            elif event.get("type") == "run_result" and event.get("finishReason") == "error":
                message = (errors[-1] if errors else "the run ended in an error")[:300]
                report.exit_status += f"; cline error: {message}"
                report.failure = f"cline: {message}"
        return report
