"""Our loss against TRL 1.16's own code, run on the same tensors: value and gradient to 1e-6.

TRL's side is GRPOTrainer._compute_loss itself (and, for the vLLM importance-sampling ratio, the lines of
_generate_and_score_completions that compute it, read from TRL's source and run as they are), called on a
stand-in trainer that holds the settings: one process, no gradient accumulation, no vLLM engine behind it.
The model forward is replaced by the batch's logprobs, a leaf tensor, so both gradients are d loss / d logp.

How the layouts are matched: TRL's batch is B padded sequences [B, T] with a completion mask; ours is the flat
list of trained tokens with each token's sequence (a rollout: every trained token of all its turns, which is
what TRL's multi-turn completion with its tool mask is), and the step's token count. The flat tokens are the
mask's True positions in row order.
"""

from __future__ import annotations

import inspect
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from harness_trainer.training.grpo import LossConfig, Sequences, policy_loss

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
GRPOTrainer = trl_grpo.GRPOTrainer

LENGTHS = [5, 3, 7, 1, 6]
T = max(LENGTHS)
DTYPE = torch.float64


def _batch(seed: int, fresh: bool):
    """Logprobs (the leaf), old, sampling and reference logprobs, entropies, advantages, the mask."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[t < n for t in range(T)] for n in LENGTHS])
    current = -torch.rand(len(LENGTHS), T, generator=g, dtype=DTYPE) * 3 - 0.05
    # `fresh`: one update per batch, old = current (our step); else the old policy is a step away
    old = current.clone() if fresh else current + torch.randn(current.shape, generator=g, dtype=DTYPE) * 0.15
    sampling = old + torch.randn(current.shape, generator=g, dtype=DTYPE) * 0.3
    reference = current + torch.randn(current.shape, generator=g, dtype=DTYPE) * 0.2
    entropy = torch.rand(current.shape, generator=g, dtype=DTYPE) * 2
    advantages = torch.tensor([0.8, -0.5, 0.3, -1.2, 0.0], dtype=DTYPE)
    return mask, current, old, sampling, reference, entropy, advantages


def _is_ratio_by_trl(stand_in, mask, old, sampling):
    """TRL's vLLM importance-sampling ratio: its own lines, cut from its source between two of its comments."""
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start = source.index("            # Compute the importance sampling ratio when using vLLM")
    end = source.index("            # Compute the per-token log probabilities for the reference model")
    scope = {"self": stand_in, "completion_mask": mask.to(DTYPE), "tool_mask": None, "torch": torch, "math": math,
             "old_per_token_logps": old, "sampling_per_token_logps": sampling}
    exec(compile(textwrap.dedent(source[start:end]), "trl_is_ratio", "exec"), scope)
    return scope["vllm_importance_sampling_ratio"]


def _trl_loss(cfg: LossConfig, leaf, mask, old, sampling, reference, entropy, advantages):
    padded = torch.zeros(mask.shape, dtype=DTYPE).masked_scatter(mask, leaf)  # the "forward": our leaf, padded
    same = lambda x, **_: x  # noqa: E731  (one process: gather and pad are the identity)
    accelerator = SimpleNamespace(num_processes=1, gather=same, gather_for_metrics=same, pad_across_processes=same,
                                  reduce=same)
    args = SimpleNamespace(delta=cfg.delta, use_bias_correction_kl=cfg.use_bias_correction_kl,
                           sapo_temperature_pos=cfg.sapo_temperature_pos,
                           sapo_temperature_neg=cfg.sapo_temperature_neg, steps_per_generation=1)
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (padded, entropy, None),
        top_entropy_quantile=cfg.top_entropy_quantile, off_policy_mask_threshold=cfg.off_policy_mask_threshold,
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask, importance_sampling_level=cfg.importance_sampling_level,
        beta=cfg.beta, args=args, loss_type=cfg.loss_type, epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high,
        use_vllm=True, vllm_importance_sampling_correction=cfg.vllm_importance_sampling_correction,
        vllm_importance_sampling_mode=cfg.vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_min=cfg.vllm_importance_sampling_clip_min,
        vllm_importance_sampling_clip_max=cfg.vllm_importance_sampling_clip_max,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=cfg.max_completion_length, accelerator=accelerator, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)))
    stand_in.get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask.__get__(stand_in)
    inputs = {"prompt_ids": torch.ones(len(LENGTHS), 1, dtype=torch.long), "prompt_mask": torch.ones(len(LENGTHS), 1),
              "completion_ids": torch.ones(mask.shape, dtype=torch.long), "completion_mask": mask.to(DTYPE),
              "advantages": advantages, "old_per_token_logps": old, "sampling_per_token_logps": sampling,
              "ref_per_token_logps": reference, "num_items_in_batch": mask.sum().to(DTYPE)}
    if cfg.vllm_importance_sampling_correction:
        inputs["importance_sampling_ratio"] = _is_ratio_by_trl(stand_in, mask, old, sampling)
    return GRPOTrainer._compute_loss(stand_in, None, inputs)


def _our_loss(cfg: LossConfig, leaf, mask, old, sampling, reference, entropy, advantages):
    rows = torch.arange(len(LENGTHS))[:, None].expand(mask.shape)[mask]
    sequences = Sequences(rows, mask.sum(1).to(DTYPE))
    return policy_loss(leaf, sampling[mask], advantages[rows], cfg, int(mask.sum()), proximal=old[mask],
                       reference=reference[mask] if cfg.beta else None, sequences=sequences,
                       entropy=entropy[mask])[0]


CASES = {  # every option TRL also has; behaviour_clip is ours alone and off here
    **{f"loss_type={t}": dict(loss_type=t) for t in ("grpo", "dr_grpo", "dapo", "bnpo", "sapo")},
    "loss_type=cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "loss_type=luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    **{f"is_mode={m}": dict(vllm_importance_sampling_mode=m, vllm_importance_sampling_clip_min=0.6,
                            vllm_importance_sampling_clip_max=1.5)
       for m in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")},
    "is_mode=sequence_mask-trl-defaults": dict(vllm_importance_sampling_mode="sequence_mask",
                                               vllm_importance_sampling_clip_max=3.0),
    "is_correction_off": dict(vllm_importance_sampling_correction=False),
    "level=sequence": dict(importance_sampling_level="sequence"),
    "level=sequence-grpo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "epsilon=0.3,epsilon_high=0.1": dict(epsilon=0.3, epsilon_high=0.1),
    "delta=1.1": dict(delta=1.1, epsilon=0.05, epsilon_high=0.05),
    "beta=0.1": dict(beta=0.1),
    "beta=0.1-no-bias-correction": dict(beta=0.1, use_bias_correction_kl=False),
    "beta-sequence-level": dict(beta=0.05, importance_sampling_level="sequence"),
    "off_policy_mask": dict(off_policy_mask_threshold=0.05),
    "top_entropy_quantile=0.3": dict(top_entropy_quantile=0.3),
    "dr_grpo-everything": dict(loss_type="dr_grpo", beta=0.05, off_policy_mask_threshold=0.05,
                               top_entropy_quantile=0.5, vllm_importance_sampling_mode="sequence_truncate"),
}


@pytest.mark.parametrize("fresh", [True, False], ids=["old=current", "old=a-step-ago"])
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_equal_trls(case, fresh):
    cfg = LossConfig(**{"behaviour_clip": False, "max_completion_length": T, **CASES[case]})
    mask, current, old, sampling, reference, entropy, advantages = _batch(sum(map(ord, case)), fresh)
    values, grads = [], []
    for fn in (_trl_loss, _our_loss):
        leaf = current[mask].clone().requires_grad_()
        loss = fn(cfg, leaf, mask, old, sampling, reference, entropy, advantages)
        loss.backward()
        values.append(float(loss.detach()))
        grads.append(leaf.grad)
    assert values[1] == pytest.approx(values[0], abs=1e-6), case
    assert torch.allclose(grads[1], grads[0], atol=1e-6), (case, float((grads[1] - grads[0]).abs().max()))
    assert grads[0].abs().sum() > 0 or case == "off_policy_mask", "a case that trains nothing proves nothing"


def test_the_cases_bind():
    """Each option changes the loss or its gradient against the default, on the batch its case runs on: the
    parity above is not the default compared with itself (dapo is the default; bnpo is dapo over one batch)."""
    for case, settings in CASES.items():
        if case in ("loss_type=dapo", "loss_type=bnpo"):
            continue
        mask, current, old, sampling, reference, entropy, advantages = _batch(sum(map(ord, case)), False)
        out = []
        for cfg in (LossConfig(behaviour_clip=False, max_completion_length=T),
                    LossConfig(**{"behaviour_clip": False, "max_completion_length": T, **settings})):
            leaf = current[mask].clone().requires_grad_()
            loss = _our_loss(cfg, leaf, mask, old, sampling, reference, entropy, advantages)
            loss.backward()
            out.append((float(loss.detach()), leaf.grad))
        assert out[0][0] != pytest.approx(out[1][0], abs=1e-9) or not torch.allclose(out[0][1], out[1][1]), case
