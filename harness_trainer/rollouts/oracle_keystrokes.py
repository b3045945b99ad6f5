"""The oracle's answers for an agent whose model types into a terminal (terminus-2): its JSON of keystrokes.

terminus-2 offers no tools. Its model answers `{"analysis", "plan", "commands": [{"keystrokes", "duration"}],
"task_complete"}`; each command's keystrokes are typed into a tmux pane, and after `duration` seconds (not when
the command ends) the pane's new output is the next prompt. So the oracle types `set +H` and then one solution
step at a time, waits while the pane shows no shell prompt after it (the command still runs), and marks the task
complete once every step has run (terminus-2 asks to confirm: the same answer again). The slip
(`plausible_mistake`) is made on the last step as for every other agent.
"""

from __future__ import annotations

import json
from collections.abc import Callable

WAIT_S = 5.0  # a wait's duration: terminus-2's own advice is to poll rather than wait long
# Typed lines run in an interactive bash, where `!` in double quotes is history expansion (a script has it off):
# the careful typist turns it off first, so each step runs as the solution's script would run it.
NO_HISTORY = "set +H"
CONFIRM = "Are you sure you want to mark the task as complete?"  # what terminus-2 asks after the pane's output


def answer(plan: str, commands: list[dict], complete: bool) -> str:
    return json.dumps({"analysis": "The terminal shows where the task stands.", "plan": plan,
                       "commands": commands, "task_complete": complete})


def typed(messages: list[dict]) -> list[str]:
    """The keystrokes the model has sent so far (each without its final newline), from its earlier answers."""
    sent = []
    for message in messages:
        if message.get("role") != "assistant" or not isinstance(message.get("content"), str):
            continue
        try:
            parsed = json.loads(message["content"])
        except ValueError:
            continue
        for command in parsed.get("commands") or [] if isinstance(parsed, dict) else []:
            keys = command.get("keystrokes") if isinstance(command, dict) else None
            if isinstance(keys, str) and keys.strip():
                sent.append(keys.removesuffix("\n"))
    return sent


def at_prompt(messages: list[dict]) -> bool:
    """Whether the pane's latest output ends at a shell prompt (`user@host:/app#`, `$`): the last command ended."""
    last = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
    lines = [line.rstrip() for line in str(last or "").split(CONFIRM)[0].splitlines() if line.strip()]
    return bool(lines) and lines[-1].endswith(("#", "$"))


def keystrokes_answer(messages: list[dict], steps: list[str], slips: Callable[[str], bool],
                      mistake: Callable[[str], str]) -> str:
    """The next answer: wait for a running step, type the next one, or mark the task complete."""
    done = typed(messages)
    todo = [s for s in [NO_HISTORY, *steps] if s not in done and mistake(s) not in done]
    if done and not at_prompt(messages):
        return answer("Wait for the command to finish.", [{"keystrokes": "", "duration": WAIT_S}], False)
    if not todo:
        return answer("The task is done.", [], True)
    step = mistake(todo[0]) if todo[0] == steps[-1] and slips(todo[0]) else todo[0]
    return answer("Run the next command.", [{"keystrokes": step + "\n", "duration": 1.0}], False)
