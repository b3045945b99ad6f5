"""The trainer's maths: advantages (None, zero variance), each loss mode against hand-computed values, and
prefix-shared packing against naive one-row-per-chain rows (same loss and gradients, to 1e-5)."""

from __future__ import annotations

import math

import pytest
import torch
from openenv.core.harness.training import TrainingTrace

from harness_trainer.training.grpo import LossConfig, group_advantages, policy_loss
from harness_trainer.training.packing import chain_logprobs, chains_from_trace, pack
from harness_trainer.training.tree_forward import tree_logprobs


def test_group_advantages_skip_none_and_flag_zero_variance():
    g = group_advantages([1.0, 0.0, None, 1.0])
    assert g.advantages == pytest.approx([1 / 3, -2 / 3, None, 1 / 3]) and not g.zero_variance and g.scorable == 3
    s = group_advantages([1.0, 0.0], scale="group")  # TRL's: std with Bessel's correction (0.707), + 1e-4
    assert s.advantages == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4)])
    b = group_advantages([1.0, 0.0], scale="batch", batch_std=2.0)
    assert b.advantages == pytest.approx([0.5 / 2.0001, -0.5 / 2.0001])
    z = group_advantages([0.5, 0.5, None])
    assert z.zero_variance and z.advantages == [0.0, 0.0, None]
    assert group_advantages([None, None]).advantages == [None, None]


def test_ppo_loss_by_hand():
    logp = torch.tensor([math.log(0.5), math.log(0.9)])
    behaviour = torch.tensor([math.log(0.25), math.log(0.9)])
    adv = torch.tensor([1.0, -2.0])
    loss, stats = policy_loss(logp, behaviour, adv, LossConfig(ratio_to="behaviour"), total_tokens=4)
    # token 1: ratio 2 -> clipped to 1.2, min(2*1, 1.2*1) = 1.2; token 2: ratio 1 -> -2
    assert float(loss) == pytest.approx(-(1.2 - 2.0) / 4)
    assert stats["clip_high_frac"] == 0.5


@pytest.mark.parametrize("is_mode, expected_weight", [("token_truncate", 2.0), ("token_mask", 0.0)])
def test_decoupled_loss_by_hand(is_mode, expected_weight):
    logp = torch.tensor([math.log(0.3), math.log(0.2)])
    proximal = torch.tensor([math.log(0.3), math.log(0.25)])
    behaviour = torch.tensor([math.log(0.1), math.log(0.25)])  # token 1 is stale: w = 3 > bound 2
    adv = torch.tensor([1.0, 1.0])
    loss, stats = policy_loss(logp, behaviour, adv, LossConfig(vllm_importance_sampling_mode=is_mode,
                                                                vllm_importance_sampling_clip_max=2.0,
                                                                behaviour_clip=False),
                              total_tokens=2, proximal=proximal)
    # token 1: ratio 1, weight 3 -> truncated 2 (tis) or masked 0 (mis); token 2: ratio 0.8, weight 1
    assert float(loss) == pytest.approx(-(expected_weight * 1.0 + 1.0 * 0.8) / 2)
    # no proximal logprobs: TRL's old logprobs when it does not recompute them, the current ones detached
    alone, _ = policy_loss(logp, behaviour, adv, LossConfig(), total_tokens=2)
    assert float(alone) == pytest.approx(float(policy_loss(logp, behaviour, adv, LossConfig(), 2, proximal=logp)[0]))


def test_trust_region_binds_on_a_stale_batch_by_hand():
    """One update per batch: the proximal policy is the current one, so only the behaviour clip can bind."""
    behaviour = torch.log(torch.tensor([0.1, 0.5, 0.5, 0.5]))
    current = torch.log(torch.tensor([0.3, 0.25, 0.55, 0.25]))  # ratios to behaviour: 3, 0.5, 1.1, 0.5
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    grads = {}
    for clip in (True, False):
        logp = current.clone().requires_grad_()
        loss, stats = policy_loss(logp, behaviour, adv, LossConfig(behaviour_clip=clip), total_tokens=4,
                                  proximal=current.clone())
        loss.backward()
        grads[clip] = logp.grad
        if clip:
            # token 1 (ratio 3, A > 0) and token 2 (ratio 0.5, A < 0) have left the trust region: no gradient.
            # tokens 3 and 4 keep theirs: ratio 1 to the proximal policy, weight w = min(ratio to behaviour, 2)
            assert float(loss.detach()) == pytest.approx(-(1.1 * 1.0 + 0.5 * 1.0) / 4)
            assert stats["behaviour_clip_frac"] == 0.5 and stats["is_truncated_frac"] == 0.25
            assert stats["behaviour_ratio_max"] == pytest.approx(3.0)
            assert stats["behaviour_ratio_min"] == pytest.approx(0.5)
    assert grads[True].tolist() == pytest.approx([0.0, 0.0, -1.1 / 4, -0.5 / 4])
    assert grads[False].tolist() == pytest.approx([-2.0 / 4, 0.5 / 4, -1.1 / 4, -0.5 / 4])  # without: pushed on


def test_kl_to_behaviour_statistics_by_hand():
    logp, behaviour = torch.log(torch.tensor([0.5, 0.2])), torch.log(torch.tensor([0.25, 0.2]))
    _, stats = policy_loss(logp, behaviour, torch.ones(2), LossConfig(ratio_to="behaviour"), total_tokens=2)
    # k1 = mean(b - p); k3 = mean(r - 1 - log r) with r = exp(p - b): token 1 r = 2, token 2 r = 1
    assert stats["behaviour_kl"] == pytest.approx(math.log(0.5) / 2)
    assert stats["behaviour_kl_k3"] == pytest.approx((1 - math.log(2)) / 2)


def turn(node, prompt, completion, mask=None, version=0):
    mask = mask or [1] * len(completion)
    return {"node_id": node, "prompt_token_ids": prompt, "completion_token_ids": completion,
            "per_token_logps": [-1.0 - 0.1 * i for i in range(len(completion))],
            "loss_mask": [0] * len(prompt) + mask, "metadata": {"policy_version": version}}


SYSTEM = [1, 5, 6, 7, 8, 9, 10, 11, 2]  # shared by every rollout of the group
TASK = [1, 12, 13, 2]
A1 = turn("a:0", SYSTEM + TASK, [20, 21, 22])
A2 = turn("a:1", SYSTEM + TASK + [20, 21, 22, 30, 31], [23, 24], version=1)             # continues a:0
A3 = turn("a:2", SYSTEM + TASK + [20, 21, 22, 32], [25, 26, 27], mask=[1, 0, 1])       # fork of a:0, partial mask
A4 = turn("a:3", [1, 40, 41, 2] + TASK, [28])                                          # rewritten history: new root
B1 = turn("b:0", SYSTEM + TASK, [50, 51])
B2 = turn("b:1", SYSTEM + TASK + [50, 51, 33], [52, 53, 54])
TRACES = [TrainingTrace.model_validate({"turns": [A1, A2, A3, A4]}),
          TrainingTrace.model_validate({"turns": [B1, B2]})]
ADVANTAGES = torch.tensor([0.7, -0.4])


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return Qwen2ForCausalLM(config)  # float32, as trained


def test_every_sampled_token_trained_exactly_once():
    seen = set()
    chains = [c for i, t in enumerate(TRACES) for c in chains_from_trace(t, i, seen)]
    assert len(chains) == 4  # a:1 leaf, a:2 leaf, a:3 root-leaf, b:1 leaf
    trained = sum(sum(c.trained) for c in chains)
    assert trained == 3 + 2 + 2 + 1 + 2 + 3  # a:0 once although two chains hold it; a:2's masked token not
    tree = pack(chains)
    assert int(tree.trained.sum()) == trained
    assert len(tree) < tree.chain_tokens  # shared system prompt, task and a:0 are fed once


def _loss(logp, behaviour, rollouts, total):
    adv = ADVANTAGES[rollouts]
    return policy_loss(logp, behaviour, adv, LossConfig(ratio_to="behaviour"), total_tokens=total)[0]


def test_prefix_shared_packing_equals_naive_rows(model):
    seen = set()
    chains = [c for i, t in enumerate(TRACES) for c in chains_from_trace(t, i, seen)]
    total = sum(sum(c.trained) for c in chains)

    model.zero_grad()
    tree = pack(chains)
    shared_logp = tree_logprobs(model, tree)
    trained = tree.trained
    shared = _loss(shared_logp, tree.behaviour[trained], tree.rollout[trained], total)
    shared.backward()
    shared_grads = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    naive = 0.0
    for chain in chains:
        if not any(chain.trained):
            continue
        logp = chain_logprobs(model, chain)
        behaviour = torch.tensor([b for b, t in zip(chain.behaviour, chain.trained) if t])
        naive = naive + _loss(logp, behaviour, torch.full((len(logp),), chain.rollout), total)
    naive.backward()

    assert float(shared.detach()) == pytest.approx(float(naive.detach()), abs=1e-5)
    for g_shared, p in zip(shared_grads, model.parameters()):
        assert torch.allclose(g_shared, p.grad, atol=1e-5), float((g_shared - p.grad).abs().max())
    # and the logprobs themselves, token by token (compared as multisets: the orders differ)
    naive_all = torch.cat([chain_logprobs(model, c) for c in chains if any(c.trained)]).detach()
    assert torch.allclose(shared_logp.detach().sort().values, naive_all.sort().values, atol=1e-6)


def test_k3_kl_to_reference_by_hand():
    logp = torch.tensor([math.log(0.5)])
    reference = torch.tensor([math.log(0.25)])
    cfg = LossConfig(ratio_to="behaviour", beta=0.1)
    loss, stats = policy_loss(logp, logp.clone(), torch.tensor([0.0]), cfg, total_tokens=1, reference=reference)
    k3 = 0.5 - math.log(0.5) - 1  # exp(q - p) - (q - p) - 1 with q - p = log(1/2)
    assert stats["ref_kl"] == pytest.approx(k3) and float(loss) == pytest.approx(0.1 * k3)


def test_distillation_advantage_by_hand():
    """A_t = (1 - w) A + w (log p_teacher - log p_student): the teacher's better tokens pushed up, its worse down;
    a token the teacher did not score (NaN) keeps the group advantage's share alone."""
    logp = torch.log(torch.tensor([0.5, 0.5, 0.5])).requires_grad_()
    teacher = torch.log(torch.tensor([0.8, 0.2, float("nan")]))
    cfg = LossConfig(distillation_weight=0.75, behaviour_clip=False)
    loss, stats = policy_loss(logp, logp.detach(), torch.tensor([1.0, 1.0, 1.0]), cfg, total_tokens=3, teacher=teacher)
    loss.backward()
    advantages = [0.25 + 0.75 * math.log(0.8 / 0.5), 0.25 + 0.75 * math.log(0.2 / 0.5), 0.25]
    assert logp.grad.tolist() == pytest.approx([-a / 3 for a in advantages])
    assert stats["distill_kl"] == pytest.approx((math.log(0.5 / 0.8) + math.log(0.5 / 0.2)) / 2)
    assert stats["distill_scored_frac"] == pytest.approx(2 / 3)


def test_teacher_logprobs_reach_the_packed_tree():
    trace = TrainingTrace.model_validate({"turns": [
        A1 | {"metadata": {"teacher_logps": [-0.1, -0.2, -0.3]}},
        A2 | {"metadata": {"policy_version": 1, "teacher_logps": [-0.4, None]}}]})
    tree = pack(chains_from_trace(trace, 0, set()))
    got = tree.teacher[tree.trained].tolist()
    assert got[:4] == pytest.approx([-0.1, -0.2, -0.3, -0.4]) and math.isnan(got[4])


def test_a_truncated_rollout_counts_in_its_group_but_not_in_the_loss():
    """mask_truncated_completions (TRL's): the rollout a limit stopped keeps its place in the group's mean and in
    the count of sequences, and none of its tokens trains."""
    from harness_trainer.rollouts.session import HarnessRolloutOutcome, RolloutRecord
    from harness_trainer.training.step import batch_from_groups

    def record(reward, trace, truncated=""):
        return RolloutRecord("t", "e", HarnessRolloutOutcome(reward, [], [], 0, 0, {}, False), "ok",
                             training_trace={"turns": trace}, reward=reward, truncated=truncated)

    group = [record(1.0, [A1, A2]), record(0.0, [B1, B2], truncated="time limit (60 s)"), record(0.0, [A4])]
    kept, masked = batch_from_groups([group]), batch_from_groups([group], mask_truncated=True)
    assert kept.advantages == masked.advantages == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert masked.lengths == [kept.lengths[0], 0, kept.lengths[2]] and kept.lengths[1] == 5
    assert {c.rollout for c in masked.chains} == {0, 2} and masked.total == kept.total - 5
    assert masked.metrics["truncated"] == kept.metrics["truncated"] == 1 and masked.metrics["truncated_masked"] == 1
