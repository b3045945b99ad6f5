"""The oracle's answer for an agent with no tools whose model edits files in the agent's own format (aider): the
solution's commands played as the files they write.

Only commands whose effect is a file's new text can be played so: `echo TEXT > FILE` (the file is TEXT and a
newline) and `sed -i 's/OLD/NEW/[g]' FILE` with OLD and NEW literal (each line's first OLD, or every one, becomes
NEW). A dataset whose solutions hold anything else is refused before any rollout (`check`), not played as 0.

An edit of a file that exists needs its text, which the agent shows once the file is in its chat: until then the
answer names the files (aider adds a file its model mentions), then it writes each whole file (aider's `whole`
format: the path, then the new text fenced) or, where the agent asked for SEARCH/REPLACE blocks (`diff`), the
changed lines. After its edits the oracle says it is done.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from harness_trainer._exceptions import TaskError

BRE_SPECIAL = set("\\.*[]^$")  # OLD with these is a pattern, not text: not played
LISTING = re.compile(r"^(\S+)\n```[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)  # a file as the agent shows it


@dataclass
class Edit:
    path: str
    text: str | None = None  # the file's whole new text (echo), or
    old: str = ""  # ... each line's OLD becomes NEW (sed)
    new: str = ""
    every: bool = False  # sed's g: every OLD on a line, not the first

    def apply(self, current: str) -> str:
        if self.text is not None:
            return self.text
        return "".join(line.replace(self.old, self.new, -1 if self.every else 1)
                       for line in current.splitlines(keepends=True))


def edits_of(step: str) -> list[Edit] | None:
    """The file edits a solution's command (one line or a script) makes, or None when it is not only edits."""
    edits = []
    for line in step.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            words = shlex.split(line)
        except ValueError:
            return None
        if len(words) >= 4 and words[0] == "echo" and words[-2] == ">" and ">" not in words[1:-2]:
            edits.append(Edit(words[-1], text=" ".join(words[1:-2]) + "\n"))
        elif len(words) == 4 and words[:2] == ["sed", "-i"] and (edit := _substitution(words[2], words[3])):
            edits.append(edit)
        else:
            return None
    return edits or None


def _substitution(expression: str, path: str) -> Edit | None:
    if len(expression) < 4 or expression[0] != "s":
        return None
    parts = expression[2:].split(expression[1])
    if len(parts) != 3 or parts[2] not in ("", "g") or not parts[0]:
        return None
    old, new = _literal(parts[0]), parts[1]
    if old is None or set("&\\") & set(new):
        return None
    return Edit(path, old=old, new=new, every=parts[2] == "g")


def _literal(pattern: str) -> str | None:
    """The text a basic regular expression matches when it is only text (`\\[` is a `[`), else None."""
    text, escaped = [], False
    for char in pattern:
        if escaped:  # an escaped special is itself; other escapes (\\( \\1 \\+ ...) are GNU's operators
            if char not in BRE_SPECIAL | {"/"}:
                return None
            text.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char in BRE_SPECIAL:
            return None
        else:
            text.append(char)
    return None if escaped else "".join(text)


def check(solutions: dict[str, list[str]], names: dict[str, str]) -> None:
    """Refuse, naming them, the tasks whose solution cannot be played as file edits."""
    bad = [names[instruction] for instruction, steps in solutions.items()
           if not all(edits_of(step) for step in steps)]
    if bad:
        raise TaskError(f"the oracle plays an agent without tools (aider) as the file edits its solution makes, "
                        f"which needs solutions of `echo TEXT > FILE` and `sed -i 's/OLD/NEW/' FILE` lines "
                        f"(tasks with oracle = \"inline\" or \"per-line\"); not so: {', '.join(sorted(bad)[:10])}"
                        f"{' ...' if len(bad) > 10 else ''}. Run those tasks through an agent with a shell tool.")


def edit_answer(messages: list[dict], instruction: str, steps: list[str]) -> str:
    """What the oracle says next: the files it needs shown, its edits, or that it is done. Its own answers are
    those after the task's instruction (the agent's prompt opens with example answers of its own)."""
    start = next((i for i, m in enumerate(messages) if m.get("role") == "user"
                  and instruction in str(m.get("content"))), len(messages))
    if any("```" in str(m.get("content") or "") for m in messages[start:] if m.get("role") == "assistant"):
        return "Done."
    edits = [edit for step in steps for edit in edits_of(step) or []]
    shown = {}
    for m in messages:
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            shown |= dict(LISTING.findall(m["content"]))  # the latest listing of each file wins
    missing = sorted({e.path for e in edits if e.text is None and e.path not in shown})
    if missing:
        return f"I need to edit {' and '.join(missing)}."
    texts: dict[str, tuple[str, str]] = {}  # path -> (before, after)
    for edit in edits:
        before = texts.get(edit.path, (shown.get(edit.path, ""), shown.get(edit.path, "")))
        texts[edit.path] = (before[0], edit.apply(before[1]))
    blocks = "SEARCH/REPLACE" in "\n".join(str(m.get("content")) for m in messages if m.get("role") != "assistant")
    return "\n".join(_diff(path, *text) if blocks else f"{path}\n```\n{text[1]}```\n" for path, text in texts.items())


def _diff(path: str, before: str, after: str) -> str:
    """SEARCH/REPLACE blocks: the whole old text for a new file's empty one, else each changed line."""
    if not before:
        return f"{path}\n```\n<<<<<<< SEARCH\n=======\n{after}>>>>>>> REPLACE\n```\n"
    pairs = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    return "\n".join(f"{path}\n```\n<<<<<<< SEARCH\n{a}\n=======\n{b}\n>>>>>>> REPLACE\n```\n" for a, b in pairs)
