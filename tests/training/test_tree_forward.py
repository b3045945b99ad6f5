"""The step in bounded memory: tree attention and micro-batches against one causal row per chain (forks,
rewritten histories, partial loss masks), the split invariance of the gradient, a chain longer than the
budget, the proximal logprobs taken from the training forward, chunked logprobs, linear parent search."""

from __future__ import annotations

import random

import pytest
import torch
from openenv.core.harness.training import TrainingTrace
from test_grpo_math import ADVANTAGES, TRACES, turn

from harness_trainer.traces.prefixes import longest_prefix_parents
from harness_trainer.training import tree_forward
from harness_trainer.training.grpo import LossConfig, policy_loss
from harness_trainer.training.packing import chain_logprobs, chains_from_trace, pack
from harness_trainer.training.tree_forward import chunked_logprobs, plan_ranges, tree_backward, tree_logprobs


def _model(dtype=torch.float32, arch="Qwen2", tied=False):
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied)
    return getattr(transformers, f"{arch}ForCausalLM")(config).to(dtype)


@pytest.fixture(scope="module")
def model():
    return _model()


def _chains(traces):
    seen: set = set()
    return [c for i, t in enumerate(traces) for c in chains_from_trace(t, i, seen)]


BEHAVIOUR_LOSS = LossConfig(ratio_to="behaviour")


def _tree_step(model, chains, budget, checkpointing=False, cfg=BEHAVIOUR_LOSS):
    tree = pack(chains)
    total = int(tree.trained.sum())
    behaviour, adv = tree.behaviour[tree.trained], ADVANTAGES[tree.rollout[tree.trained]]

    def loss_fn(logp, index):
        return policy_loss(logp, behaviour[index], adv[index], cfg, total, proximal=logp.detach())[0]

    model.zero_grad()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    try:
        logp, _ = tree_backward(model, tree, loss_fn, max_tokens=budget)
    finally:
        model.gradient_checkpointing_disable()
    return tree, logp, [p.grad.clone() for p in model.parameters()]


def _naive(model, chains):
    total = sum(sum(c.trained) for c in chains)
    model.zero_grad()
    logps = []
    for chain in chains:
        if not any(chain.trained):
            continue
        logp = chain_logprobs(model, chain)
        behaviour = torch.tensor([b for b, t in zip(chain.behaviour, chain.trained) if t])
        adv = ADVANTAGES[torch.full((len(logp),), chain.rollout)]
        policy_loss(logp, behaviour, adv, LossConfig(ratio_to="behaviour"), total)[0].backward()
        logps.append(logp.detach())
    return torch.cat(logps), [p.grad.clone() for p in model.parameters()]


def _budget_for(tree, ranges: int) -> int:
    return next(b for b in range(len(tree), 0, -1) if len(plan_ranges(tree, b)) == ranges)


def test_gradient_does_not_depend_on_the_micro_batch_split(model):
    chains = _chains(TRACES)
    tree = pack(chains)
    results = [_tree_step(model, chains, _budget_for(tree, k)) for k in (1, 2, 4)]
    assert [len(plan_ranges(tree, _budget_for(tree, k))) for k in (1, 2, 4)] == [1, 2, 4]
    _, logp_1, grads_1 = results[0]
    for _, logp, grads in results[1:]:
        assert torch.allclose(logp, logp_1, atol=1e-6)
        for a, b in zip(grads, grads_1):
            assert torch.allclose(a, b, atol=1e-6), float((a - b).abs().max())


@pytest.mark.parametrize("budget, checkpointing", [(None, False), (5, False), (5, True), (1, False)])
def test_micro_batched_tree_equals_naive_rows(model, budget, checkpointing):
    """Forks, a rewritten history (a second root) and a partial loss mask; budget 1 cuts between every token."""
    chains = _chains(TRACES)
    tree, logp, grads = _tree_step(model, chains, budget, checkpointing)
    naive_logp, naive_grads = _naive(model, chains)
    assert torch.allclose(logp.sort().values, naive_logp.sort().values, atol=1e-6)
    for a, b in zip(grads, naive_grads):
        assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())


@pytest.mark.parametrize("arch, tied", [("Qwen3", True), ("Llama", False), ("Llama", True)])
def test_the_tree_step_equals_naive_rows_on_other_architectures(arch, tied):
    """Llama-family models build their mask from whatever they are given (Qwen2's accept a ready one): the tree
    batch rides in the forward's keyword arguments, so every architecture gets it; a tied lm_head gets the
    embedding's gradient twice, as in the naive rows."""
    other = _model(arch=arch, tied=tied)
    chains = _chains(TRACES)
    _, logp, grads = _tree_step(other, chains, 5)
    naive_logp, naive_grads = _naive(other, chains)
    assert torch.allclose(logp.sort().values, naive_logp.sort().values, atol=1e-6)
    for a, b in zip(grads, naive_grads):
        assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())


def test_a_chain_longer_than_the_budget_trains_every_token(model):
    rng = random.Random(1)
    prompt = [rng.randrange(3, 64) for _ in range(30)]
    first = [rng.randrange(3, 64) for _ in range(25)]
    second = [rng.randrange(3, 64) for _ in range(20)]
    trace = TrainingTrace.model_validate({"turns": [
        turn("x:0", prompt, first), turn("x:1", prompt + first + [4, 5, 6], second, version=1)]})
    chains = _chains([trace])
    tree, logp, grads = _tree_step(model, chains, budget=8)
    assert len(plan_ranges(tree, 8)) == -(-len(tree) // 8)  # one segment: split along its length
    assert logp.numel() == len(first) + len(second) and bool((logp != 0).all())
    naive_logp, naive_grads = _naive(model, chains)
    assert torch.allclose(logp.sort().values, naive_logp.sort().values, atol=1e-6)
    for a, b in zip(grads, naive_grads):
        assert torch.allclose(a, b, atol=1e-5)


def test_proximal_logprobs_are_the_training_forward_detached(model):
    """With one update per batch the decoupled loss's proximal policy is the model now: a separate no-grad
    forward (what the trainer used to run) gives the same logprobs, loss and gradient."""
    chains = _chains(TRACES)
    cfg = LossConfig()  # decoupled
    tree, logp, grads = _tree_step(model, chains, budget=7, cfg=cfg)
    with torch.no_grad():
        separate = tree_logprobs(model, tree, max_tokens=7)
    assert torch.allclose(separate, logp, atol=1e-6)
    model.zero_grad()
    total = int(tree.trained.sum())
    behaviour, adv = tree.behaviour[tree.trained], ADVANTAGES[tree.rollout[tree.trained]]
    fresh = tree_logprobs(model, tree)
    policy_loss(fresh, behaviour, adv, cfg, total, proximal=separate)[0].backward()
    for a, p in zip(grads, model.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-6)


def test_chunked_logprobs_equal_log_softmax(monkeypatch):
    monkeypatch.setattr(tree_forward, "CHUNK_ELEMENTS", 64 * 3)  # 3 rows a chunk: several chunks
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 64, bias=False)
    h = torch.randn(10, 16, requires_grad=True)
    targets = torch.randint(0, 64, (10,))
    weights = torch.randn(10)
    logp, entropy = chunked_logprobs(h, head, targets, temperature=0.7, entropy=True)
    (logp * weights).sum().backward()
    got = (h.grad.clone(), head.weight.grad.clone())
    h.grad, head.weight.grad = None, None
    full = torch.log_softmax(head(h) / 0.7, -1)
    expected = full.gather(-1, targets[:, None])[:, 0]
    (expected * weights).sum().backward()
    assert torch.allclose(logp, expected, atol=1e-6)
    assert torch.allclose(entropy, -(full.exp() * full).sum(-1), atol=1e-5)
    assert torch.allclose(got[0], h.grad, atol=1e-6) and torch.allclose(got[1], head.weight.grad, atol=1e-6)


def test_bfloat16_weights_keep_float32_logprobs():
    chains = _chains(TRACES)
    tree = pack(chains)
    with torch.no_grad():
        exact = tree_logprobs(_model(), tree)
        half = tree_logprobs(_model(torch.bfloat16), tree, max_tokens=6)
    assert half.dtype == torch.float32 and float((half - exact).abs().max()) < 0.1


def test_longest_prefix_parents_equal_the_all_pairs_search():
    rng = random.Random(0)
    for _ in range(20):
        prompts, fulls = [], []
        for _ in range(rng.randint(1, 12)):
            if fulls and rng.random() < 0.7:  # continue (or retry) an earlier call, sometimes across a chunk
                base = rng.choice(fulls + prompts)
                prompt = base + [rng.randrange(5) for _ in range(rng.choice([0, 1, 70, 130]))]
            else:
                prompt = [rng.randrange(5) for _ in range(rng.choice([0, 3, 64, 200]))]
            prompts.append(prompt)
            fulls.append(prompt + [rng.randrange(5) for _ in range(rng.choice([0, 1, 2, 64]))])
        expected = []
        for i, p in enumerate(prompts):
            best, best_len = None, -1
            for j, f in enumerate(fulls):
                if j != i and best_len < len(f) <= len(p) and p[:len(f)] == f:
                    best, best_len = j, len(f)
            expected.append(best)
        assert longest_prefix_parents(prompts, fulls) == expected


@pytest.mark.slow
@pytest.mark.timeout(2400)  # the eval ≈ 12 min (26 teacher-forced scorings of 11k-30k tokens), then the 8 × 30k step
def test_one_step_on_real_opencode_traces_past_30k_tokens(engine, tiny_model_dir, tmp_path):
    """opencode, unmodified, driven by the oracle through the 26 turns of builtin:logs (24 files read one per
    turn): G = 8 real captures past 30k tokens each, trained one step on CPU by the trainer's own step."""
    from harness_trainer.commands.evaluate import EvalConfig, evaluate
    from harness_trainer.traces.files import TrainingTrace as Trace
    from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

    summary, records = evaluate(EvalConfig(
        harness="opencode", dataset="builtin:logs", policy="oracle", num_generations=8, max_concurrent_rollouts=8,
        vllm_url=engine.url,
        max_completion_tokens=256, oracle_mistake_rate=0.5, agent_step_limit=32,  # 26 calls: past eval's default 6
        output_dir=str(tmp_path / "eval")))
    assert len(records) == 8 and 0 < summary.wins < 8, summary  # half slip: the group has a gradient
    per_turn = 0  # tokens one row per turn would feed (TRL's scheme)
    for record in records:
        trace = Trace.model_validate(record.training_trace)
        per_turn += sum(len(t.prompt_token_ids) + len(t.completion_token_ids) for t in trace.turns)
        assert len(trace.turns) >= 20
        assert max(len(t.prompt_token_ids) + len(t.completion_token_ids) for t in trace.turns) > 30_000
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), lambda policy: None, AsyncGRPOConfig(
        output_dir=str(tmp_path / "train"), num_generations=8, max_tokens_per_microbatch=16_384), ["unused"])
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.policy.step(trainer.score([records]), 0)
    assert metrics["trained_tokens"] > 0 and metrics["microbatches"] > 1
    assert metrics["tree_tokens"] < metrics["row_tokens"] and 10 * metrics["tree_tokens"] < per_turn
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


@pytest.mark.parametrize("settings", [
    dict(importance_sampling_level="sequence"), dict(vllm_importance_sampling_mode="sequence_mask",
                                                      vllm_importance_sampling_clip_max=1e6),
    dict(off_policy_mask_threshold=0.5), dict(top_entropy_quantile=0.5), dict(loss_type="grpo")],
    ids=["gspo", "sequence_mask", "off_policy_mask", "top_entropy", "grpo"])
def test_a_whole_batch_loss_trains_the_same_in_micro_batches(model, settings):
    """Losses where a token's term needs its sequence's (or the step's) other logprobs: the step measures the
    tree first and back-propagates d loss / d logp in micro-batches; the gradient is the one-pass loss's."""
    from types import SimpleNamespace

    from harness_trainer.training.grpo import Sequences
    from harness_trainer.training.step import Batch, _backward

    chains = _chains(TRACES)
    tree = pack(chains)
    lengths = [sum(sum(c.trained) for c in chains if c.rollout == r) for r in range(len(TRACES))]
    batch = Batch(chains, ADVANTAGES.tolist(), lengths, sum(lengths), {})
    cfg = LossConfig(**settings)
    grads = {}
    for budget in (None, _budget_for(tree, 3)):
        policy = SimpleNamespace(model=model, device=torch.device("cpu"), loss_cfg=cfg, ref_model=None, peft=None,
                                 args=SimpleNamespace(max_tokens_per_microbatch=budget, temperature=1.0, beta=0.0))
        model.zero_grad()
        _backward(policy, chains, batch)
        grads[budget] = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()  # the reference: the whole tree in one forward, the loss on it, one backward
    logp, entropy = tree_logprobs(model, tree, entropy=True)
    rollout = tree.rollout[tree.trained]
    policy_loss(logp, tree.behaviour[tree.trained], ADVANTAGES[rollout], cfg, sum(lengths), proximal=logp.detach(),
                sequences=Sequences(rollout, torch.tensor(lengths, dtype=torch.float32)), entropy=entropy)[0].backward()
    for got in grads.values():
        for a, p in zip(got, model.parameters()):
            assert torch.allclose(a, p.grad, atol=1e-6), float((a - p.grad).abs().max())
    assert any(float(p.grad.abs().sum()) > 0 for p in model.parameters())
