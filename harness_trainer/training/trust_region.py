"""Learning that holds: the trust region for fresh tokens, and seeing a collapse coming.

1. bound_step. With one optimizer update per batch no ratio clip can bind on freshly sampled tokens: the
   gradient is taken where the ratio is 1. So the step itself is bounded. After the optimizer's step, on the
   step's own trained tokens, with p_t before and p'_t after the step (at the sampling temperature):

       every token   |p'_t - p_t| <= step_clip                    (step_clip_mode "probability", the default)
                     1 - step_clip <= p'_t / p_t <= 1 + step_clip  (step_clip_mode "ratio": PPO's range)
       on average    mean_t k3 = r_t - 1 - log r_t <= max_step_kl,  r_t = p'_t / p_t
       theta = theta_before + s * delta, s the largest scale in [0, 1] that keeps both

   The search predicts s from how far the last try was past the bound (a move in probability or log-ratio
   grows about linearly with s, a KL about quadratically), aims 10% inside, and measures again; a step still
   outside after `tries` measures is not taken at all (s = 0, counted as `step_skipped`). So a taken step is
   always inside the bound, and no step is cut to a fixed fraction that may still be outside it.

   Why probability and not ratio by default: a ratio bound lets a token at p = 1/300 grow by x1.2 a step, so a
   weak policy's rare reward needs ~30 steps at the bound to be lifted to 0.5, each of them a bound-limited
   step; an absolute bound lets it grow by 0.2 a step, and bounds a near-certain token (p ~ 1) exactly as the
   ratio did. Adam's moments keep the full step's update; only the move is shortened. Why per token and not
   only on average: in the toy proof one step moved the submit call `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`
   to `... FINAL_OUTP > data.txt` (which overwrites the answer) in every rollout that followed, at a mean KL of
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

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def bound_step(params: list[torch.Tensor], before: list[torch.Tensor], measure: Callable[[], dict],
               room: Callable[[dict], float], tries: int = 6, margin: float = 0.9) -> dict:
    """Shorten the step just taken (params now, before it: `before`) to the largest scale inside the bound.

    room(change) is the factor by which the current move may still be scaled and stay inside (>= 1: inside).
    Rescaling in place, p <- b + (p - b) * new / old, needs no copy of the step beside the weights before it."""
    scale, change = 1.0, measure()
    first, measures = change, 1
    while room(change) < 1:
        if measures >= tries:  # still outside: the step is not taken
            with torch.no_grad():
                for p, b in zip(params, before):
                    p.copy_(b)
            return ({"step_scale": 0.0, "step_skipped": 1, "step_measures": measures}
                    | {f"step_{k}_unbounded": v for k, v in first.items()})
        new = scale * margin * max(room(change), 1e-6)
        with torch.no_grad():
            for p, b in zip(params, before):
                p.sub_(b).mul_(new / scale).add_(b)
        scale, change, measures = new, measure(), measures + 1
    return ({"step_scale": scale, "step_skipped": 0, "step_measures": measures}
            | {f"step_{k}": v for k, v in change.items()} | {f"step_{k}_unbounded": v for k, v in first.items()})


def room_in(change: dict, step_clip: float | None, max_step_kl: float | None, mode: str = "probability") -> float:
    """How much further the move measured in `change` may be scaled and stay inside the bound (>= 1: inside).
    A move in probability or log-ratio grows about linearly with the step's scale, a KL about quadratically."""
    rooms = [math.inf]
    if step_clip is not None and mode == "probability":
        rooms.append(step_clip / max(change["prob_move"], 1e-12))
    elif step_clip is not None:
        up, down = math.log(change["ratio_max"]), -math.log(change["ratio_min"])
        rooms += [math.log1p(step_clip) / max(up, 1e-12), -math.log1p(-step_clip) / max(down, 1e-12)]
    if max_step_kl is not None:
        rooms.append(math.sqrt(max_step_kl / max(change["kl"], 1e-18)))
    return min(rooms)


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
        if (cut := metrics.get("is_truncated_frac") or 0.0) > 0.5:
            warnings.append(f"{cut:.0%} of the step's trained tokens had their importance weight cut or masked "
                            "(vllm_importance_sampling_mode, _clip_max): the engine's logprobs and the trainer's "
                            "disagree on them (see behaviour_kl). Under sequence_* a rollout's weight is the product "
                            "over all its tokens, so long rollouts from a lower-precision engine are masked whole; "
                            "token_truncate weighs each token alone")
        top = metrics.get("reward_max") if metrics.get("scorable") else None
        if top is not None and top <= 0 and self.best_reward is not None and self.best_reward > top:
            warnings.append(f"every rollout of this step scored {top:g} (earlier steps reached {self.best_reward:g}): "
                            "its groups have no gradient, and a policy that stays here cannot learn its way back")
        if top is not None:
            self.best_reward = top if self.best_reward is None else max(self.best_reward, top)
        return warnings
