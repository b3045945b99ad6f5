"""Reward functions, of two shapes, for black-box and white-box runs alike:

    rollout_reward_fn(outcome) -> float | None                 one rollout (the seed's harness API)
    reward_func(environments, **kwargs) -> list[float | None]  a whole group at once (TRL's reward_funcs)

None means "not mine" to a group function: a group's functions are summed per rollout with None skipped (TRL's
nan-sum; a rollout every one of them left None scores 0, with a warning). A lone rollout_reward_fn's None means
"not scorable": that rollout is left out of its group's baseline, never counted as 0.
Each function is logged as its own metric (rewards/<name>/mean). The keyword arguments a group function gets,
one value per rollout each: environments (a white-box rollout's instance, else None), outcomes
(HarnessRolloutOutcome), completions (the messages each rollout added), completion_ids (its sampled token ids,
every turn's), and for dataset rows prompts and every other column.

Given as Python callables, as `module:function` (the CLI's --reward, --reward-funcs a,b), or as the name of an
entry point in the `harness_trainer.rewards` group. Built-ins: `verifier` (the default) and `verifier+tools`.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable
from importlib.metadata import entry_points

from harness_trainer._exceptions import RewardError
from harness_trainer.choices import refused
from harness_trainer.rollouts.session import HarnessRolloutOutcome

log = logging.getLogger("harness_trainer")

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


def resolve_reward_fn(spec: str | RewardFn | None) -> RewardFn:
    if spec is None:
        return verifier_reward
    if callable(spec):
        return spec
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" in spec:
        return _import(spec, "--reward")
    found = [ep for ep in entry_points(group="harness_trainer.rewards") if ep.name == spec]
    if found:
        return found[0].load()
    raise RewardError(refused("--reward", spec, (*BUILTIN, "module:function",
                                                 "an entry point in the harness_trainer.rewards group")))


def score(fn: RewardFn, outcome: HarnessRolloutOutcome) -> float | None:
    """Call a reward function and check what it returned."""
    value = fn(outcome)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(f"reward function {getattr(fn, '__name__', fn)} returned {value!r}; it must return a "
                          "finite number, or None for 'not scorable'")
    return float(value)


def _import(spec: str, flag: str):
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise RewardError(f"{flag} {spec}: cannot import {attr} from {module_name} ({exc}); the module must "
                          "be importable (on PYTHONPATH) and define that function") from None
    if not callable(fn):
        raise RewardError(f"{flag} {spec}: {attr} is not callable")
    return fn


GroupRewardFn = Callable[..., list]  # f(environments=..., outcomes=..., **columns) -> one value per rollout


def reward_name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def resolve_reward_funcs(spec) -> list[GroupRewardFn]:
    """reward_funcs: None, one callable, a list of callables / `module:function`, or "module:f,module:g"."""
    if spec is None:
        return []
    if isinstance(spec, str):
        spec = [part.strip() for part in spec.split(",") if part.strip()]
    elif callable(spec):
        spec = [spec]
    funcs = [item if callable(item) else _import(str(item), "--reward-funcs") for item in spec]
    names = [reward_name(fn) for fn in funcs]
    if len(set(names)) != len(names):
        raise RewardError(f"reward_funcs {names}: two functions share a name, and each is logged by its name "
                          "(rewards/<name>/mean); rename one")
    return funcs


def resolve_rewards(rollout_reward_fn=None, reward_funcs=None) -> tuple[RewardFn | None, list[GroupRewardFn]]:
    """The run's rewards, resolved once: the group functions, then the per-rollout one (given, or the verifier
    when there is nothing else). Callables pass through unchanged."""
    funcs = resolve_reward_funcs(reward_funcs)
    fn = resolve_reward_fn(rollout_reward_fn) if rollout_reward_fn is not None or not funcs else None
    return fn, funcs


def _nansum(values) -> float | None:
    present = [v for v in values if v is not None]
    return float(sum(present)) if present else None


def _call(fn, kwargs: dict):
    try:
        return fn(**kwargs)
    except Exception as exc:  # the user's code: say whose, and what the group held
        raise RewardError(f"reward function {reward_name(fn)} raised {type(exc).__name__}: {exc} (called with "
                          f"{', '.join(sorted(kwargs))}; a function should take **kwargs for what it does not use)") \
            from exc


def _checked(fn, values, n: int) -> list[float | None]:
    name = reward_name(fn)
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise RewardError(f"reward function {name} returned {values!r:.200}; it must return a list with one value "
                          f"per environment ({n})")
    for value in values:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise RewardError(f"reward function {name} returned {value!r} in its list; each value must be a "
                              "finite number, or None for 'not mine'")
    return [None if v is None else float(v) for v in values]


def score_group(records: list, reward_funcs: list[GroupRewardFn], rollout_reward_fn: RewardFn | None = None,
                row: dict | None = None) -> None:
    """Score one group of RolloutRecords in place: each record's reward_terms (one value per function) and
    reward (their nan-sum). A white-box rollout has no verifier: its env_reward becomes the sum of the group
    functions, before rollout_reward_fn (if any) sees the outcome. Rollouts that did not finish are not passed."""
    live = [r for r in records if r.status in ("ok", "timeout")]
    for record in records:
        record.reward_terms, record.reward = {}, None
    if not live:
        return
    n, columns = len(live), {k: v for k, v in (row or {}).items()}
    kwargs = {"environments": [r.environment for r in live], "outcomes": [r.outcome for r in live],
              "completions": [r.outcome.completion for r in live],
              "completion_ids": [[i for t in (r.training_trace or {}).get("turns", [])
                                  for i in t["completion_token_ids"]]
                                 for r in live],
              **{key: [value] * n for key, value in columns.items() if key not in ("completion", "completion_ids")}}
    if "prompt" in columns:
        kwargs["prompts"] = kwargs.pop("prompt")
    terms = {reward_name(fn): _checked(fn, _call(fn, kwargs), n) for fn in reward_funcs}
    if any(r.environment is not None for r in live):
        for i, record in enumerate(live):
            record.outcome.env_reward = _nansum(values[i] for values in terms.values()) or 0.0
    if rollout_reward_fn is not None:
        terms[reward_name(rollout_reward_fn)] = [score(rollout_reward_fn, r.outcome) for r in live]
    unclaimed = 0
    for i, record in enumerate(live):
        record.reward_terms = {name: values[i] for name, values in terms.items()}
        record.reward = _nansum(record.reward_terms.values())
        if record.reward is None and reward_funcs:  # TRL's nan-sum of nothing is 0; a lone rollout_reward_fn's
            record.reward, unclaimed = 0.0, unclaimed + 1  # None still means "not scorable"
    if unclaimed:
        log.warning("%d rollout(s) of %s: every reward function returned None; scored 0, as TRL's nan-sum does. "
                    "Does some function claim these rows?", unclaimed, live[0].task)
