"""Builtin task sets, written out as ordinary Harbor task folders (cached) so one reader serves them all.

  toy      "Write the word W into the file F.": short, deterministic, learnable by the tiny model.
           `builtin:toy-train` (48 tasks) and `builtin:toy-heldout` (16 (word, file) pairs never seen together
           in training).
  bugfix   small real Python bug fixes (off-by-one, wrong operator, missing case, ...) with test scripts,
           for real models.
  logs     one long task: read 24 log files, then count their ERROR lines into a file. Its solution runs one
           command per turn (`oracle = "per-line"`), so the oracle drives an agent through 26 turns whose
           tool outputs grow the context past 30k tokens: traces at the size real agents produce.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from harness_trainer.models.tiny import cache_root

# The toy set: "Write the word W into the file F." for 8 words x 8 files. The held-out split is 16 (word, file)
# pairs never seen together in training (a Latin-square pattern: every word and every file appears in training
# 6 times, and twice in held-out), so solving it means reading both from the instruction, not recalling a task.
# A tiny random model cannot copy text it never produced, which is why held-out pairs reuse seen words/files.
# Every word and every file stem is one token of the embedded tokenizer (with its leading space), so all
# instructions have the same length and the model learns to copy two tokens rather than token runs of varying
# length (with multi-token names, "cloud" = c+lo+u+d, it learned the word and guessed the file).
WORDS = ["cookie", "month", "letter", "table", "pipe", "space", "zero", "week"]
FILES = ["data.txt", "output.txt", "result.txt", "config.txt", "index.txt", "memo.txt", "info.txt", "record.txt"]
PAIRS = [(w, f) for w in range(8) for f in range(8)]
HELDOUT = [(w, (w + k) % 8) for w in range(8) for k in (0, 4)]
TOY_TRAIN = [(WORDS[w], FILES[f]) for w, f in PAIRS if (w, f) not in HELDOUT]
TOY_HELDOUT = [(WORDS[w], FILES[f]) for w, f in HELDOUT]

TOY_TEST = """#!/bin/bash
# Reward 1 when /app/{file} holds exactly the word, else 0.
mkdir -p /logs/verifier
if [ "$(cat /app/{file} 2>/dev/null | tr -d '[:space:]')" = "{word}" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""

# name: (file, buggy source, calls the test makes, what they must return (repr), the fix, the instruction)
BUGS = {
    "sum-to-n": ("mathx.py", "def sum_to(n):\n    \"\"\"1 + 2 + ... + n\"\"\"\n    return sum(range(n))\n",
                 "mathx.sum_to(1), mathx.sum_to(4), mathx.sum_to(0)", "[1, 10, 0]",
                 "s/range(n)/range(n + 1)/", "sum_to(n) should return 1 + 2 + ... + n but is off by one."),
    "is-even": ("parity.py", "def is_even(n):\n    return n % 2 == 1\n",
                "parity.is_even(4), parity.is_even(3), parity.is_even(0)", "[True, False, True]",
                "s/== 1/== 0/", "is_even(n) returns the wrong answer for every number."),
    "clamp": ("clamp.py", "def clamp(x, lo, hi):\n    return max(lo, min(x, lo))\n",
              "clamp.clamp(5, 0, 3), clamp.clamp(-1, 0, 3), clamp.clamp(2, 0, 3)", "[3, 0, 2]",
              "s/min(x, lo)/min(x, hi)/", "clamp(x, lo, hi) ignores its upper bound."),
    "greet": ("greet.py", "def greet(name):\n    return 'Hello ' + name\n",
              "greet.greet('Ada')", "['Hello, Ada!']",
              "s/'Hello ' + name/'Hello, ' + name + '!'/", "greet('Ada') must return 'Hello, Ada!'."),
    "last-item": ("items.py", "def last(items):\n    return items[len(items)]\n",
                  "items.last([1, 2, 3]), items.last(['a'])", "[3, 'a']",
                  "s/items\\[len(items)\\]/items[-1]/",
                  "last(items) raises IndexError instead of returning the last item."),
}

# The agent's code runs inside the check, so the check's exit status is the agent's to forge (an atexit hook
# that calls os._exit(0) passes any assert). The verdict is therefore taken outside that process: the check only
# prints what the calls return, and bash compares it with what they must return, which the agent never saw.
BUG_TEST = """#!/bin/bash
# Reward 1 when the calls, run against the agent's /app, return what they must, else 0.
mkdir -p /logs/verifier
got=$(cd /app && python3 -c "import {module}; print(repr([{calls}]))" 2>/logs/verifier/stderr.txt)
if [ "$got" = "{expected}" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _toy(root: Path, pairs: list[tuple[str, str]], split: str) -> None:
    for i, (word, file) in enumerate(pairs):
        task = root / f"toy-{split}-{i:03d}-{word}-{file.removesuffix('.txt')}"
        _write(task / "instruction.md", f"Write the word {word} into the file {file}.\n")
        _write(task / "task.toml", f'[agent]\ntimeout_sec = 120\n\n[verifier]\ntimeout_sec = 30\n\n'
                                   f'[metadata]\nset = "toy"\nsplit = "{split}"\nword = "{word}"\nfile = "{file}"\n'
                                   'oracle = "inline"\n')
        _write(task / "environment" / "app" / ".keep", "")
        _write(task / "tests" / "test.sh", TOY_TEST.format(word=word, file=file), 0o755)
        _write(task / "solution" / "solve.sh", f"#!/bin/bash\necho {word} > {file}\n", 0o755)


def _bugfix(root: Path) -> None:
    for name, (filename, source, calls, expected, sed, instruction) in BUGS.items():
        task = root / f"bugfix-{name}"
        module = filename.removesuffix(".py")
        _write(task / "instruction.md", f"In /app/{filename}: {instruction} Fix the bug.\n")
        _write(task / "task.toml", '[agent]\ntimeout_sec = 300\n\n[verifier]\ntimeout_sec = 60\n\n'
                                   '[metadata]\nset = "bugfix"\noracle = "inline"\n')
        _write(task / "environment" / "app" / filename, source)
        _write(task / "tests" / "test.sh", BUG_TEST.format(module=module, calls=calls, expected=expected), 0o755)
        _write(task / "solution" / "solve.sh", f"#!/bin/bash\nsed -i \"{sed}\" {filename}\n", 0o755)


LOG_FILES, LOG_LINES = 24, 27
LOG_TEST = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(tr -d ' \\n' < /app/count.txt 2>/dev/null)" = "{count}" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""


def _logs(root: Path) -> None:
    task, errors, steps = root / "logs-errors", 0, []
    levels = ["INFO", "INFO", "DEBUG", "WARN", "INFO", "ERROR", "INFO"]
    for f in range(1, LOG_FILES + 1):
        lines = []
        for k in range(LOG_LINES):
            level = levels[(f * 7 + k * 3) % len(levels)]
            errors += level == "ERROR"
            lines.append(f"2026-11-{f:02d} 10:{k:02d}:{(f * k) % 60:02d} {level} worker-{(f + k) % 5} "
                         f"request {f * 100 + k} took {(f * 37 + k * 11) % 900} ms")
        _write(task / "environment" / "app" / "logs" / f"part-{f:02d}.log", "\n".join(lines) + "\n")
        steps.append(f"cat logs/part-{f:02d}.log")
    steps.append("grep -h ERROR logs/*.log | wc -l > count.txt")
    _write(task / "instruction.md", "Read every file logs/part-01.log to logs/part-24.log, one at a time, then "
                                    "write the number of lines that contain ERROR into count.txt.\n")
    _write(task / "task.toml", '[agent]\ntimeout_sec = 900\n\n[verifier]\ntimeout_sec = 30\n\n'
                               '[metadata]\nset = "logs"\noracle = "per-line"\n')
    _write(task / "tests" / "test.sh", LOG_TEST.format(count=errors), 0o755)
    _write(task / "solution" / "solve.sh", "#!/bin/bash\n" + "\n".join(steps) + "\n", 0o755)


SETS = {
    "toy": lambda root: (_toy(root, TOY_TRAIN, "train"), _toy(root, TOY_HELDOUT, "heldout")),
    "toy-train": lambda root: _toy(root, TOY_TRAIN, "train"),
    "toy-heldout": lambda root: _toy(root, TOY_HELDOUT, "heldout"),
    "bugfix": _bugfix,
    "logs": _logs,
}


def builtin_dataset(name: str) -> Path:
    """The folder of builtin set `name`, written once into the cache (content-addressed by this file)."""
    if name not in SETS:  # rollouts/tasks.py checks first, with the message a user sees
        raise KeyError(name)
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    folder = cache_root() / "datasets" / f"{name}-{digest}"
    if not folder.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent))
        SETS[name](staging)
        try:
            staging.rename(folder)
        except OSError:  # a concurrent writer won; both wrote the same
            shutil.rmtree(staging, ignore_errors=True)
    return folder
