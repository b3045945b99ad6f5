"""Harbor tasks, read natively.

A task is a folder:
    task.toml          [agent] timeout_sec, [verifier] timeout_sec, [metadata] ... (all optional)
    instruction.md     what the agent is told
    environment/       the starting state; files in environment/app/ (or, without it, every file but the
                       Dockerfile) are copied into the sandbox's /app
    tests/test.sh      the verifier: writes /logs/verifier/reward.txt (one number) or reward.json
    solution/solve.sh  optional: a known solution (the oracle policy replays it)

Datasets: a local folder of task folders (or one task folder), `builtin:NAME` (shipped with the package),
`hf:OWNER/NAME` (a Hugging Face dataset repo of Harbor tasks, from the local Hub cache: the Hub is not
reachable offline), or a Harbor registry name `NAME@VERSION` (needs the network).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from harness_trainer.rollouts.builtin import SETS, builtin_dataset


class TaskError(ValueError):
    """A task or dataset could not be read; the message names the file and field and what to do."""


@dataclass(frozen=True)
class Task:
    name: str
    path: Path
    instruction: str
    agent_timeout_s: float = 600.0
    verifier_timeout_s: float = 120.0
    metadata: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution(self) -> Path | None:
        solve = self.path / "solution" / "solve.sh"
        return solve if solve.is_file() else None

    def app_files(self) -> Path | None:
        env = self.path / "environment"
        if (env / "app").is_dir():
            return env / "app"
        return env if env.is_dir() else None


def _number(table: dict, key: str, where: str, default: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise TaskError(f"{where}: '{key}' must be a positive number of seconds, not {value!r}")
    return float(value)


def load_task(path: str | Path) -> Task:
    path = Path(path)
    toml_path, instruction_path = path / "task.toml", path / "instruction.md"
    if not instruction_path.is_file():
        raise TaskError(f"{path} is not a Harbor task: it has no instruction.md")
    if not (path / "tests" / "test.sh").is_file():
        raise TaskError(f"{path} has no tests/test.sh: every task needs a verifier that writes "
                        "/logs/verifier/reward.txt or reward.json")
    config = {}
    if toml_path.is_file():
        try:
            config = tomllib.loads(toml_path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise TaskError(f"{toml_path}: not valid TOML ({exc}); fix the file") from None
    for section in ("agent", "verifier", "metadata"):
        if section in config and not isinstance(config[section], dict):
            raise TaskError(f"{toml_path}: [{section}] must be a table")
    agent, verifier = config.get("agent", {}), config.get("verifier", {})
    return Task(
        name=path.name, path=path.resolve(), instruction=instruction_path.read_text(encoding="utf-8").strip(),
        agent_timeout_s=_number(agent, "timeout_sec", f"{toml_path} [agent]", 600.0),
        verifier_timeout_s=_number(verifier, "timeout_sec", f"{toml_path} [verifier]", 120.0),
        metadata=dict(config.get("metadata", {})))


def _tasks_in(folder: Path) -> list[Task]:
    if (folder / "instruction.md").is_file():
        return [load_task(folder)]
    tasks = [load_task(p) for p in sorted(folder.iterdir()) if p.is_dir() and (p / "instruction.md").is_file()]
    if not tasks:
        raise TaskError(f"{folder} holds no Harbor tasks (folders with instruction.md and tests/test.sh)")
    return tasks


def load_dataset(spec: str) -> list[Task]:
    """Resolve a dataset spec to its tasks; see the module docstring for the forms."""
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in SETS:
            raise TaskError(f"no builtin dataset '{name}': choose one of {_builtin_names()}")
        return _tasks_in(builtin_dataset(name))
    if spec.startswith("hf:"):
        repo = spec.removeprefix("hf:")
        try:
            from huggingface_hub import snapshot_download
            from huggingface_hub.errors import LocalEntryNotFoundError
        except ImportError:
            raise TaskError("hf: datasets need huggingface_hub (pip install huggingface_hub)") from None
        try:
            folder = snapshot_download(repo, repo_type="dataset",
                                       local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1")
        except LocalEntryNotFoundError:
            raise TaskError(f"dataset {repo} is not in the local Hugging Face cache and the Hub is offline "
                            "(HF_HUB_OFFLINE=1): download it where the Hub is reachable, or pass a local folder") from None
        except Exception as exc:
            raise TaskError(f"could not fetch Hugging Face dataset {repo}: {exc}. Check the name and the network, "
                            "or pass a local folder of Harbor tasks") from None
        return _tasks_in(Path(folder))
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise TaskError(f"{path} is a file; a dataset is a folder of Harbor tasks")
        return _tasks_in(path)
    if "@" in spec and "/" not in spec:
        raise TaskError(f"'{spec}' looks like a Harbor registry dataset: resolving it needs the network and the "
                        "harbor package (make setup HARBOR=1). Offline, download it elsewhere and pass the folder")
    raise TaskError(f"unknown dataset '{spec}': give a folder of Harbor tasks, a builtin set ({_builtin_names()}) "
                    "or hf:OWNER/NAME (a Hugging Face dataset of Harbor task folders)")


def _builtin_names() -> str:
    return ", ".join("builtin:" + name for name in SETS)
