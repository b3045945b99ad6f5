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
from collections.abc import Iterator
from pathlib import Path

from harness_trainer.agents.base import AgentReport, AgentRun
from harness_trainer.agents.events import EVENTS, EventsHarness, platform_binary
from harness_trainer.paths import TOOLS
from harness_trainer.sandboxes.base import Sandbox

CLINE_PACKAGES = TOOLS / "cline" / "node_modules" / "@cline"
KEY_VARIABLE = "HARNESS_CAPTURE_KEY"
UNKNOWN_TOOL = "NoSuchToolError"  # in its answer to a call of a tool it does not have
# A run starts a "hub" daemon in a session of its own that outlives it (12 minutes and counting, alone on a host);
# it is stopped when the run ends, found through /proc since an image may have no pkill.
STOP_HUB = ("for p in /proc/[0-9]*; do case \"$(tr '\\0' ' ' <$p/cmdline 2>/dev/null)\" in "
            "*--cline-hub-daemon*) kill -9 ${p#/proc/} 2>/dev/null;; esac; done")


def cline_binary() -> Path | None:
    return platform_binary(CLINE_PACKAGES, "cli-linux-*/bin/cline")


class Cline(EventsHarness):
    name = "cline"

    def programs(self) -> list[Path | None]:
        return [cline_binary()]

    def environment(self, run: AgentRun) -> dict[str, str]:
        return {KEY_VARIABLE: run.api_key}

    def command(self, run: AgentRun) -> str:
        cline, model = shlex.quote(str(cline_binary())), shlex.quote(run.model)
        return (f"{cline} auth -p openai -k \"${KEY_VARIABLE}\" -m {model} "
                f"-b {shlex.quote(run.base_url)} >/logs/agent/auth.log 2>&1 && "
                f"{{ {cline} --json -m {model} -- \"$HARNESS_TASK\" </dev/null >{EVENTS}; "
                f"code=$?; {STOP_HUB}; exit $code; }}")

    def read(self, events: Iterator[dict], report: AgentReport, sandbox: Sandbox) -> None:
        errors = []
        for event in events:
            inner = event.get("event") if isinstance(event.get("event"), dict) else {}
            kind, content = inner.get("type"), inner.get("contentType")
            if kind == "content_start" and content == "tool":
                report.called(inner.get("toolName") or "?")
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
