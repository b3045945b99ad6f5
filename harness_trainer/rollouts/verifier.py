"""The verifier runs after the agent, in a step the agent cannot influence:

  1. the agent's exec has ended, and with it every process it started (the sandbox guarantees that);
  2. /logs/verifier and /tests are emptied, so nothing the agent planted there survives;
  3. the task's tests are copied in only now, so the agent never saw or changed them;
  4. `bash /tests/test.sh` runs with the task's verifier timeout and a fixed PATH;
  5. the reward is read from reward.json (its `reward_key`, default "reward") or reward.txt.

A verifier that cannot run or writes no readable reward gives None (unscorable), never 0.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

from harness_trainer.agents.sandbox import Sandbox
from harness_trainer.rollouts.tasks import Task


@dataclass
class VerifierResult:
    reward: float | None
    detail: str  # why the reward is what it is (or why there is none)
    stdout: str = ""
    stderr: str = ""


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


def read_reward(sandbox: Sandbox, reward_key: str = "reward") -> tuple[float | None, str]:
    with TemporaryDirectory() as tmp:
        reward_json = _fetch(sandbox, "/logs/verifier/reward.json", Path(tmp))
        reward_txt = None if reward_json is not None else _fetch(sandbox, "/logs/verifier/reward.txt", Path(tmp))
    if reward_json is not None:
        try:
            data = json.loads(reward_json)
        except ValueError as exc:
            return None, f"reward.json is not JSON: {exc}"
        value = data.get(reward_key) if isinstance(data, dict) else data
        reward = _number(value)
        if reward is None:
            return None, f"reward.json has no number under '{reward_key}'"
        return reward, f"reward.json[{reward_key}]"
    if reward_txt is not None:
        try:
            reward = _number(float(reward_txt.strip()))
        except ValueError:
            reward = None
        if reward is None:
            return None, f"reward.txt holds {reward_txt.strip()[:40]!r}, not a number"
        return reward, "reward.txt"
    return None, "the verifier wrote neither reward.json nor reward.txt"


def verify(sandbox: Sandbox, task: Task, reward_key: str = "reward") -> VerifierResult:
    sandbox.clear("/logs/verifier")
    sandbox.clear("/tests")
    sandbox.upload(task.tests_dir, "/tests")
    result = sandbox.exec("bash /tests/test.sh", task.verifier_timeout_s,
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin"})
    if result.timed_out:
        return VerifierResult(None, f"the verifier timed out after {task.verifier_timeout_s:.0f} s",
                              result.stdout, result.stderr)
    reward, detail = read_reward(sandbox, reward_key)
    if reward is None and result.returncode != 0:
        detail = f"test.sh exited {result.returncode} and {detail}"
    return VerifierResult(reward, detail, result.stdout[-4000:], result.stderr[-4000:])
