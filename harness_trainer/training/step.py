"""One optimizer step on finished groups: the maths of GRPO next to the code that runs it.

    rewards -> advantages per group (A_i = r_i - mean(r))           training/grpo.py: group_advantages
    -> chains (each rollout's turns as token rows, prefix shared)    training/packing.py: chains_from_trace
    -> one prefix tree of the step's tokens                          training/packing.py: pack
    -> logprobs of the tree, in micro-batches, memory linear in it   training/tree_forward.py
    -> loss = token mean over every trained token of the step        training/grpo.py: policy_loss
    -> AdamW step, then the trust region: a step that moves a trained token's probability by more than
       step_clip, or its batch by more than max_step_kl mean KL, is shortened to the largest scale inside
       (or not taken)                                                training/trust_region.py

Functions of the policy, typed by what they read of it (protocols.py: Learner), called as Policy.step.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from dataclasses import dataclass

import torch

from harness_trainer.rollouts.session import RolloutRecord
from harness_trainer.traces.files import TrainingTrace
from harness_trainer.training.distributed import all_reduce, all_reduce_gradients
from harness_trainer.training.grpo import Sequences, group_advantages, policy_loss, sample_std
from harness_trainer.training.packing import chains_from_trace, pack
from harness_trainer.training.protocols import Learner
from harness_trainer.training.sharding import gathered, is_sharded
from harness_trainer.training.tree_forward import plan_ranges, tree_backward, tree_logprobs
from harness_trainer.training.trust_region import bound_step, room_in


@dataclass
class Batch:
    """A step's groups as training input: every rollout's chains (prefix shared), one advantage per rollout, each
    rollout's trained tokens (a "sequence" of the loss; 0 for one left out by mask_truncated_completions), the
    global count of trained tokens (the loss's denominator on every rank) and the step's reward metrics."""
    chains: list
    advantages: list[float]
    lengths: list[int]
    total: int
    metrics: dict


def batch_from_groups(groups: list[list[RolloutRecord]], scale_rewards: str = "none", mask_truncated: bool = False,
                      distill: bool = False) -> Batch:
    """Scored groups (rollouts/pool.py scores them) -> advantages per group -> chains; the reward metrics.
    `distill`: a group whose rewards are all equal still trains (on its teacher's signal, distill.py)."""
    seen: set = set()
    chains, advantages, rewards_all, verifier, zero_groups, lengths, masked = [], [], [], [], 0, [], 0
    terms: dict[str, list[float]] = {}
    scored = [[r.group_reward for r in records] for records in groups]
    batch_std = sample_std([r for rewards in scored for r in rewards if r is not None])
    for records, rewards in zip(groups, scored):
        for record in records:
            for name, value in (record.reward_terms or {}).items():
                if value is not None:
                    terms.setdefault(name, []).append(value)
        group = group_advantages(rewards, scale_rewards, batch_std)
        rewards_all += [r for r in rewards if r is not None]
        verifier += [r.outcome.env_reward for r in records if r.outcome.env_reward is not None]
        zero_groups += group.zero_variance
        for record, adv in zip(records, group.advantages):
            if not record.training_trace:
                continue
            trace = TrainingTrace.model_validate(record.training_trace)
            lengths.append(sum(sum(t.loss_mask[len(t.prompt_token_ids):]) for t in trace.turns))
            if adv is None or (group.zero_variance and not distill):
                continue
            if mask_truncated and record.truncated:  # in its group's mean, not in the loss (a sequence of 0)
                masked += 1
                advantages.append(adv)
                continue
            chains += chains_from_trace(trace, len(advantages), seen)
            advantages.append(adv)
    trained = [0] * len(advantages)
    for chain in chains:
        trained[chain.rollout] += sum(chain.trained)
    metrics = {"groups": len(groups), "rollouts": sum(map(len, groups)),
               "failed": sum(r.status == "unscorable" for g in groups for r in g),
               "reward_mean": _mean(rewards_all), "reward_max": max(rewards_all, default=None),
               "verifier_reward_mean": _mean(verifier), "scorable": len(rewards_all),
               "zero_variance": zero_groups == len(groups), "zero_variance_groups": zero_groups,
               "truncated": sum(bool(r.truncated) for g in groups for r in g), "truncated_masked": masked,
               "completion_tokens_mean": _mean(lengths)}
    for name, values in terms.items():  # each reward function on its own curve
        metrics[f"rewards/{name}/mean"] = _mean(values)
        metrics[f"rewards/{name}/std"] = statistics.pstdev(values)
    return Batch(chains, advantages, trained, sum(trained), metrics)


def train_on(policy: Learner, groups: list[list[RolloutRecord]], step: int) -> dict:
    """One optimizer step on finished, scored groups, each with its own advantages; the loss is the token
    mean over every trained token of the step. Every rank runs it on the same groups."""
    batch = batch_from_groups(groups, policy.args.scale_rewards, policy.args.mask_truncated_completions,
                              distill=bool(policy.loss_cfg.distillation_weight))
    metrics = batch.metrics | {"lr": policy.lr_at(step)}
    if batch.total == 0:
        return metrics | {"trained_tokens": 0}
    # This rank's share: whole rollouts, so a fork's supervised-once bookkeeping stays within one rank.
    chains = [c for c in batch.chains if c.rollout % policy.world_size == policy.rank]
    policy.model.train()
    policy.optimizer.zero_grad()
    loss, stats, tree, logp = _backward(policy, chains, batch)
    if is_sharded(policy.model):
        loss = all_reduce(loss.detach(), policy.world_size)  # the gradients were reduce-scattered
    elif policy.world_size > 1:
        loss = all_reduce_gradients(policy.model, loss.detach())
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.params, policy.args.max_grad_norm)
    for param_group in policy.optimizer.param_groups:
        param_group["lr"] = metrics["lr"]
    bounded = policy.args.step_clip is not None or policy.args.max_step_kl is not None
    before = [p.detach().clone() for p in policy.params] if bounded else None
    policy.optimizer.step()
    if before is not None:  # the trust region for fresh tokens (harness_trainer/training/trust_region.py)
        old = None if logp is None else logp.detach()
        stats |= bound_step(policy.params, before, lambda: _step_change(policy, tree, old),
                            lambda change: room_in(change, policy.args.step_clip, policy.args.max_step_kl,
                                                   policy.args.step_clip_mode))
    if hasattr(grad_norm, "full_tensor"):  # a DTensor (FSDP): the norm over every rank's shard
        grad_norm = grad_norm.full_tensor()
    return metrics | stats | {"loss": float(loss.detach()), "grad_norm": float(grad_norm),
                              "trained_tokens": batch.total}


def _backward(policy: Learner, chains: list, batch: Batch):
    """This rank's chains packed into one prefix tree, its loss's gradients accumulated in micro-batches;
    (loss, stats, tree, logprobs). A rank with nothing to train still joins FSDP's collectives."""
    loss, stats, tree, logp = torch.zeros((), device=policy.device), {}, None, None
    packed = pack(chains) if chains else None
    with gathered(policy.model, train=True):  # FSDP: the whole model here, gradients reduced on the way out
        if packed is not None and packed.trained.any():
            tree, budget, temperature, cfg = packed, policy.args.max_tokens_per_microbatch, policy.args.temperature, \
                policy.loss_cfg
            rollout = tree.rollout[tree.trained]
            adv = torch.tensor(batch.advantages)[rollout].to(policy.device)
            behaviour = tree.behaviour[tree.trained].to(policy.device)
            seqs = Sequences(rollout.to(policy.device), torch.tensor(batch.lengths, dtype=torch.float32,
                                                                     device=policy.device))
            reference = _reference_logprobs(policy, tree) if policy.args.beta else None
            teacher = tree.teacher[tree.trained].to(policy.device) if cfg.distillation_weight else None

            def part(index: torch.Tensor) -> dict:
                return dict(sequences=seqs.subset(index), reference=None if reference is None else reference[index],
                            teacher=None if teacher is None else teacher[index])

            if cfg.whole_batch:  # a token's loss needs the whole batch's logprobs: measure them first
                loss_fn = _gradient_at(policy, tree, cfg, behaviour, adv, batch.total, seqs, reference, teacher)
            else:  # one update per batch: the proximal policy is the model as it is now (the forward's own, detached)
                def loss_fn(logp_part: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
                    return policy_loss(logp_part, behaviour[index], adv[index], cfg, batch.total,
                                       proximal=logp_part.detach(), **part(index))[0]

            logp, entropy = tree_backward(policy.model, tree, loss_fn, temperature, budget)
            loss, stats = policy_loss(logp, behaviour, adv, cfg, batch.total, proximal=logp, sequences=seqs,
                                      reference=reference, entropy=entropy, teacher=teacher)
            stats |= {"tree_tokens": len(tree), "row_tokens": tree.chain_tokens, "entropy": float(entropy.mean()),
                      "entropy_max": float(entropy.max()), "microbatches": len(plan_ranges(tree, budget))}
        elif policy.args.beta:
            with gathered(policy.ref_model):  # its all-gather is collective: a rank with nothing takes part
                pass
    return loss, stats, tree, logp


def _gradient_at(policy: Learner, tree, cfg, behaviour, adv, total: int, seqs: Sequences, reference, teacher):
    """For a loss that is not a sum of per-token terms (sequence ratios and IS weights, the off-policy mask, the
    entropy quantile): the whole tree's logprobs and entropies first (no gradient, as TRL computes its old
    logprobs), then d loss / d logp_t there. The backward of sum_t g_t logp_t in any micro-batches is then the
    loss's own gradient (the chain rule: the loss depends on the weights only through the logprobs)."""
    with torch.no_grad():
        now, entropy = tree_logprobs(policy.model, tree, policy.args.temperature, entropy=True,
                                     max_tokens=policy.args.max_tokens_per_microbatch)
    at = now.detach().clone().requires_grad_()
    loss, _ = policy_loss(at, behaviour, adv, cfg, total, proximal=now.detach(), sequences=seqs,
                          reference=reference, entropy=entropy, teacher=teacher)
    (g,) = torch.autograd.grad(loss, at)
    return lambda logp_part, index: (g[index] * logp_part).sum()


def _reference_logprobs(policy: Learner, tree) -> torch.Tensor:
    """The starting policy's logprobs on the tree (with LoRA: the same model, its adapter disabled)."""
    with torch.no_grad(), (policy.peft.disable_adapter() if policy.peft else contextlib.nullcontext()):
        with gathered(policy.ref_model):
            return tree_logprobs(policy.ref_model or policy.model, tree, policy.args.temperature,
                                 max_tokens=policy.args.max_tokens_per_microbatch)


def _step_change(policy: Learner, tree, old: torch.Tensor | None) -> dict:
    """How far the step moved the policy on its own trained tokens, over every rank: mean k3 KL(before ||
    after), the smallest and largest ratio p_after / p_before, and the largest |p_after - p_before|."""
    sums = torch.zeros(2, dtype=torch.float64, device=policy.device)
    extremes = torch.full((3,), -float("inf"), dtype=torch.float64, device=policy.device)  # -min, max log r; |dp|
    with torch.no_grad(), gathered(policy.model):  # FSDP: every rank gathers, whether it has a tree or not
        new = None if tree is None else tree_logprobs(policy.model, tree, policy.args.temperature,
                                                      max_tokens=policy.args.max_tokens_per_microbatch).double()
    if tree is not None:
        diff = new - old.double()
        sums += torch.stack([(torch.exp(diff) - 1 - diff).sum(), diff.new_tensor(float(diff.numel()))])
        extremes = torch.maximum(extremes, torch.stack([(-diff).max(), diff.max(),
                                                        (new.exp() - old.double().exp()).abs().max()]))
    all_reduce(sums, policy.world_size)
    all_reduce(extremes, policy.world_size, op="max")
    return {"kl": float(sums[0] / sums[1].clamp(min=1)), "ratio_min": math.exp(-float(extremes[0])),
            "ratio_max": math.exp(float(extremes[1])), "prob_move": max(float(extremes[2]), 0.0)}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
