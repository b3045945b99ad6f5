"""Learning that holds: the trust region for fresh tokens, and seeing a collapse coming.

1. bound_step. With one optimizer update per batch no ratio clip can bind on freshly sampled tokens: the
   gradient is taken where the ratio is 1. So the step itself is bounded. After the optimizer's step, on the
   step's own trained tokens, with r_t = p_after(t) / p_before(t):

       every token   1 - step_clip <= r_t <= 1 + step_clip       (PPO's clip range, as a bound on the move)
       on average    mean_t k3 = r_t - 1 - log r_t <= max_step_kl
       theta = theta_before + s * delta,  s = 1, 1/2, 1/4, ... until both hold (s >= 1/64)

   Adam's moments keep the full step's update; only the move is shortened. Why per token and not only on
   average: in the toy proof one step moved the submit call `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` to
   `... FINAL_OUTP > data.txt` (which overwrites the answer) in every rollout that followed, at a mean KL of
   0.006 over the step's 620 tokens: a catastrophe at one position is invisible in the mean. The mean bound
   alone still caught the steps that moved everything (KL 0.4 in one step at lr 3e-4, against 0.001-0.004
   for the steps before it).

2. StabilityMonitor: warnings from one step's metrics against the steps before it.

A policy that over-learns one rewarded decision shows it before its reward falls: the entropy of its sampled
tokens jumps (answers grow long and repetitive), its distance to the policy that sampled the batch jumps,
and then every rollout scores zero, after which no group has a gradient and the run cannot recover. So:

    entropy jump   entropy > factor x median(last `window` steps) and above it by at least `entropy_floor`
    KL jump        KL(behaviour || current), k3 on sampled tokens, > factor x median and > `kl_floor`
    all zero       every rollout of the step was scored and scored 0 (or less), after earlier steps scored more

The floors keep the first noisy steps of a near-deterministic policy (entropy 0.01 -> 0.02) from warning.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def bound_step(params: list[torch.Tensor], before: list[torch.Tensor], measure: Callable[[], dict],
               within: Callable[[dict], bool], min_scale: float = 1 / 64) -> dict:
    """Shorten the step just taken (params now, before it: `before`) until within(measure()). Halving in place,
    p <- b + (p - b) / 2, needs no copy of the step beside the one of the weights before it."""
    scale = 1.0
    change = first = measure()
    while not within(change) and scale > min_scale:
        scale /= 2
        with torch.no_grad():
            for p, b in zip(params, before):
                p.sub_(b).mul_(0.5).add_(b)
        change = measure()
    return ({"step_scale": scale} | {f"step_{k}": v for k, v in change.items()}
            | {f"step_{k}_unbounded": v for k, v in first.items()})


@dataclass
class StabilityMonitor:
    factor: float = 3.0
    window: int = 5
    entropy_floor: float = 0.05
    kl_floor: float = 0.02
    seen: dict[str, list[float]] = field(default_factory=dict)
    best_reward: float | None = None

    def _jump(self, name: str, value: float | None, floor: float) -> str | None:
        if value is None:
            return None
        history = self.seen.setdefault(name, [])
        recent = history[-self.window:]
        history.append(value)
        if not recent:
            return None
        median = statistics.median(recent)
        if value > self.factor * median and value - median > floor:
            return f"{name} jumped to {value:.3g} (median of the last {len(recent)} steps: {median:.3g})"
        return None

    def check(self, metrics: dict) -> list[str]:
        warnings = [w for w in (self._jump("entropy", metrics.get("entropy"), self.entropy_floor),
                                self._jump("behaviour_kl_k3", metrics.get("behaviour_kl_k3"), self.kl_floor)) if w]
        top = metrics.get("reward_max") if metrics.get("scorable") else None
        if top is not None and top <= 0 and self.best_reward is not None and self.best_reward > top:
            warnings.append(f"every rollout of this step scored {top:g} (earlier steps reached {self.best_reward:g}): "
                            "its groups have no gradient, and a policy that stays here cannot learn its way back")
        if top is not None:
            self.best_reward = top if self.best_reward is None else max(self.best_reward, top)
        return warnings
