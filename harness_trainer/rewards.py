"""Reward functions: `rollout_reward_fn(outcome) -> float | None`. None means "not scorable": the rollout is
left out of its group's baseline, never counted as 0.

Given as a Python callable, as `module:function` (the CLI's --reward), or as the name of an entry point in
the `harness_trainer.rewards` group. Built-ins: `verifier` (the default) and `verifier+tools`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from importlib.metadata import entry_points

from harness_trainer.adapters.session import HarnessRolloutOutcome

RewardFn = Callable[[HarnessRolloutOutcome], "float | None"]


def verifier_reward(outcome: HarnessRolloutOutcome) -> float | None:
    """The task verifier's reward, as is."""
    return outcome.env_reward


def verifier_with_tool_bonus(outcome: HarnessRolloutOutcome, max_calls: int = 15, weight: float = 0.3) -> float | None:
    """The seed's example: correctness first, plus a small bonus for solving with few tool calls —
    only when solved, so a fast wrong answer earns nothing."""
    if outcome.env_reward is None:
        return None
    bonus = weight * min(1.0, max(0.0, 1.0 - outcome.tool_call_count / max_calls)) if outcome.env_reward >= 1.0 else 0.0
    return outcome.env_reward + bonus


BUILTIN = {"verifier": verifier_reward, "verifier+tools": verifier_with_tool_bonus}


class RewardError(ValueError):
    """A reward function could not be found or returned something that is not a reward."""


def resolve_reward_fn(spec: str | RewardFn | None) -> RewardFn:
    if spec is None:
        return verifier_reward
    if callable(spec):
        return spec
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise RewardError(f"--reward {spec}: cannot import {attr} from {module_name} ({exc}); the module must "
                              "be importable (on PYTHONPATH) and define that function") from None
        if not callable(fn):
            raise RewardError(f"--reward {spec}: {attr} is not callable")
        return fn
    found = [ep for ep in entry_points(group="harness_trainer.rewards") if ep.name == spec]
    if found:
        return found[0].load()
    raise RewardError(f"unknown reward '{spec}': use one of {', '.join(BUILTIN)}, module:function, or an entry "
                      "point in the harness_trainer.rewards group")


def score(fn: RewardFn, outcome: HarnessRolloutOutcome) -> float | None:
    """Call a reward function and check what it returned."""
    value = fn(outcome)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(f"reward function {getattr(fn, '__name__', fn)} returned {value!r}; it must return a "
                          "finite number, or None for 'not scorable'")
    return float(value)
