"""Where the project's own installs are: the repository, and the environments `make setup` makes in it (the
engine's, the proxy's, mini-swe-agent's, Harbor's, and the npm/pip agents under .tools)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOLS = REPO_ROOT / ".tools"


def venv_python(name: str) -> Path:
    """The Python of the project's `.venv-NAME` environment (engine, proxy, mini, harbor)."""
    return REPO_ROOT / f".venv-{name}" / "bin" / "python"
