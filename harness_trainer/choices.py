"""A setting with a fixed set of values, refused in one wording wherever it is read: "WHAT VALUE: choose a, b or c".

The values are declared once, beside their field (`option(..., choices=NAMES)`, rollouts/config.py): the same
tuple feeds the config's check, its message and the flag's help (commands/flags.py adds what the help leaves out).
"""

from __future__ import annotations

from collections.abc import Iterable

from harness_trainer._exceptions import ConfigError


def one_of(allowed: Iterable) -> str:
    """'a, b or c'."""
    names = [str(a) for a in allowed]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def refused(what: str, value, allowed: Iterable, hint: str = "") -> str:
    """The message: `what` names the setting as its user wrote it (a flag, '--loss-type'; a task.toml field; a
    registry's kind), `hint` says more of what is accepted."""
    return f"{what} {value!r}: choose {one_of(allowed)}{hint}"


def choose(what: str, value, allowed: Iterable, error: type[Exception] = ConfigError, hint: str = "") -> None:
    """Refuse `value` unless it is one of `allowed`, with the `refused` message."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise error(refused(what, value, allowed, hint))


def flag(name: str) -> str:
    """A config field's flag: loss_type -> --loss-type."""
    return "--" + name.replace("_", "-")
