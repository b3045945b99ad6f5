"""Learning that holds: the collapse warnings on constructed metrics, the learning-rate schedule, several
groups in one step, and best/ holding the best step's model (no engine: the trainer's step is driven directly)."""

from __future__ import annotations

import json

import pytest
import torch

from harness_trainer.rollouts.session import HarnessRolloutOutcome, RolloutRecord
from harness_trainer.rollouts.tasks import Task
from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer
from harness_trainer.training.trust_region import StabilityMonitor


def test_entropy_spike_warns_and_steady_noise_does_not():
    monitor = StabilityMonitor()
    for entropy in (0.012, 0.009, 0.017, 0.011, 0.015, 0.03):  # a near-deterministic policy's noise
        assert monitor.check({"entropy": entropy, "behaviour_kl_k3": 0.001}) == []
    warnings = monitor.check({"entropy": 0.24, "behaviour_kl_k3": 0.001})  # the collapse's step 9
    assert len(warnings) == 1 and "entropy jumped to 0.24" in warnings[0]


def test_kl_jump_and_all_zero_step_warn():
    monitor = StabilityMonitor()
    for kl in (0.001, 0.002, 0.001):
        assert monitor.check({"behaviour_kl_k3": kl, "scorable": 8, "reward_max": 1.0}) == []
    assert "behaviour_kl_k3 jumped" in monitor.check({"behaviour_kl_k3": 0.2, "scorable": 8, "reward_max": 1.0})[0]
    zero = monitor.check({"behaviour_kl_k3": 0.001, "scorable": 8, "reward_max": 0.0})
    assert len(zero) == 1 and "every rollout of this step scored 0" in zero[0]
    # a run that has never scored is not warned about: nothing fell
    assert StabilityMonitor().check({"scorable": 8, "reward_max": 0.0}) == []


def test_a_step_whose_importance_weights_are_mostly_cut_warns():
    """Most trained tokens with their IS weight at the bound or masked (a sequence-level weight over long rollouts
    from a lower-precision engine): the step says so; a few cut tokens do not."""
    monitor = StabilityMonitor()
    assert monitor.check({"is_truncated_frac": 0.1}) == []
    (warning,) = monitor.check({"is_truncated_frac": 0.8})
    assert warning.startswith("80% of the step's trained tokens had their importance weight cut or masked")


def _trainer(model_dir, tmp_path, **fields) -> HarnessAsyncGRPOTrainer:
    return HarnessAsyncGRPOTrainer(str(model_dir), lambda sampling: None, AsyncGRPOConfig(
        output_dir=str(tmp_path / "run"), **fields), [Task.__new__(Task)])


def test_warmup_schedule_and_bad_schedule(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, learning_rate=1e-3, max_steps=8, warmup_ratio=0.25,
                       lr_scheduler_type="constant_with_warmup")
    assert [trainer.policy.lr_at(s) for s in range(4)] == pytest.approx([0.0, 5e-4, 1e-3, 1e-3])
    cosine = _trainer(tiny_model_dir, tmp_path, learning_rate=1e-3, max_steps=4, lr_scheduler_type="cosine")
    assert cosine.policy.lr_at(0) == pytest.approx(1e-3) and cosine.policy.lr_at(2) == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="--warmup-ratio needs a schedule with a warm-up"):
        _trainer(tiny_model_dir, tmp_path, warmup_ratio=0.1)


def _group(task: str, rewards: list[float], token: int) -> list[RolloutRecord]:
    records = []
    for g, reward in enumerate(rewards):
        turn = {"node_id": f"{task}-{g}", "prompt_token_ids": [1, 50, 60, 2], "completion_token_ids": [token + g, 7],
                "per_token_logps": [-3.0, -3.0], "loss_mask": [0, 0, 0, 0, 1, 1], "metadata": {"policy_version": 0}}
        records.append(RolloutRecord(task, f"{task}-{g}", HarnessRolloutOutcome(reward, [], [], 0, 0, {}, False),
                                     "ok", training_trace={"turns": [turn]}, policy_versions=[0]))
    return records


def test_two_groups_in_one_step_each_with_its_own_advantages(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, learning_rate=1e-3, groups_per_step=2)
    metrics = trainer.policy.step(trainer.score([_group("a", [1.0, 0.0], 300), _group("b", [1.0, 1.0], 400)]), 0)
    # b's rewards are all equal: it is counted, and only a's two rollouts (2 tokens each) are trained
    assert metrics["groups"] == 2 and metrics["zero_variance_groups"] == 1 and not metrics["zero_variance"]
    assert metrics["trained_tokens"] == 4 and metrics["rollouts"] == 4 and metrics["reward_mean"] == 0.75
    assert metrics["completion_tokens_mean"] == 2 and "entropy" in metrics and "behaviour_clip_frac" in metrics
    # the same step with the groups one at a time, from the same weights: one step of two groups differs
    alone = _trainer(tiny_model_dir, tmp_path, learning_rate=1e-3)
    assert alone.policy.step(alone.score([_group("a", [1.0, 0.0], 300)]), 0)["trained_tokens"] == 4


def test_black_box_runs_take_several_reward_functions(tiny_model_dir, tmp_path, monkeypatch):
    """reward_funcs over a group's outcomes, next to rollout_reward_fn: summed (None skipped), each logged."""
    def solved(outcomes, **kwargs):
        return [o.env_reward for o in outcomes]

    def brevity(outcomes, completion_ids, **kwargs):  # the sampled ids come too
        return [None if o.env_reward is None else -0.01 * len(ids) for o, ids in zip(outcomes, completion_ids)]

    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), lambda sampling: None, AsyncGRPOConfig(
        output_dir=str(tmp_path / "run"), learning_rate=1e-3), [Task.__new__(Task)],
        rollout_reward_fn="verifier+tools", reward_funcs=[solved, brevity])
    group = _group("a", [1.0, 0.0], 300)
    metrics = trainer.policy.step(trainer.score([group]), 0)
    assert group[0].reward_terms == {"solved": 1.0, "brevity": -0.02, "verifier_with_tool_bonus": 1.3}
    assert group[0].reward == pytest.approx(2.28) and group[1].reward == pytest.approx(-0.02)
    assert metrics["rewards/solved/mean"] == 0.5 and metrics["rewards/brevity/mean"] == pytest.approx(-0.02)
    assert metrics["reward_mean"] == pytest.approx(1.13) and metrics["verifier_reward_mean"] == 0.5
    # the same names on the command line: module:function, comma-separated
    (tmp_path / "terms.py").write_text("def solved(outcomes, **kwargs):\n    return [1.0] * len(outcomes)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from harness_trainer._exceptions import RewardError
    from harness_trainer.rollouts.rewards import resolve_reward_funcs

    assert [f.__name__ for f in resolve_reward_funcs("terms:solved")] == ["solved"]
    with pytest.raises(RewardError, match="share a name"):
        resolve_reward_funcs([solved, "terms:solved"])


def test_best_checkpoint_is_the_best_steps_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tiny_model_dir, tmp_path, save_best=True, best_window=2)
    saved = {}
    for step, reward in enumerate([0.2, 0.6, 1.0, 0.8, 0.0, None, 0.0], start=1):
        with torch.no_grad():  # a different model after every step
            trainer.model.lm_head.weight.fill_(step)
        if trainer.best.update(step, reward, trainer.save_model):
            saved[step] = reward
    # window means: (part window), 0.4, 0.8, 0.9, 0.4, (no reward), 0.0 -> kept at steps 2, 3, 4: step 4's is best
    assert list(saved) == [2, 3, 4]
    best = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "best")
    assert float(best.lm_head.weight[0, 0]) == 4.0
    assert (tmp_path / "run" / "best" / "tokenizer.json").exists()  # servable, like final/
    assert json.loads((tmp_path / "run" / "best" / "best.json").read_text())["step"] == 4


def test_step_kl_bound_halves_a_step_that_moves_the_policy_too_far(tiny_model_dir, tmp_path):
    """A fresh batch (behaviour = current policy): no ratio clip can bind, the step bound must."""
    groups = lambda: [_group("a", [1.0, 0.0, 0.0, 0.0], 300)]  # noqa: E731
    free = _trainer(tiny_model_dir, tmp_path, learning_rate=3e-3, max_step_kl=None, step_clip=None)
    unbounded = free.policy.step(free.score(groups()), 0)
    assert "step_scale" not in unbounded
    bounded_trainer = _trainer(tiny_model_dir, tmp_path, learning_rate=3e-3, max_step_kl=0.01, step_clip=None)
    before = {k: v.clone() for k, v in bounded_trainer.model.state_dict().items()}
    bounded = bounded_trainer.policy.step(bounded_trainer.score(groups()), 0)
    assert bounded["step_kl_unbounded"] > 0.01 >= bounded["step_kl"] and bounded["step_scale"] < 1
    # the bounded model is the old one moved by step_scale times the full step (the unbounded trainer's)
    for name, value in bounded_trainer.model.state_dict().items():
        full = free.model.state_dict()[name] - before[name]
        assert torch.allclose(value, before[name] + bounded["step_scale"] * full, atol=1e-6), name


@pytest.mark.parametrize("mode", ["ratio", "probability"])
def test_step_clip_bounds_every_token(tiny_model_dir, tmp_path, mode):
    """The per-token bound: a step whose mean KL is fine can still move one token's probability too far."""
    groups = lambda: [_group("a", [1.0, 0.0, 0.0, 0.0], 300)]  # noqa: E731
    free = _trainer(tiny_model_dir, tmp_path, learning_rate=1e-3, max_step_kl=None, step_clip=None)
    unbounded = free.policy.step(free.score(groups()), 0)
    assert "step_scale" not in unbounded
    # the random tiny model's tokens are rare (p ~ 4e-4; this step moves one x3.4, by 1e-3): 2e-4 binds
    clip = 0.2 if mode == "ratio" else 2e-4
    clipped = _trainer(tiny_model_dir, tmp_path, learning_rate=1e-3, max_step_kl=None, step_clip=clip,
                       step_clip_mode=mode)
    bounded = clipped.policy.step(clipped.score(groups()), 0)
    assert 0 < bounded["step_scale"] < 1 and not bounded["step_skipped"]
    if mode == "ratio":
        assert bounded["step_ratio_max_unbounded"] > 1.2 or bounded["step_ratio_min_unbounded"] < 0.8
        assert 0.8 <= bounded["step_ratio_min"] <= bounded["step_ratio_max"] <= 1.2
    else:
        assert bounded["step_prob_move_unbounded"] > clip >= bounded["step_prob_move"]
    # the search lands near the bound, not at a power of two far inside it
    assert bounded["step_measures"] <= 4


def test_a_step_outside_the_bound_is_never_applied():
    """bound_step on a move that stays outside at every scale the search tries: the weights are put back
    exactly; on a move that is inside only below 1/64 (where halving stopped) the step taken is inside."""
    from harness_trainer.training.trust_region import bound_step

    before = [torch.randn(5, 3), torch.randn(4)]
    moved = [b + torch.randn_like(b) for b in before]
    params = [m.clone() for m in moved]
    stuck = bound_step(params, before, lambda: {"kl": 1.0}, lambda change: 0.5)
    assert stuck["step_skipped"] == 1 and stuck["step_scale"] == 0.0
    assert all(torch.equal(p, b) for p, b in zip(params, before))

    # a move whose size is linear in the scale, 1000x past the bound: halving to 1/64 would accept it outside
    params = [m.clone() for m in moved]
    size = lambda: {"move": float(sum((p - b).abs().max() for p, b in zip(params, before)))}  # noqa: E731
    full = size()["move"]
    bound = full / 1000
    taken = bound_step(params, before, size, lambda change: bound / change["move"])
    assert not taken["step_skipped"] and 0.8 * bound <= taken["step_move"] <= bound
    assert taken["step_scale"] == pytest.approx(taken["step_move"] / full, rel=1e-4)
    for p, b, m in zip(params, before, moved):  # still along the step's direction
        assert torch.allclose(p, b + taken["step_scale"] * (m - b), atol=1e-6)
