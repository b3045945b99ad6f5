"""The verifier runs after the agent, as Harbor runs it, in a step the agent cannot influence:

  1. the agent's exec has ended, and with it every process it started (the sandbox guarantees that);
  2. /logs/verifier and /tests are emptied, so nothing the agent planted there survives (a container's /tests
     goes back to what its image keeps there: reference data a task's tests read, as Harbor leaves it);
  3. the task's tests are copied in only now (over the image's), so the agent never saw or changed them;
  4. /tests/test.sh is made executable and run through its own shebang, with the task's [verifier] env (and
     [environment] env) and verifier timeout (Harbor's default 600 s); its stdout and stderr go to
     /logs/verifier/test-stdout.txt, kept in the rollout's record;
  5. the rewards are read as Harbor 0.26's verifier reads them: reward.json when it is there (a flat object of
     numbers, true/false as 1/0, every key kept), else reward.txt (one number, as {"reward": x}). Harbor's docs
     say reward.txt first; its code reads reward.json first, and the code is what Harbor users' tasks were
     checked against.

The training reward is `reward_key`'s value (default "reward"); a reward.json without that key but with
exactly one number uses that one; several numbers and none under the key leave the rollout unscorable, saying
which keys there are (pass --reward-key, or a rollout_reward_fn that reads them all).
A verifier that cannot run or writes no readable reward gives None (unscorable), never 0.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory

from harness_trainer._exceptions import SandboxError
from harness_trainer.rollouts.steps import Step
from harness_trainer.rollouts.tasks import Task
from harness_trainer.sandboxes.base import Sandbox

TEST_STDOUT = "/logs/verifier/test-stdout.txt"
# where the oracle's solve.sh leaves its output and exit status (oracle.py), read before the tests run: a
# solution that failed is told apart from a verifier that scored 0
SOLUTION_LOG, SOLUTION_EXIT = "/logs/agent/solution.log", "/logs/agent/solution.exit"


@dataclass
class VerifierResult:
    reward: float | None
    detail: str  # why the reward is what it is (or why there is none)
    stdout: str = ""  # the end of test-stdout.txt (test.sh's stdout and stderr)
    stderr: str = ""
    rewards: dict = field(default_factory=dict)  # every number the verifier wrote, by key
    solution: str = ""  # the oracle's solve.sh, when it ran: "solve.sh exited N" and its last output


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _fetch(sandbox: Sandbox, inside: str, folder: Path) -> str | None:
    target = folder / Path(inside).name
    try:
        sandbox.download(inside, target)
        return target.read_text(errors="replace")
    except Exception:  # not there (each backend says so its own way)
        return None


def read_rewards(sandbox: Sandbox) -> tuple[dict[str, float] | None, str]:
    """Every number the verifier wrote ({"reward": x} for reward.txt), and where from; None with the reason."""
    with TemporaryDirectory() as tmp:
        reward_json = _fetch(sandbox, "/logs/verifier/reward.json", Path(tmp))
        reward_txt = None if reward_json is not None else _fetch(sandbox, "/logs/verifier/reward.txt", Path(tmp))
    if reward_json is not None:
        try:
            data = json.loads(reward_json)
        except ValueError as exc:
            return None, f"reward.json is not JSON: {exc}"
        if not isinstance(data, dict):
            value = _number(data)
            return ({"reward": value}, "reward.json") if value is not None else \
                (None, f"reward.json holds {reward_json.strip()[:40]!r}, not an object of numbers")
        # true/false count as 1/0, as Harbor's VerifierResult (dict[str, float | int], pydantic) reads them
        numbers = {str(k): float(v) if isinstance(v, bool) else _number(v) for k, v in data.items()}
        bad = [k for k, v in numbers.items() if v is None]
        if bad or not numbers:
            return None, (f"reward.json: {', '.join(bad)} not a finite number" if bad else "reward.json is empty")
        return numbers, "reward.json"
    if reward_txt is not None:
        try:
            reward = _number(float(reward_txt.strip()))
        except ValueError:
            reward = None
        if reward is None:
            return None, f"reward.txt holds {reward_txt.strip()[:40]!r}, not a number"
        return {"reward": reward}, "reward.txt"
    return None, "the verifier wrote neither reward.json nor reward.txt"


def training_reward(rewards: dict[str, float], reward_key: str, source: str) -> tuple[float | None, str]:
    """The one number training uses, by the rule in the module docstring."""
    if source == "reward.txt":  # one number, whatever the key asked for
        return rewards["reward"], source
    if reward_key in rewards:
        return rewards[reward_key], f"{source}[{reward_key}]"
    if len(rewards) == 1:
        (key, value), = rewards.items()
        return value, f"{source}[{key}] (its only key)"
    return None, (f"{source} has {', '.join(sorted(rewards))} and no '{reward_key}': pass --reward-key with the one "
                  "to train on, or a rollout_reward_fn that combines them")


def solution_report(sandbox: Sandbox) -> str:
    """What the oracle's solve.sh left: its exit status and the end of its output ("" when it did not run)."""
    with TemporaryDirectory() as tmp:
        status = (_fetch(sandbox, SOLUTION_EXIT, Path(tmp)) or "").strip()
        output = (_fetch(sandbox, SOLUTION_LOG, Path(tmp)) or "").strip()[-300:]
    return f"solve.sh exited {status}" + (f": {output}" if output else "") if status else ""


def solution_failed(report: str) -> bool:
    """Whether a solution_report says solve.sh failed ("" — it did not run — is not a failure)."""
    return bool(report) and not report.startswith("solve.sh exited 0")


def verify(sandbox: Sandbox, task: Task, reward_key: str = "reward", step: Step | None = None) -> VerifierResult:
    """The task's verifier, or one step's (its tests over the task's shared ones, its env and timeout)."""
    solution = solution_report(sandbox)
    tests = step.tests_dirs(task.path) if step else [task.tests_dir]
    timeout_s, env = (step.verifier_timeout_s, step.verifier_env) if step else (task.verifier_timeout_s,
                                                                               task.verifier_env)
    try:
        sandbox.clear("/logs/verifier")
        sandbox.clear("/tests")
        for folder in tests:  # a step's own tests copied over the shared ones
            sandbox.upload(folder, "/tests")
    except (SandboxError, OSError) as exc:  # e.g. a container killed for its memory under the agent
        return VerifierResult(None, f"the verifier could not be set up: {exc}", solution=solution)
    result = sandbox.exec(f"chmod +x /tests/test.sh 2>/dev/null; /tests/test.sh > {TEST_STDOUT} 2>&1", timeout_s,
                          env={**task.environment.env, **env}, user=task.environment.verifier_user)
    with TemporaryDirectory() as tmp:
        output = (_fetch(sandbox, TEST_STDOUT, Path(tmp)) or "")[-8000:]
    if result.timed_out:
        return VerifierResult(None, f"the verifier timed out after {timeout_s:.0f} s", output,
                              result.stderr[-4000:], solution=solution)
    rewards, source = read_rewards(sandbox)
    reward, detail = (None, source) if rewards is None else training_reward(rewards, reward_key, source)
    if reward is None and result.returncode != 0:
        detail = f"test.sh exited {result.returncode} and {detail}"
    return VerifierResult(reward, detail, output, result.stderr[-4000:], rewards or {}, solution)
