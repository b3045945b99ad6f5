"""task.toml's values, read and checked as Harbor means them: seconds, sizes, `env` tables with their ${VAR}
templates resolved from this host (tasks.py and steps.py read the tables with these; warnings said once per
process are sandboxes/images.py's warn_once)."""

from __future__ import annotations

import os
import re

_TEMPLATE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def resolve_env(table, where: str, problems: list[str]) -> dict[str, str]:
    """An `env` table with Harbor's templates resolved from this host: `${VAR}` must be set here, `${VAR:-d}`
    falls back to d. A missing variable is a problem that names it."""
    if table is None:
        return {}
    if not isinstance(table, dict):
        problems.append(f"{where}: 'env' must be a table of NAME = \"value\"")
        return {}
    resolved = {}
    for key, value in table.items():
        if not isinstance(value, (str, int, float, bool)):
            problems.append(f"{where}: env.{key} must be a string")
            continue

        def substitute(match: re.Match, key=key) -> str:
            name, default = match.group(1), match.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            problems.append(f"{where}: env.{key} needs ${{{name}}}, which is not set on this host: export it, or "
                            f"write ${{{name}:-default}}")
            return ""
        resolved[str(key)] = _TEMPLATE.sub(substitute, str(value).lower() if isinstance(value, bool) else str(value))
    return resolved


def seconds(table: dict, key: str, where: str, default: float | None, problems: list[str]) -> float | None:
    value = table.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        problems.append(f"{where}: '{key}' must be a positive number of seconds, not {value!r}")
        return default
    return float(value)


def size_mb(value, key: str, where: str, problems: list[str]) -> int | None:
    """memory_mb / storage_mb, or the deprecated memory / storage = "4G" forms."""
    if value is None:
        return None
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9.]+)\s*([GMK])B?\s*", value.upper())
        if not match:
            problems.append(f"{where}: '{key}' = {value!r} is not a size like '4G' or '512M'")
            return None
        return int(float(match.group(1)) * {"G": 1024, "M": 1, "K": 1 / 1024}[match.group(2)])
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        problems.append(f"{where}: '{key}' must be a positive number of megabytes, not {value!r}")
        return None
    return int(value)
