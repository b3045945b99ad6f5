"""Harbor tasks, read natively: every field of Harbor's task.toml is honoured, refused with its reason, or
warned about once (docs/rollouts.md has the table).

A task is a folder:
    task.toml          [task] name/description, [agent] timeout_sec, [verifier] timeout_sec/env, [solution] env,
                       [environment] (below), [metadata] ... (all optional)
    instruction.md     what the agent is told
    environment/       Dockerfile: the task's image, built by the container sandbox (sandboxes/containers.py).
                       Without a Dockerfile (or [environment] docker_image) the task needs no build: the files
                       in environment/app/ (or, without it, in environment/) are copied into the sandbox's /app
    tests/test.sh      the verifier: writes /logs/verifier/reward.txt (one number) or reward.json
    solution/solve.sh  optional: a known solution (the oracle policy plays it)

Datasets: a local folder of task folders (or one task folder), `builtin:NAME` (shipped with the package),
`hf:OWNER/NAME` (a Hugging Face dataset repo of Harbor tasks, from the local Hub cache: the Hub is not
reachable offline), or a Harbor registry name `NAME@VERSION` (needs the network). A dataset with bad tasks
is refused with every problem listed, or, with `skip_invalid`, read without them (each named in a warning).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from harness_trainer._exceptions import TaskError
from harness_trainer.choices import choose
from harness_trainer.rollouts.builtin import SETS, builtin_dataset
from harness_trainer.rollouts.steps import Step, read_steps
from harness_trainer.rollouts.task_fields import resolve_env, seconds, size_mb
from harness_trainer.sandboxes.compose import services as compose_services
from harness_trainer.sandboxes.images import ContainerSpec, warn_once


@dataclass(frozen=True)
class Task:
    name: str  # the folder's name: unique in a dataset, the key of every record
    path: Path
    instruction: str
    agent_timeout_s: float = 600.0
    verifier_timeout_s: float = 600.0  # Harbor's default
    metadata: dict = field(default_factory=dict, hash=False, compare=False)
    title: str = ""  # [task] name ("org/name"), when given
    description: str = ""
    environment: ContainerSpec = field(default_factory=ContainerSpec, hash=False, compare=False)
    verifier_env: dict = field(default_factory=dict, hash=False, compare=False)  # resolved templates
    solution_env: dict = field(default_factory=dict, hash=False, compare=False)
    steps: tuple[Step, ...] = ()  # a multi-step task's [[steps]], in order (steps.py); () for a single step
    reward_strategy: str = "mean"  # how a multi-step trial's reward comes from its steps' (steps.py)

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution(self) -> Path | None:
        solve = self.path / "solution" / "solve.sh"
        return solve if solve.is_file() else None

    @property
    def needs_container(self) -> bool:
        """Its environment is an image (a Dockerfile to build, or docker_image): it cannot run on the host."""
        return self.environment.needs_container

    def app_files(self) -> Path | None:
        """What a task without an image starts with in /app; None for a task whose image holds its files."""
        if self.needs_container:
            return None
        env = self.path / "environment"
        if (env / "app").is_dir():
            return env / "app"
        return env if env.is_dir() else None


# ---- task.toml: what each table may hold (anything else is warned about once, never fatal) ----------------
KNOWN = {
    "": {"schema_version", "version", "source", "task", "metadata", "agent", "verifier", "solution",
         "environment", "steps", "artifacts", "multi_step_reward_strategy"},
    "task": {"name", "description", "authors", "keywords", "version"},
    "agent": {"timeout_sec", "user", "network_mode", "allowed_hosts"},
    "verifier": {"timeout_sec", "env", "user", "network_mode", "allowed_hosts"},
    "solution": {"env"},
    "environment": {"build_timeout_sec", "docker_image", "os", "cpus", "memory_mb", "storage_mb", "memory",
                    "storage", "gpus", "gpu_types", "mcp_servers", "env", "skills_dir", "healthcheck", "workdir",
                    "allow_internet", "network_mode", "allowed_hosts"},
}
IGNORED = {  # read by Harbor, not by us: what happens instead
    ("", "artifacts"): "artifacts are not collected (the trial folder keeps /app and /logs)",
    ("environment", "skills_dir"): "skills are not copied into the agent's config",
}





def _network(table: dict, where: str, problems: list[str]) -> bool:
    """allow_internet (Harbor's older key) or network_mode (its newer one) -> whether the trial gets internet."""
    mode = table.get("network_mode")
    if mode is not None:
        if mode == "allowlist":
            problems.append(f"{where}: network_mode = \"allowlist\" is not supported yet (hosts are not "
                            "filtered): use \"public\" or \"no-network\"")
            return False
        if mode not in ("public", "no-network"):
            problems.append(f"{where}: network_mode must be \"public\" or \"no-network\", not {mode!r}")
        return mode == "public"
    allow = table.get("allow_internet", True)
    if not isinstance(allow, bool):
        problems.append(f"{where}: allow_internet must be true or false, not {allow!r}")
        return False
    return allow


def _environment(path: Path, table: dict, where: str, problems: list[str]) -> ContainerSpec:
    dockerfile = path / "environment" / "Dockerfile"
    image = table.get("docker_image")
    if image is not None and not (isinstance(image, str) and image.strip()):
        problems.append(f"{where}: docker_image must be an image name like \"python:3.11-slim\"")
        image = None
    if str(table.get("os", "linux")).lower() != "linux":
        problems.append(f"{where}: os = {table['os']!r}: only linux tasks run here")
    if table.get("gpus"):
        problems.append(f"{where}: gpus = {table['gpus']}: trials with GPUs are not supported yet")
    if table.get("mcp_servers"):
        problems.append(f"{where}: mcp_servers: MCP servers for the agent are not supported yet")
    cpus = table.get("cpus")
    if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus <= 0):
        problems.append(f"{where}: cpus must be a positive number, not {cpus!r}")
        cpus = None
    workdir = table.get("workdir")
    if workdir is not None and not (isinstance(workdir, str) and workdir.startswith("/")):
        problems.append(f"{where}: workdir must be an absolute path, not {workdir!r}")
        workdir = None
    health = table.get("healthcheck")
    if health is not None and not (isinstance(health, dict) and isinstance(health.get("command"), str)):
        problems.append(f"{where}: healthcheck must be a table with a 'command'")
        health = None
    return ContainerSpec(
        context=path / "environment" if dockerfile.is_file() else None, image=image.strip() if image else None,
        compose=_compose(path, bool(image) or dockerfile.is_file(), problems),
        workdir=workdir, cpus=float(cpus) if cpus else None,
        memory_mb=size_mb(table.get("memory_mb", table.get("memory")), "memory_mb", where, problems),
        storage_mb=size_mb(table.get("storage_mb", table.get("storage")), "storage_mb", where, problems),
        build_timeout_s=seconds(table, "build_timeout_sec", where, 600.0, problems),
        allow_internet=_network(table, where, problems), env=resolve_env(table.get("env"), where, problems),
        healthcheck=dict(health) if health else None)


def _compose(path: Path, has_image: bool, problems: list[str]) -> Path | None:
    """environment/docker-compose.yaml (Harbor's name for it), checked; its services run beside the trial's."""
    found = path / "environment" / "docker-compose.yaml"
    if not found.is_file():
        return None
    problems += compose_services(found)[1]
    if not has_image:
        problems.append(f"{found}: the trial's own service (main) needs an environment/Dockerfile or a docker_image")
    return found.resolve()


def _phase_networks(config: dict, environment: ContainerSpec, toml_path: Path, problems: list[str]) -> None:
    """[agent] / [verifier] network_mode and allowed_hosts: a trial's network is set once, for the whole trial,
    so a phase may only ask for what its environment has; anything else is refused with the reason (accepting it
    would run the phase on a network its task did not ask for)."""
    trial = "public" if environment.allow_internet else "no-network"
    for phase in ("environment", "agent", "verifier"):
        table, where = config.get(phase) or {}, f"{toml_path} [{phase}]"
        if table.get("allowed_hosts"):
            problems.append(f"{where}: allowed_hosts is not supported yet (hosts are not filtered): use "
                            "network_mode \"public\" or \"no-network\"")
        mode = table.get("network_mode")
        if phase != "environment" and mode is not None and mode != trial:
            problems.append(f"{where}: network_mode = {mode!r}, but a trial's network is set once for all its "
                            f"phases, here {trial!r} (from [environment]): per-phase networks are not supported "
                            "yet; give the phase the environment's setting")


def _user(table: dict, where: str, problems: list[str]) -> str | None:
    """[agent] / [verifier] user: a name or a UID, as Harbor takes it (containers apply it)."""
    user = table.get("user")
    if user is None:
        return None
    if isinstance(user, bool) or not isinstance(user, (str, int)) or not str(user).strip():
        problems.append(f"{where}: user must be a user name or a UID, not {user!r}")
        return None
    return str(user).strip()


def _warn_unknown(config: dict, toml_path: Path) -> None:
    for table, keys in KNOWN.items():
        section = config if not table else config.get(table)
        if not isinstance(section, dict):
            continue
        for key in section:
            label = f"[{table}] {key}" if table else key
            if key not in keys:
                warn_once(f"task.toml: unknown key {label} ignored (first seen in {toml_path.parent.name})", label)
            elif (table, key) in IGNORED:
                warn_once(f"task.toml: {label} is not applied: {IGNORED[(table, key)]}", label)


def is_task(folder: Path) -> bool:
    """A Harbor task folder: an instruction.md, or (multi-step) a steps/ folder beside task.toml."""
    return (folder / "instruction.md").is_file() or ((folder / "task.toml").is_file() and (folder / "steps").is_dir())


def _config(toml_path: Path, problems: list[str]) -> dict:
    config = {}
    if toml_path.is_file():
        try:
            config = tomllib.loads(toml_path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise TaskError(f"{toml_path}: not valid TOML ({exc}); fix the file") from None
    for section in ("task", "agent", "verifier", "solution", "environment", "metadata"):
        if section in config and not isinstance(config[section], dict):
            problems.append(f"{toml_path}: [{section}] must be a table")
            config.pop(section)
    if "steps" in config and not isinstance(config["steps"], list):
        problems.append(f"{toml_path}: steps must be [[steps]] tables")
        config.pop("steps")
    return config


def load_task(path: str | Path) -> Task:
    """One task folder; TaskError lists every problem it has."""
    path = Path(path)
    toml_path, instruction_path = path / "task.toml", path / "instruction.md"
    problems: list[str] = []
    if not is_task(path):
        raise TaskError(f"{path} is not a Harbor task: it has no instruction.md (nor task.toml with steps/)")
    config = _config(toml_path, problems)
    steps, strategy = read_steps(path, config, str(toml_path), problems) if config.get("steps") else ((), "mean")
    if not steps and not instruction_path.is_file():
        problems.append(f"{path} has no instruction.md and no [[steps]] in task.toml")
    if not steps and not (path / "tests" / "test.sh").is_file():
        problems.append(f"{path} has no tests/test.sh: every task needs a verifier that writes "
                        "/logs/verifier/reward.txt or reward.json")
    _warn_unknown(config, toml_path)
    agent, verifier, info = config.get("agent", {}), config.get("verifier", {}), config.get("task", {})
    instruction = steps[0].instruction if steps else \
        instruction_path.read_text(encoding="utf-8").strip() if instruction_path.is_file() else ""
    task = Task(
        name=path.name, path=path.resolve(), instruction=instruction, steps=steps, reward_strategy=strategy,
        agent_timeout_s=seconds(agent, "timeout_sec", f"{toml_path} [agent]", 600.0, problems),
        verifier_timeout_s=seconds(verifier, "timeout_sec", f"{toml_path} [verifier]", 600.0, problems),
        metadata=dict(config.get("metadata", {})), title=str(info.get("name", "")),
        description=str(info.get("description", "")),
        environment=replace(_environment(path, config.get("environment", {}), f"{toml_path} [environment]", problems),
                            agent_user=_user(agent, f"{toml_path} [agent]", problems),
                            verifier_user=_user(verifier, f"{toml_path} [verifier]", problems)),
        verifier_env=resolve_env(verifier.get("env"), f"{toml_path} [verifier]", problems),
        solution_env=resolve_env(config.get("solution", {}).get("env"), f"{toml_path} [solution]", problems))
    _phase_networks(config, task.environment, toml_path, problems)
    if problems:
        raise TaskError("\n".join(problems))
    return task


def _tasks_in(folder: Path, skip_invalid: bool = False) -> list[Task]:
    if is_task(folder):
        return [load_task(folder)]
    tasks, bad = [], []
    for path in sorted(folder.iterdir()):
        if path.is_dir() and is_task(path):
            try:
                tasks.append(load_task(path))
            except TaskError as exc:
                bad.append((path.name, str(exc)))
    if bad and not skip_invalid:
        listed = "\n".join(f"  {name}: {line}" for name, text in bad for line in text.splitlines())
        raise TaskError(f"{len(bad)} of {len(tasks) + len(bad)} tasks in {folder} cannot be read:\n{listed}\n"
                        "Fix them, or pass --skip-invalid-tasks to run the others")
    for name, text in bad:
        warn_once(f"skipping task {name}: {text.splitlines()[0]}" + (" (and more)" if "\n" in text else ""))
    if not tasks:
        raise TaskError(f"{folder} holds no Harbor tasks (folders with instruction.md and tests/test.sh)"
                        + (" that can be read" if bad else ""))
    return tasks


def load_dataset(spec: str, skip_invalid: bool = False) -> list[Task]:
    """Resolve a dataset spec to its tasks; see the module docstring for the forms."""
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        choose("builtin dataset", name, SETS, TaskError)
        return _tasks_in(builtin_dataset(name), skip_invalid)
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
                            "(HF_HUB_OFFLINE=1): download it where the Hub is reachable, or pass a local "
                            "folder") from None
        except Exception as exc:
            raise TaskError(f"could not fetch Hugging Face dataset {repo}: {exc}. Check the name and the network, "
                            "or pass a local folder of Harbor tasks") from None
        return _tasks_in(Path(folder), skip_invalid)
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise TaskError(f"{path} is a file; a dataset is a folder of Harbor tasks")
        return _tasks_in(path, skip_invalid)
    if "@" in spec and "/" not in spec:
        raise TaskError(f"'{spec}' looks like a Harbor registry dataset: resolving it needs the network and the "
                        "harbor package (make setup HARBOR=1). Offline, download it elsewhere and pass the folder")
    raise TaskError(f"unknown dataset '{spec}': give a folder of Harbor tasks, a builtin set ({_builtin_names()}) "
                    "or hf:OWNER/NAME (a Hugging Face dataset of Harbor task folders)")


def _builtin_names() -> str:
    return ", ".join("builtin:" + name for name in SETS)
