"""Group-relative advantages and the policy loss, in TRL's vocabulary (GRPOConfig's names, TRL's meanings).

Advantages, per group of `num_generations` rollouts of one task (scale_rewards):
    none   A_i = r_i - mean(r)                               (our default: Dr. GRPO's, the proofs' setting)
    group  A_i = (r_i - mean(r)) / (std(r) + 1e-4)           (TRL's default; std with Bessel's correction)
    batch  A_i = (r_i - mean(r)) / (std(all rewards of the step) + 1e-4)
Unscorable rollouts (r = None) are left out of the mean and get no advantage. A group whose scorable rewards are
all equal gives no gradient; it is counted, not hidden (and with dynamic sampling, replaced).

The loss, per trained token t of sequence s (a sequence is one rollout: every trained token of all its turns,
as TRL's multi-turn completion is one sequence with its tool outputs masked). b_t: the behaviour logprob (what
the engine sampled with, from the trace); o_t: the proximal ("old") logprob, the policy at the step's start (one
update per batch: the current policy, detached); p_t: the current logprob; A_t: the advantage.

    log w      = p_t - o_t                                     importance_sampling_level token
               = mean_{t in s}(p_t - o_t)                      importance_sampling_level sequence (GSPO)
    coef_1     = exp(log w),   coef_2 = clip(coef_1, 1 - epsilon, 1 + epsilon_high)
    grpo, dr_grpo, dapo, bnpo, luspo:  l_t = -min(min(coef_1, delta) * A, coef_2 * A)   (delta: INTELLECT-2's)
    cispo:     l_t = -sg(min(coef_1, epsilon_high)) * A * p_t                            (MiniMax-M1)
    sapo:      l_t = -(4 / tau) * sigmoid(tau * (coef_1 - 1)) * A,  tau = sapo_temperature_pos|neg by sign of A
    masks      off_policy_mask_threshold: a sequence with A < 0 whose mean(b - p) > threshold is dropped
               top_entropy_quantile: only tokens whose entropy is in the step's top quantile train
               behaviour_clip (ours): no gradient where exp(p - b) left [1 - epsilon, 1 + epsilon_high] in A's
               direction: with one update per batch coef_1 is 1 and its clip never binds, so this is what keeps
               a stale batch from pushing a token the policy already moved
    IS         vllm_importance_sampling_correction: l_t *= rho, rho = exp(o_t - b_t) (token_*) or
               exp(sum_{t in s}(o_t - b_t)) (sequence_*), truncated to [clip_min, clip_max] (*_truncate) or
               zeroed outside it (*_mask)
    KL         + beta * k3(ref, p), k3 = exp(ref - p) - (ref - p) - 1, times coef_1 (use_bias_correction_kl)
    aggregate  grpo, sapo: mean over sequences of each one's token mean; dr_grpo: sum / (S * max_completion_length);
               dapo, bnpo, cispo: sum / trained tokens; luspo: sum / S   (S: the step's sequences)
Our step is TRL's with the whole step in one batch (one process, no accumulation), so dapo and bnpo coincide.
tests/training/test_trl_parity.py runs TRL 1.16's own code on the same tensors: loss and gradient equal to 1e-6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness_trainer.choices import choose, flag
from harness_trainer.training.config import choices_of

SEQUENCE_AGGREGATES = ("grpo", "sapo", "dr_grpo", "luspo")  # need to know which sequence a token is in


@dataclass
class GroupAdvantages:
    advantages: list[float | None]
    zero_variance: bool  # scorable rewards all equal: no learning signal from this group
    scorable: int


def sample_std(values: list[float]) -> float:
    """TRL's nanstd: the standard deviation with Bessel's correction (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def group_advantages(rewards: list[float | None], scale: str = "none", batch_std: float | None = None,
                     eps: float = 1e-6) -> GroupAdvantages:
    """`scale`: none, group or batch (then `batch_std`: the step's reward std, sample_std of all its rewards)."""
    scored = [r for r in rewards if r is not None]
    if not scored:
        return GroupAdvantages([None] * len(rewards), True, 0)
    mean = sum(scored) / len(scored)
    zero = max(scored) - min(scored) < eps
    divisor = {"none": 1.0, "group": sample_std(scored) + 1e-4, "batch": (batch_std or 0.0) + 1e-4}[scale]
    advantages = [None if r is None else 0.0 if zero else (r - mean) / divisor for r in rewards]
    return GroupAdvantages(advantages, zero, len(scored))


@dataclass
class LossConfig:
    """The loss's settings; AsyncGRPOConfig's fields of the same names (training/config.py) say what each does."""
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    importance_sampling_level: str = "token"
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "token_truncate"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 2.0
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    max_completion_length: int = 1024  # dr_grpo's constant
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    behaviour_clip: bool = True
    distillation_weight: float = 0.0  # with teacher logprobs: the share of the reverse-KL advantage (distill.py)
    ratio_to: str = "proximal"  # or "behaviour": the deprecated loss_mode ppo (coef_1 = exp(p - b), no IS weight)

    @classmethod
    def from_args(cls, args) -> LossConfig:
        names = cls.__dataclass_fields__.keys() - {"ratio_to", "epsilon_high", "distillation_weight"}
        high = args.epsilon if args.epsilon_high is None else args.epsilon_high  # TRL: epsilon_high defaults to it
        return cls(**{n: getattr(args, n) for n in names}, epsilon_high=high,
                   distillation_weight=args.distillation_weight if getattr(args, "teacher_url", None) else 0.0,
                   ratio_to="behaviour" if getattr(args, "loss_mode", None) == "ppo" else "proximal")

    def __post_init__(self):  # built from a checked config, or by hand (the parity tests): the same rules
        for name, allowed in choices_of(self.__dataclass_fields__).items():
            choose(flag(name), getattr(self, name), allowed)

    @property
    def whole_batch(self) -> bool:
        """Does a token's loss depend on other tokens' current logprobs or entropies (a sequence's mean ratio, a
        sequence IS ratio, the off-policy mask, the entropy quantile)? Then the step measures the whole batch
        first (training/step.py), as TRL computes its old logprobs before the loss."""
        sequence_is = self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode.startswith(
            "sequence")
        return (self.importance_sampling_level == "sequence" or sequence_is
                or self.off_policy_mask_threshold is not None or self.top_entropy_quantile < 1.0)


@dataclass
class Sequences:
    """Which sequence (rollout) each trained token belongs to, and each sequence's trained tokens in the step."""
    index: torch.Tensor  # [N] long
    lengths: torch.Tensor  # [S] float: trained tokens of each sequence over the whole step (0: masked out)

    def subset(self, positions: torch.Tensor) -> Sequences:
        return Sequences(self.index[positions], self.lengths)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """Per token, the mean of x over its sequence's tokens present here (the whole batch)."""
        return self.sum(x) / self.lengths.clamp(min=1.0)[self.index]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        sums = torch.zeros(len(self.lengths), dtype=x.dtype, device=x.device).index_add(0, self.index, x)
        return sums[self.index]


def policy_loss(logp: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig,
                total_tokens: int, proximal: torch.Tensor | None = None, reference: torch.Tensor | None = None,
                sequences: Sequences | None = None, entropy: torch.Tensor | None = None,
                teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The step's loss over these trained tokens (flat [N] tensors; `total_tokens`: the step's trained tokens,
    the dapo/bnpo/cispo denominator), and statistics. `proximal` defaults to logp detached (TRL's old logprobs
    when it does not recompute them). Token-wise losses may be called on a part of the step's tokens and summed;
    with cfg.whole_batch the call must hold the whole batch. `teacher`: the teacher's logprobs of these tokens
    (NaN where none), mixed into the advantage by cfg.distillation_weight (training/distill.py)."""
    needs_sequences = cfg.loss_type in SEQUENCE_AGGREGATES or cfg.whole_batch
    if sequences is None and needs_sequences:
        raise ValueError(f"loss_type {cfg.loss_type} with these settings needs each token's sequence (sequences=)")
    old = behaviour if cfg.ratio_to == "behaviour" else logp.detach() if proximal is None else proximal
    log_w = logp - old
    if cfg.importance_sampling_level == "sequence":
        log_w = sequences.mean(log_w)
    coef_1 = torch.exp(log_w)
    adv, gap = advantages, None
    if teacher is not None and cfg.distillation_weight:  # reverse KL on the student's own tokens, as an advantage
        gap = torch.nan_to_num(teacher - logp.detach(), nan=0.0)
        adv = (1 - cfg.distillation_weight) * advantages + cfg.distillation_weight * gap
    if cfg.loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=cfg.epsilon_high).detach() * adv * logp
    elif cfg.loss_type == "sapo":
        tau = torch.where(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        per_token = -(torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau) * adv
    else:
        coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
        upper = coef_1 if cfg.delta is None else torch.clamp(coef_1, max=cfg.delta)
        per_token = -torch.minimum(upper * adv, coef_2 * adv)
    keep, outside = _masks(logp, behaviour, adv, cfg, sequences, entropy)
    per_token = per_token * keep
    rho = _is_ratio(old, behaviour, cfg, sequences)
    per_token = per_token * rho
    kl = None
    if reference is not None:
        diff = reference - logp
        kl = torch.exp(diff) - diff - 1
        per_token = per_token + cfg.beta * (kl * coef_1 if cfg.use_bias_correction_kl else kl)
    loss = (per_token * _token_weights(cfg, total_tokens, sequences)).sum()
    stats = _stats(logp, behaviour, coef_1, rho, adv, outside, keep, kl, cfg)
    if gap is not None and logp.numel():
        scored = ~torch.isnan(teacher)
        stats["distill_kl"] = float(-gap[scored].mean()) if scored.any() else None  # k1 of KL(student || teacher)
        stats["distill_scored_frac"] = float(scored.float().mean())
    return loss, stats


def _masks(logp, behaviour, adv, cfg: LossConfig, sequences: Sequences | None, entropy) -> tuple:
    """The tokens that train (1) or not (0): behaviour clip, off-policy sequences, low-entropy tokens."""
    with torch.no_grad():
        behaviour_ratio = torch.exp(logp - behaviour)
        outside = ((behaviour_ratio > 1 + cfg.epsilon_high) & (adv > 0)) | \
                  ((behaviour_ratio < 1 - cfg.epsilon) & (adv < 0))
        keep = torch.ones_like(logp)
        if cfg.behaviour_clip and cfg.ratio_to == "proximal":
            keep = keep * ~outside
        if cfg.off_policy_mask_threshold is not None:  # DeepSeek-V3.2's off-policy sequence mask
            seq_kl = sequences.mean(torch.nan_to_num(behaviour - logp, nan=0.0))
            keep = keep * ((adv >= 0) | (seq_kl <= cfg.off_policy_mask_threshold))
        if cfg.top_entropy_quantile < 1.0:
            if entropy is None:
                raise ValueError("top_entropy_quantile < 1 needs the tokens' entropies (entropy=)")
            if entropy.numel():
                keep = keep * (entropy >= torch.quantile(entropy.float(), 1 - cfg.top_entropy_quantile))
    return keep, outside


def _is_ratio(old, behaviour, cfg: LossConfig, sequences: Sequences | None) -> torch.Tensor:
    """rho: the importance weight of the proximal policy to the one that sampled (1 when off)."""
    if not cfg.vllm_importance_sampling_correction or cfg.ratio_to == "behaviour":
        return torch.ones_like(old)
    with torch.no_grad():
        diff = torch.nan_to_num(old - behaviour, nan=0.0)  # a token the engine could not score: no correction
        mode = cfg.vllm_importance_sampling_mode
        rho = torch.exp(sequences.sum(diff) if mode.startswith("sequence") else diff)
        low, high = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
        if mode.endswith("truncate"):
            return torch.clamp(rho, min=low, max=high)
        low, high = -math.inf if low is None else low, math.inf if high is None else high
        return rho.masked_fill((rho < low) | (rho > high), 0.0)


def _token_weights(cfg: LossConfig, total_tokens: int, sequences: Sequences | None):
    """The aggregation as a weight per token, so a loss over part of the step's tokens is that part's share."""
    if cfg.loss_type in ("dapo", "bnpo", "cispo"):
        return 1.0 / max(total_tokens, 1)
    count = len(sequences.lengths)
    if cfg.loss_type in ("grpo", "sapo"):
        return 1.0 / (sequences.lengths.clamp(min=1.0)[sequences.index] * count)
    if cfg.loss_type == "dr_grpo":
        return 1.0 / (count * cfg.max_completion_length)
    return 1.0 / count  # luspo


def _stats(logp, behaviour, coef_1, rho, advantages, outside, keep, kl, cfg: LossConfig) -> dict:
    """What a run needs to see coming trouble: how far the policy is from the one that sampled (KL, ratios),
    how much of the batch the trust region and the masks cut, and the importance weights."""
    if not logp.numel():
        return {}
    with torch.no_grad():
        n = logp.numel()
        diff = behaviour - logp.detach()
        behaviour_ratio = torch.exp(-diff)
        bound = cfg.vllm_importance_sampling_clip_max
        stats = {
            "ratio_mean": float(coef_1.mean()),
            "clip_low_frac": float(((coef_1 < 1 - cfg.epsilon) & (advantages < 0)).sum()) / n,
            "clip_high_frac": float(((coef_1 > 1 + cfg.epsilon_high) & (advantages > 0)).sum()) / n,
            "behaviour_ratio_mean": float(behaviour_ratio.mean()),
            "behaviour_ratio_max": float(behaviour_ratio.max()),
            "behaviour_ratio_min": float(behaviour_ratio.min()),
            "behaviour_clip_frac": float(outside.sum()) / n,  # tokens outside the behaviour policy's range
            "masked_frac": float((keep == 0).sum()) / n,  # tokens with no gradient from any mask
            "is_weight_mean": float(rho.mean()),
            "is_weight_max": float(rho.max()),
            "is_truncated_frac": float(((rho == bound) | (rho == 0)).sum()) / n if bound is not None else 0.0,
            "behaviour_kl": float(diff.mean()),  # k1 estimate of KL(behaviour || current) on sampled tokens
            "behaviour_kl_k3": float((torch.exp(-diff) + diff - 1).mean()),  # k3: non-negative, lower variance
        }
        if kl is not None:
            stats["ref_kl"] = float(kl.mean())
    return stats
