"""Data parallel on CPU: two processes under `accelerate launch` take the same step as one process, and a
real async run (engine, proxy, sandbox) trains with two ranks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from say_agent import SAY, say_task  # the few-line agent program and its task

STEP = textwrap.dedent("""
    import sys, torch
    from harness_trainer.rollouts.session import HarnessRolloutOutcome, RolloutRecord
    from harness_trainer.rollouts.tasks import Task
    from harness_trainer.training.distributed import end_process
    from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

    model, out = sys.argv[1:3]
    def turn(node, prompt, completion):
        return {"node_id": node, "prompt_token_ids": prompt, "completion_token_ids": completion,
                "per_token_logps": [-2.0] * len(completion), "loss_mask": [0] * len(prompt) + [1] * len(completion),
                "metadata": {"policy_version": 0}}
    system = [1, 50, 60, 70, 80, 90, 100, 2]
    traces = [[turn("a", system + [11], [300, 301, 302]), turn("b", system + [11, 300, 301, 302, 7], [303])],
              [turn("c", system + [11], [400, 401])],
              [turn("d", system + [12], [500, 501, 502, 503])]]
    records = [RolloutRecord("t", f"e{i}", HarnessRolloutOutcome(reward, [], [], 0, 0, {}, False), "ok",
                             training_trace={"turns": turns}, policy_versions=[0])
               for i, (turns, reward) in enumerate(zip(traces, [1.0, 0.0, 0.5]))]
    # token-level IS: the made-up sampler logprobs (-2.0) are far from the model's, and the default's sequence-level
    # weight (their product over a rollout) would mask every rollout, leaving only the KL term to compare
    trainer = HarnessAsyncGRPOTrainer(model, lambda sampling: None, AsyncGRPOConfig(
        output_dir=out + "/run", learning_rate=1e-2, beta=0.1, vllm_importance_sampling_mode="token_truncate"),
        [Task.__new__(Task)])
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.policy.step(trainer.score([records]), 0)
    metrics["moved"] = max(float((v - before[k]).abs().max()) for k, v in trainer.model.state_dict().items())
    if trainer.rank == 0:
        grads = {name: p.grad for name, p in trainer.model.named_parameters()}
        torch.save({"grads": grads, "metrics": metrics}, out + "/result.pt")
    end_process(0)  # every rank ends here, not in the interpreter's finalization (training/distributed.py)
""")


def _accelerate(*args: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", *args]


def test_two_cpu_processes_take_the_single_process_step(tiny_model_dir, tmp_path):
    script = tmp_path / "step.py"
    script.write_text(STEP)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    subprocess.run([sys.executable, str(script), str(tiny_model_dir), str(tmp_path / "one")], check=True, timeout=300)
    subprocess.run(_accelerate(str(script), str(tiny_model_dir), str(tmp_path / "two")), check=True, timeout=300,
                   cwd=Path(__file__).parents[2])
    one, two = torch.load(tmp_path / "one" / "result.pt"), torch.load(tmp_path / "two" / "result.pt")
    assert one["metrics"]["trained_tokens"] == two["metrics"]["trained_tokens"] == 10
    assert one["metrics"]["loss"] == pytest.approx(two["metrics"]["loss"], abs=1e-6)
    assert one["metrics"]["ref_kl"] == 0.0  # the reference is the starting policy
    assert one["metrics"]["grad_norm"] == pytest.approx(two["metrics"]["grad_norm"], rel=1e-5)
    # the step did something: Adam's first step is lr * sign(g) = 1e-2, shortened by the step bound, and the
    # bound decided the same on both: its KL is summed over the ranks' tokens. The scale is predicted from the
    # measured overshoot, a float that differs in its last digits with the summation order (6.3309093e-3 vs
    # 6.3309089e-3 in one CI run), so it is compared to rounding, not exactly.
    assert one["metrics"]["step_scale"] == pytest.approx(two["metrics"]["step_scale"], rel=1e-5)
    assert one["metrics"]["step_measures"] == two["metrics"]["step_measures"]
    assert one["metrics"]["step_kl"] == pytest.approx(two["metrics"]["step_kl"], rel=1e-4)
    assert one["metrics"]["moved"] > 0.5 * 1e-2 * one["metrics"]["step_scale"]
    # The same gradient, so the same step (weights are not compared: Adam's first step is lr * sign(g), and
    # float summation order flips the sign of gradients that are 0 up to rounding).
    for name, grad in one["grads"].items():
        assert torch.allclose(grad, two["grads"][name], atol=1e-7, rtol=1e-4), name


RUN = textwrap.dedent("""
    import sys, shlex
    from functools import partial
    from harness_trainer.agents.command import CommandHarness
    from harness_trainer.rollouts.session import LocalSessionFactory
    from harness_trainer.rollouts.tasks import load_task
    from harness_trainer.proxy.client import ProxyClient
    from harness_trainer.training.distributed import end_process
    from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer
    engine, proxy, key, model, task, out, script = sys.argv[1:8]
    factory = partial(LocalSessionFactory, proxy=ProxyClient(proxy, key),
                      harness=CommandHarness(f"python3 -c {shlex.quote(script)} {{instruction}}"),
                      output_dir=out + "/r")
    HarnessAsyncGRPOTrainer(model, factory, AsyncGRPOConfig(
        output_dir=out + "/run", vllm_server_base_url=engine, num_generations=4, max_concurrent_rollouts=4,
        max_steps=2, save_steps=1, learning_rate=1e-3, max_completion_tokens=4), [load_task(task)]).train()
    end_process(0)  # every rank ends here, not in the interpreter's finalization (training/distributed.py)
""")


@pytest.mark.slow  # the two-rank step itself is checked in the default tier, above
def test_async_run_with_two_ranks(engine, proxy, tiny_model_dir, tmp_path):
    from harness_trainer.serving.weight_sync import reload_weights

    script = tmp_path / "run.py"
    script.write_text(RUN)
    task = say_task(tmp_path)
    try:
        subprocess.run(_accelerate(str(script), engine.url, proxy.url, proxy.admin_key, str(tiny_model_dir),
                                   str(task), str(tmp_path), SAY), check=True, timeout=400,
                       cwd=Path(__file__).parents[2])
    finally:
        reload_weights(engine, tiny_model_dir, version=0)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and steps[-1]["version"] == 3  # rank 0 alone logs and syncs
    assert all(s["rollouts"] == 4 for s in steps)
    assert (tmp_path / "run" / "checkpoint-2" / "model.safetensors").exists()
