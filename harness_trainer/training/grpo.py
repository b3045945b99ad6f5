"""Group-relative advantages and the policy loss, with off-policy correction.

Advantages, per group of `num_generations` rollouts of one task:
    A_i = r_i - mean(r)            (mean over the scorable rollouts only: r = None is left out, A = None)
    A_i = (r_i - mean(r)) / std(r) with scale_std (population std + eps)
A group whose scorable rewards are all equal gives no gradient; it is counted, not hidden.

Loss per trained token t (behaviour logprob b_t from the trace, current logprob p_t, advantage A):
    ppo        ratio = exp(p_t - b_t)
               l_t = -min(ratio * A, clip(ratio, 1-eps_low, 1+eps_high) * A)           (TRL's choice)
    decoupled  prox_t = logprob under the policy at the start of this step (no gradient)
               ratio = exp(p_t - prox_t),   w_t = exp(prox_t - b_t)  (importance weight to the behaviour policy)
               w_t -> min(w_t, bound) (tis) or w_t * [w_t <= bound] (mis)
               l_t = -w_t * min(ratio * A, clip(ratio, 1-eps_low, 1+eps_high) * A)
    The decoupled form stays correct when rollouts are several versions stale: the clip acts on the update
    step alone, and staleness is corrected by the (bounded) importance weight. It is the default.
    behaviour_clip (on by default): with one optimizer update per batch the proximal policy IS the current
               model, ratio = 1 and its clip never binds, so nothing would limit how far a stale batch pushes
               a token the policy has already moved. A token whose ratio to the behaviour policy,
               exp(p_t - b_t), has left [1-eps_low, 1+eps_high] in its advantage's direction gets no gradient,
               as in PPO:
                   l_t = 0   where (exp(p_t - b_t) > 1+eps_high and A > 0) or (exp(p_t - b_t) < 1-eps_low and A < 0)
Token mean over the global batch: sum_t l_t / (trained tokens in the whole batch), optional k3 KL to a
reference: + beta * (exp(q - p) - (q - p) - 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class GroupAdvantages:
    advantages: list[float | None]
    zero_variance: bool  # scorable rewards all equal: no learning signal from this group
    scorable: int


def group_advantages(rewards: list[float | None], scale_std: bool = False, eps: float = 1e-6) -> GroupAdvantages:
    scored = [r for r in rewards if r is not None]
    if not scored:
        return GroupAdvantages([None] * len(rewards), True, 0)
    mean = sum(scored) / len(scored)
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / len(scored))
    zero = std < eps
    advantages = []
    for r in rewards:
        if r is None:
            advantages.append(None)
        elif zero:
            advantages.append(0.0)
        else:
            advantages.append((r - mean) / (std + eps) if scale_std else r - mean)
    return GroupAdvantages(advantages, zero, len(scored))


@dataclass
class LossConfig:
    mode: str = "decoupled"  # or "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    is_mode: str = "tis"  # tis (truncate) or mis (mask), decoupled only
    is_bound: float = 2.0
    kl_beta: float = 0.0
    behaviour_clip: bool = True  # decoupled only: the trust region to the behaviour policy (see above)


def policy_loss(logp: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig,
                total_tokens: int, proximal: torch.Tensor | None = None,
                reference: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum of per-token losses / total_tokens (the global batch's trained tokens), and statistics."""
    if cfg.mode == "ppo":
        log_ratio = logp - behaviour
        weight = truncated = torch.ones_like(logp)
    elif cfg.mode == "decoupled":
        if proximal is None:
            raise ValueError("the decoupled loss needs the proximal logprobs (the policy at the step's start)")
        log_ratio = logp - proximal
        w = torch.exp(proximal - behaviour)
        weight = torch.clamp(w, max=cfg.is_bound) if cfg.is_mode == "tis" else w * (w <= cfg.is_bound)
        truncated = w > cfg.is_bound
    else:
        raise ValueError(f"unknown loss mode '{cfg.mode}': choose decoupled or ppo")
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    per_token = -weight * torch.minimum(ratio * advantages, clipped * advantages)
    with torch.no_grad():
        behaviour_ratio = torch.exp(logp - behaviour)
        outside = ((behaviour_ratio > 1 + cfg.clip_high) & (advantages > 0)) | \
                  ((behaviour_ratio < 1 - cfg.clip_low) & (advantages < 0))
    if cfg.mode == "decoupled" and cfg.behaviour_clip:
        per_token = per_token * ~outside
    kl = None
    if reference is not None:
        diff = reference - logp
        kl = torch.exp(diff) - diff - 1
        per_token = per_token + cfg.kl_beta * kl
    loss = per_token.sum() / max(total_tokens, 1)
    return loss, _stats(logp, behaviour, ratio, behaviour_ratio, weight, truncated, advantages, outside, kl, cfg)


def _stats(logp, behaviour, ratio, behaviour_ratio, weight, truncated, advantages, outside, kl,
           cfg: LossConfig) -> dict:
    """What a run needs to see coming trouble: how far the policy is from the one that sampled (KL, ratios),
    how much of the batch the trust region cut, and the importance weights."""
    if not logp.numel():
        return {}
    with torch.no_grad():
        n = logp.numel()
        diff = behaviour - logp.detach()
        stats = {
            "ratio_mean": float(ratio.mean()),
            "clip_low_frac": float(((ratio < 1 - cfg.clip_low) & (advantages < 0)).sum()) / n,
            "clip_high_frac": float(((ratio > 1 + cfg.clip_high) & (advantages > 0)).sum()) / n,
            "behaviour_ratio_mean": float(behaviour_ratio.mean()),
            "behaviour_ratio_max": float(behaviour_ratio.max()),
            "behaviour_ratio_min": float(behaviour_ratio.min()),
            "behaviour_clip_frac": float(outside.sum()) / n,  # tokens cut by the trust region (decoupled)
            "is_weight_mean": float(weight.mean()),
            "is_weight_max": float(weight.max()),
            "is_truncated_frac": float(truncated.float().sum()) / n if cfg.mode == "decoupled" else 0.0,
            "behaviour_kl": float(diff.mean()),  # k1 estimate of KL(behaviour || current) on sampled tokens
            "behaviour_kl_k3": float((torch.exp(-diff) + diff - 1).mean()),  # k3: non-negative, lower variance
        }
        if kl is not None:
            stats["ref_kl"] = float(kl.mean())
    return stats
