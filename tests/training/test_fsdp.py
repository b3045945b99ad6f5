"""FSDP2 on CPU (gloo): two sharded ranks take the single-process step, save a checkpoint that resumes exactly,
and write final/ once, through the same lead/follow protocol the trainer's loop uses (training/distributed.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

RUN = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, "tests")  # the scripted session factory: rollouts with given turns, no agent, no engine
    from stubs import ScriptedSessions
    from harness_trainer.training.distributed import end_process
    from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

    model, out, distributed, resume = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] != "-"
    def turn(node, prompt, completion, logp=-2.0):
        return {"node_id": node, "prompt_token_ids": prompt, "completion_token_ids": completion,
                "per_token_logps": [logp] * len(completion), "loss_mask": [0] * len(prompt) + [1] * len(completion),
                "metadata": {"policy_version": 0}}
    system = [1, 50, 60, 70, 80, 90, 100, 2]
    def rollout(task, i, episode, version):  # group n of the run (its episodes are named ...-n{n}-{i}) differs by n
        seed = int(episode.rsplit("-", 2)[1][1:])
        traces = [[turn("a", system + [11 + seed], [300, 301, 302]),
                   turn("b", system + [11 + seed, 300, 301, 302, 7], [303])],
                  [turn("c", system + [11 + seed], [400, 401 + seed])],
                  [turn("d", system + [12], [500, 501, 502, 503 + seed])]]
        return traces[i], [1.0, 0.0, 0.5][i]
    class Task:
        name, agent_timeout_s = "t", 60.0
    # the real loop on every rank: rank 0 collects the scripted groups and hands them over, the others follow.
    # Token-level IS: a sequence-level weight over the made-up sampler logprobs (-2.0) would mask every rollout,
    # leaving gradients that are 0 up to rounding (Adam's sign step turns those into differences of 2 lr)
    trainer = HarnessAsyncGRPOTrainer(model, ScriptedSessions(rollout), AsyncGRPOConfig(
        output_dir=out, learning_rate=1e-2, beta=0.1, distributed=distributed, save_steps=1, max_steps=2,
        vllm_importance_sampling_mode="token_truncate",
        num_generations=3, max_concurrent_rollouts=3,
        resume_from_checkpoint=out + "/checkpoint-1" if resume else None), [Task()])
    metrics = trainer.train()
    weights = trainer.policy.full_weights() or trainer.model.state_dict()  # every rank: FSDP gathers
    if trainer.rank == 0:
        torch.save({"metrics": metrics, "weights": {k: v.detach().cpu() for k, v in weights.items()}},
                   out + ("/resumed.pt" if resume else "/result.pt"))
    trainer.save_model(out + "/final")  # every rank: with FSDP the gather needs them all
    end_process(0)  # every rank ends here, not in the interpreter's finalization (training/distributed.py)
""")


def _run(script: Path, ranks: int, *args: str) -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)] if ranks > 1 else \
        [sys.executable]
    done = subprocess.run([*launcher, str(script), *args], timeout=300, cwd=Path(__file__).parents[2],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]


def test_fsdp_two_ranks_match_one_and_resume_exactly(tiny_model_dir, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RUN)
    one, two = tmp_path / "one", tmp_path / "two"
    _run(script, 1, str(tiny_model_dir), str(one), "ddp", "-")
    _run(script, 2, str(tiny_model_dir), str(two), "fsdp", "-")
    a, b = torch.load(one / "result.pt"), torch.load(two / "result.pt")
    for ma, mb in zip(a["metrics"], b["metrics"]):  # two steps, the second from the first's weights
        assert ma["trained_tokens"] == mb["trained_tokens"] > 0
        assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-4, abs=1e-7)
        assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-4)
        assert ma["step_scale"] == pytest.approx(mb["step_scale"], rel=1e-4)
    # the same weights after two steps, to float32 summation order (measured: 2.5e-5 on weights of size ~1;
    # Adam's first step is lr * sign(g), so a gradient that is 0 up to rounding could move one entry by 2 lr)
    gaps = {k: float((a["weights"][k] - b["weights"][k]).abs().max()) for k in a["weights"]}
    assert max(gaps.values()) < 1e-3, gaps
    # a sharded checkpoint resumes exactly: step 2 from checkpoint-1 gives the weights step 2 gave in one go
    _run(script, 2, str(tiny_model_dir), str(two), "fsdp", "resume")
    resumed = torch.load(two / "resumed.pt")
    assert resumed["metrics"][0]["loss"] == b["metrics"][1]["loss"]
    assert all(torch.equal(resumed["weights"][k], b["weights"][k]) for k in b["weights"])
    # final/ is one servable folder holding the gathered weights, written by rank 0 alone
    from safetensors.torch import load_file

    final = load_file(two / "final" / "model.safetensors")
    assert all(torch.equal(final[k], b["weights"][k]) for k in final) and set(final) <= set(b["weights"])


FAILS = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    from harness_trainer._exceptions import CaptureContractError
    from harness_trainer.training.distributed import end_process
    from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

    class Broken:  # fault injection: every rollout breaks the capture contract, which stops a run
        def create(self, task, episode_id=None):
            raise CaptureContractError("injected")

        def close(self):
            pass

    model, out = sys.argv[1:3]
    trainer = HarnessAsyncGRPOTrainer(model, lambda sampling: Broken(), AsyncGRPOConfig(
        output_dir=out, distributed="fsdp", num_generations=2, max_concurrent_rollouts=2), [SimpleNamespace(name="t")])
    try:
        trainer.train()
        raised = False
    except CaptureContractError:
        raised = True
    if not trainer.lead_failed and trainer.rank == 0 and not raised:
        trainer.save_model(out + "/final")
    with open(f"{out}/rank{trainer.rank}.json", "w") as f:
        json.dump({"raised": raised, "lead_failed": trainer.lead_failed}, f)
    end_process(0)  # every rank ends here, not in the interpreter's finalization (training/distributed.py)
""")


def test_a_failed_lead_releases_the_followers(tiny_model_dir, tmp_path):
    """Rank 0's loop stops on an error: the followers are told it failed (no final/ gather is coming) and exit,
    instead of waiting in a collective for hours."""
    import json

    script = tmp_path / "fails.py"
    script.write_text(FAILS)
    _run(script, 2, str(tiny_model_dir), str(tmp_path))
    assert json.loads((tmp_path / "rank0.json").read_text()) == {"raised": True, "lead_failed": False}
    assert json.loads((tmp_path / "rank1.json").read_text()) == {"raised": False, "lead_failed": True}


@pytest.mark.slow
def test_one_set_of_services_under_a_launcher(fresh_engine, tiny_model_dir, tmp_path):
    """`harness-train` under torchrun with 2 CPU ranks and FSDP: rank 0 alone runs the proxy and rollouts (on a
    fixed --proxy-port: a second proxy would find it taken and fail the run), both ranks train, the weights are
    synced into the engine and probed, and final/ is written once from the gathered shards."""
    import json

    from harness_trainer.serving.process import free_port

    examples = Path(__file__).parents[2] / "harness_trainer" / "examples"
    prefix = "harness_trainer.examples.multi_env:"
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
               "harness_trainer.commands.cli", "--environment", prefix + "MultiEnv",
               "--reward-funcs", f"{prefix}wordle_reward,{prefix}echo_reward",
               "--dataset", str(examples / "multi_env.jsonl"), "--vllm-url", fresh_engine.url,
               "--model", str(tiny_model_dir), "--distributed", "fsdp", "--proxy-port", str(free_port()),
               "--max-steps", "2", "--num-generations", "2", "--max-concurrent-rollouts", "2", "--save-steps", "2",
               "--max-completion-tokens", "16", "--report-to", "none", "--output-dir", str(out)]
    done = subprocess.run(command, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and metrics[-1]["version"] == 3  # one writer: rank 0
    assert all(m["probe_gap"] < 1e-3 for m in metrics)  # the engine serves the gathered weights
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert (out / "final" / "model.safetensors").exists() and (out / "checkpoint-2" / "trainer_state.pt").exists()
    assert done.stdout.count("done: 2 steps") == 1  # rank 0 alone reports the run
