"""The tests' few-line agent: one model call through its capture session, the answer written to /app/answer.txt,
and the task whose reward depends only on what the model said (1 when the answer starts with a digit). A real
program in a real sandbox through the real proxy: only the agent's logic is this small."""

from __future__ import annotations

import shlex
import textwrap
from pathlib import Path

from harness_trainer.agents.command import CommandHarness

SAY = textwrap.dedent("""
    import json, os, sys, urllib.request
    if "fail" in sys.argv[1]:
        sys.exit(127)  # an agent that cannot start
    body = {"model": os.environ["OPENAI_MODEL"], "max_tokens": 4,
            "messages": [{"role": "user", "content": sys.argv[1]}]}
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", json.dumps(body).encode(),
                                 {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                  "Content-Type": "application/json"})
    answer = json.load(urllib.request.urlopen(req))["choices"][0]["message"]["content"] or ""
    open("/app/answer.txt", "w").write(answer)
""")
SAY_HARNESS = CommandHarness(f"python3 -c {shlex.quote(SAY)} {{instruction}}")
# An agent that, told to be slow, never ends by itself after its one call (its task's timeout is an hour): a test
# whose run ends proves it was stopped, whatever the machine's speed (a 120 s sleep under a 60 s timeout raced the
# step). It calls the model first: a sync stops a rollout by the version of its oldest turn, and one with no turn
# yet goes on (rollouts/pool.py: cancel_stale).
NEVER_ENDING_WHEN_SLOW = CommandHarness(f"python3 -c {shlex.quote(SAY)} {{instruction}}; "
                                        f"case {{instruction}} in *slow*) sleep 3600;; esac")


def say_task(root: Path, name: str = "say", instruction: str = "Say something.", agent_timeout_s: int = 60) -> Path:
    """A task whose reward depends only on what the model says: 1 when its answer starts with a digit."""
    task = root / name
    (task / "tests").mkdir(parents=True, exist_ok=True)
    (task / "instruction.md").write_text(instruction + "\n")
    (task / "task.toml").write_text(f"[agent]\ntimeout_sec = {agent_timeout_s}\n[verifier]\ntimeout_sec = 30\n")
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\n"
        "python3 -c \"t = open('/app/answer.txt').read(); print(1.0 if t[:1].isdigit() else 0.0)\" "
        "> /logs/verifier/reward.txt\n")
    return task
