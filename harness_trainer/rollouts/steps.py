"""Multi-step tasks as Harbor 0.26 defines them (`harbor/trial/multi_step.py`): `[[steps]]` in task.toml, each
step a folder `steps/NAME/` with its own instruction, and run in order in one environment:

    steps/NAME/instruction.md   what the agent is told for this step
    steps/NAME/tests/           this step's tests, copied over the task's top-level tests/ (which every step
                                shares); test.sh from the step's folder when it has one, else the shared one
    steps/NAME/solution/        this step's solve.sh for the oracle (else the task's solution/)
    steps/NAME/workdir/         copied into the working folder before the step; its setup.sh is run there

    [[steps]]  name, min_reward (a number gates "reward"; a table gates each key), [steps.agent] timeout_sec
               (else the task's), [steps.verifier] timeout_sec (else 600 s) / env (the step's own: the task's
               [verifier] table is not a step's, as in Harbor)
    multi_step_reward_strategy = "mean" (default: each key's mean over the steps that were verified, a key a
               step lacks counted as 0) | "final" (the last verified step's rewards)

Each step is a fresh run of the agent (Harbor 0.26 resumes a session only for agents that support its
`resume_trajectory`); its turns go to the rollout's one capture session, so a rollout holds one chain per
step. A step below its min_reward ends the rollout: later steps do not run and are not counted, as in Harbor.
In training a multi-step rollout is one rollout of its group: the trial's reward (above) is credited to every
turn of every step, as a single-step rollout's reward is to each of its turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from harness_trainer.choices import one_of
from harness_trainer.rollouts.task_fields import resolve_env, seconds
from harness_trainer.sandboxes.images import warn_once

STRATEGIES = ("mean", "final")


@dataclass(frozen=True)
class Step:
    name: str
    path: Path  # steps/NAME
    instruction: str
    agent_timeout_s: float = 600.0
    verifier_timeout_s: float = 600.0
    verifier_env: dict = field(default_factory=dict, hash=False, compare=False)
    min_reward: dict | None = field(default=None, hash=False, compare=False)  # key -> threshold

    def tests_dirs(self, task_path: Path) -> list[Path]:
        """What goes into /tests, in order: the task's shared tests/, then the step's own over them."""
        return [d for d in (task_path / "tests", self.path / "tests") if d.is_dir()]

    def solution(self, task_path: Path) -> Path | None:
        for folder in (self.path / "solution", task_path / "solution"):
            if (folder / "solve.sh").is_file():
                return folder / "solve.sh"
        return None

    def below(self, rewards: dict[str, float]) -> str:
        """Why this step's rewards fail its min_reward ("" when they pass): a missing key counts as -inf."""
        for key, threshold in (self.min_reward or {}).items():
            if rewards.get(key, float("-inf")) < threshold:
                return f"step {self.name}: {key} = {rewards.get(key, 'missing')} is below its min_reward {threshold}"
        return ""


def trial_rewards(verified: list[dict[str, float]], strategy: str) -> dict[str, float]:
    """The trial's rewards from the verified steps' rewards, as Harbor derives them (module docstring)."""
    if not verified:
        return {}
    if strategy == "final":
        return dict(verified[-1])
    keys = {key for rewards in verified for key in rewards}
    return {key: sum(rewards.get(key, 0.0) for rewards in verified) / len(verified) for key in sorted(keys)}


def read_steps(path: Path, config: dict, where: str, problems: list[str]) -> tuple[tuple[Step, ...], str]:
    """The task's [[steps]] and its reward strategy, each problem added to `problems`."""
    strategy = config.get("multi_step_reward_strategy") or "mean"
    if strategy not in STRATEGIES:
        problems.append(f"{where}: multi_step_reward_strategy {strategy!r}: choose {one_of(STRATEGIES)}")
    # a step's agent timeout falls back to the task's [agent]; its verifier's is its own (Harbor's default 600 s)
    default_agent = seconds(config.get("agent") or {}, "timeout_sec", where, 600.0, problems)
    steps, names = [], set()
    for table in config["steps"]:
        name = table.get("name") if isinstance(table, dict) else None
        if not isinstance(name, str) or not name or "/" in name or name.startswith(".") or name in names:
            problems.append(f"{where}: every [[steps]] needs a unique name that is a folder name, not {name!r}")
            continue
        names.add(name)
        folder, at = path / "steps" / name, f"{where} [[steps]] {name}"
        if not (folder / "instruction.md").is_file():
            problems.append(f"{at}: steps/{name}/instruction.md is missing")
            continue
        if not any((d / "test.sh").is_file() for d in (folder / "tests", path / "tests")):
            problems.append(f"{at}: no test.sh in steps/{name}/tests/ or the task's tests/")
        for key in ("healthcheck", "artifacts"):
            if table.get(key):
                warn_once(f"task.toml: [[steps]] {key} is not applied (first seen in {path.name})", f"steps.{key}")
        agent, verifier = table.get("agent") or {}, table.get("verifier") or {}
        steps.append(Step(
            name=name, path=folder.resolve(), instruction=(folder / "instruction.md").read_text().strip(),
            agent_timeout_s=seconds(agent, "timeout_sec", at, default_agent, problems),
            verifier_timeout_s=seconds(verifier, "timeout_sec", at, 600.0, problems),
            verifier_env=resolve_env(verifier.get("env"), f"{at} [verifier]", problems),
            min_reward=_min_reward(table.get("min_reward"), at, problems)))
    return tuple(steps), strategy


def _min_reward(value, where: str, problems: list[str]) -> dict | None:
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if value is None:
        return None
    if number(value):
        return {"reward": float(value)}
    if isinstance(value, dict) and value and all(number(v) for v in value.values()):
        return {str(k): float(v) for k, v in value.items()}
    problems.append(f"{where}: min_reward must be a number or a table of numbers, not {value!r}")
    return None
