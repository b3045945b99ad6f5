"""The async GRPO trainer on the real tiny model + vLLM + proxy + local sandbox: real steps with
mini-swe-agent, weights synced and probed after each step, policy versions advancing on captured turns,
failed rollouts survived, malformed captures fatal, kill -9 and exact resume; and (slow) the learning proof."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from functools import partial

import pytest
from say_agent import NEVER_ENDING_WHEN_SLOW, SAY, SAY_HARNESS, say_task
from stubs import wait_until

from harness_trainer._exceptions import CaptureContractError
from harness_trainer.proxy.client import ProxyClient
from harness_trainer.rollouts.session import LocalSessionFactory
from harness_trainer.rollouts.tasks import load_dataset, load_task
from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer


def config(tmp_path, engine, **overrides) -> AsyncGRPOConfig:
    base = dict(output_dir=str(tmp_path / "run"), vllm_server_base_url=engine.url, num_generations=2,
                max_concurrent_rollouts=2, max_steps=2, learning_rate=1e-3, max_completion_tokens=16, save_steps=1,
                shuffle_dataset=False)  # tests below rely on the order of their tasks
    return AsyncGRPOConfig(**base | overrides)


def test_async_steps_with_mini_swe_agent(fresh_engine, proxy, tiny_model_dir, tmp_path):
    tasks = load_dataset("builtin:toy-train")[:2]
    factory = partial(LocalSessionFactory, proxy=proxy.client, harness="mini-swe-agent",
                      output_dir=tmp_path / "rollouts", step_limit=2)
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), factory, config(tmp_path, fresh_engine), tasks)
    history = trainer.train()
    assert [h["step"] for h in history] == [1, 2] and trainer.version == 3  # cold sync + one per step
    assert trainer.last_probe_gap < 1e-3  # vLLM scores exactly as the trainer's weights do
    assert all(h["rollouts"] == 2 and h["staleness"] <= 1 for h in history)
    versions = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [v["version"] for v in versions] == [2, 3]
    assert (tmp_path / "run" / "checkpoint-2" / "model.safetensors").exists()


def test_policy_version_on_captured_turns_advances(fresh_engine, proxy, tiny_model_dir, tmp_path):
    seen_versions = []

    class Recording(LocalSessionFactory):
        def create(self, task, seed=None, episode_id=None):
            session = super().create(task, seed, episode_id)
            seen_versions.append(self.proxy.session(session.capture["id"])["policy_version"])
            return session

    factory = partial(Recording, proxy=proxy.client, harness=SAY_HARNESS, output_dir=tmp_path / "r")
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), factory, config(tmp_path, fresh_engine, max_steps=3),
                                      [load_task(say_task(tmp_path))])
    trainer.train()
    # each step's group is launched while the step before it trains (one step off): at that step's version
    assert seen_versions[0] == 1 and seen_versions == sorted(seen_versions) and seen_versions[-1] >= 2


def test_failed_rollouts_do_not_stop_training(fresh_engine, proxy, tiny_model_dir, tmp_path):
    tasks = [load_task(say_task(tmp_path, "ok")), load_task(say_task(tmp_path, "bad", "Please fail now."))]
    factory = partial(LocalSessionFactory, proxy=proxy.client, harness=SAY_HARNESS, output_dir=tmp_path / "r")
    history = HarnessAsyncGRPOTrainer(str(tiny_model_dir), factory, config(tmp_path, fresh_engine), tasks).train()
    assert len(history) == 2 and history[1]["failed"] == 2 and history[1]["scorable"] == 0


def test_two_groups_per_step_in_the_real_loop(fresh_engine, proxy, tiny_model_dir, tmp_path):
    """Two groups in one step; and the weight sync passed in (TRL's weight_transfer) is the one the trainer uses."""
    from harness_trainer.serving.weight_sync import ReloadSync

    class Counted(ReloadSync):  # the real reload sync, its loads counted
        loads: list[int] = []

        def load(self, model, version, state_dict=None):
            self.loads.append(version)
            return super().load(model, version, state_dict)

    tasks = [load_task(say_task(tmp_path, "one")), load_task(say_task(tmp_path, "two", "Say something else."))]
    factory = partial(LocalSessionFactory, proxy=proxy.client, harness=SAY_HARNESS, output_dir=tmp_path / "r")
    history = HarnessAsyncGRPOTrainer(str(tiny_model_dir), factory, config(
        tmp_path, fresh_engine, max_steps=1, groups_per_step=2), tasks, weight_sync=Counted).train()
    assert len(history) == 1 and history[0]["groups"] == 2 and history[0]["rollouts"] == 4
    assert history[0]["task"] == "one,two" and history[0]["dropped_stale"] == 0
    assert Counted.loads == [1, 2] and history[0]["probe_gap"] < 1e-3  # the cold sync, then the step's


def test_groups_run_ahead_only_as_far_as_max_staleness_allows(fresh_engine, proxy, tiny_model_dir, tmp_path):
    """Real agents, proxy and weight syncs, max_staleness 1 and slots for three groups: two run (one trains while
    the next generates), every call is stamped at most one version behind the step that trains it, and no sampled
    token is thrown away."""
    tasks = [load_task(say_task(tmp_path, "one")), load_task(say_task(tmp_path, "two", "Say something else."))]
    factory = partial(LocalSessionFactory, proxy=proxy.client, harness=SAY_HARNESS, output_dir=tmp_path / "r")
    history = HarnessAsyncGRPOTrainer(str(tiny_model_dir), factory, config(
        tmp_path, fresh_engine, max_staleness=1, max_concurrent_rollouts=6, max_steps=3), tasks).train()
    assert len(history) == 3 and all(h["staleness"] <= 1 and h["discarded_tokens/stale"] == 0 for h in history)
    assert all(h["dropped_stale"] == h["cancelled_in_flight"] == 0 for h in history)


def test_a_stopped_pool_writes_what_finished_and_stops_what_runs(proxy, tmp_path):
    """The rollout pool train and eval share (rollouts/pool.py), stopped as an interrupt stops it while it waits
    for its oldest group: the younger group that had already finished is written (no finished capture lost),
    the running one ends at once, and nothing is written twice."""
    import json

    from harness_trainer.rollouts.pool import RolloutPool

    factory = partial(LocalSessionFactory, proxy=proxy.client, harness=NEVER_ENDING_WHEN_SLOW,
                      output_dir=tmp_path / "r")({})
    slow_task = load_task(say_task(tmp_path, "slow", "Say something slow.", 3600))
    fast_task = load_task(say_task(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    with RolloutPool(factory, out, workers=4) as pool:  # its exit returns only once the slow agents are stopped
        first, second = pool.launch(slow_task, 2, "slow"), pool.launch(fast_task, 2, "fast")
        wait_until(second.done, 300, "the fast group")
        assert not first.done() and [g.task.name for g in pool.pending] == ["slow", "say"]
    written = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert sorted(r["episode_id"] for r in written) == ["fast-0", "fast-1"], written
    assert all(r["status"] == "ok" for r in written)
    assert len((out / "traces.jsonl").read_text().splitlines()) == 2


class TraceBreakingClient(ProxyClient):
    """A stub of the proxy's client for fault injection: a real proxy never exports a broken trace."""

    def trace_json(self, session_id, compact=False):  # answers the whole form: the reader takes either
        wire = super().trace(session_id)
        wire["turns"][0]["loss_mask"][0] = 1  # a trainable prompt token breaks the contract
        return json.dumps(wire).encode()


def test_malformed_capture_stops_the_run(fresh_engine, proxy, tiny_model_dir, tmp_path):
    factory = partial(LocalSessionFactory, proxy=TraceBreakingClient(proxy.url, proxy.admin_key),
                      harness=SAY_HARNESS, output_dir=tmp_path / "r")
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), factory, config(tmp_path, fresh_engine),
                                      [load_task(say_task(tmp_path))])
    with pytest.raises(CaptureContractError, match="breaks the TrainingTrace contract"):
        trainer.train()


RUN = textwrap.dedent("""
    import sys, shlex
    from functools import partial
    from harness_trainer.agents.command import CommandHarness
    from harness_trainer.rollouts.session import LocalSessionFactory
    from harness_trainer.rollouts.tasks import load_task
    from harness_trainer.proxy.client import ProxyClient
    from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer
    engine, proxy, key, model, task, out, script, lora, resume = sys.argv[1:10]
    factory = partial(LocalSessionFactory, proxy=ProxyClient(proxy, key),
                      harness=CommandHarness(f"python3 -c {shlex.quote(script)} {{instruction}}"),
                      output_dir=out + "/r")
    HarnessAsyncGRPOTrainer(model, factory, AsyncGRPOConfig(
        output_dir=out + "/run", vllm_server_base_url=engine, num_generations=2, max_concurrent_rollouts=2,
        max_steps=5, save_steps=1, learning_rate=1e-3, resume_from_checkpoint=resume or None,
        use_peft=lora == "lora", lora_rank=8), [load_task(task)]).train()
""")


@pytest.mark.parametrize("weights", ["full", pytest.param("lora", marks=pytest.mark.slow)])
def test_kill_and_resume_trains_every_step_exactly_once(fresh_engine, proxy, tiny_model_dir, tmp_path, weights):
    task = say_task(tmp_path)
    argv = [sys.executable, "-c", RUN, fresh_engine.url, proxy.url, proxy.admin_key, str(tiny_model_dir),
            str(task), str(tmp_path), SAY, weights]
    first = subprocess.Popen(argv + [""], start_new_session=True)
    deadline = time.monotonic() + 240
    while not (tmp_path / "run" / "checkpoint-2").exists():
        assert first.poll() is None and time.monotonic() < deadline, "the first run ended before step 2"
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    subprocess.run(argv + [str(tmp_path / "run" / "latest")], check=True, timeout=300)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in metrics]
    assert steps == sorted(set(steps)) and steps[-1] == 5 and set(range(3, 6)) <= set(steps)
    if weights == "lora":  # the resumed run went on syncing adapters by name, each probed
        assert all(m["probe_gap"] < 1e-3 for m in metrics)
        assert (tmp_path / "run" / "checkpoint-5" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_reward_rises_from_the_random_tiny_model(tmp_path):
    """The learning proof at its smallest: a 320-token-vocabulary tiny model, an agent program of a few lines,
    a reward that depends only on what the model says (its answer starts with a digit: 10 tokens of 326),
    real proxy, real sandbox, real weight syncs."""
    from harness_trainer.models.tiny import TinyModelSpec, ensure_tiny_model
    from harness_trainer.proxy.client import ProxyServer
    from harness_trainer.serving.engine import EngineConfig, VLLMServer

    model = ensure_tiny_model(TinyModelSpec(vocab=320))
    with VLLMServer(EngineConfig(model=str(model), max_model_len=4096)) as engine, \
            ProxyServer(engine.url, model="tiny") as proxy:
        factory = partial(LocalSessionFactory, proxy=proxy.client, harness=SAY_HARNESS, output_dir=tmp_path / "r")
        history = HarnessAsyncGRPOTrainer(str(model), factory, AsyncGRPOConfig(
            output_dir=str(tmp_path / "run"), vllm_server_base_url=engine.url, num_generations=16,
            max_concurrent_rollouts=16, max_steps=30, learning_rate=2e-2, max_completion_tokens=4, save_steps=100),
            # the default trust region: from a random model a rewarded token starts near 1/326; a bound on the ratio
            # (x1.2 a step) would need far more than 30 steps to lift it, the bound on the probability move does not
            [load_task(say_task(tmp_path))]).train()
    rewards = [h.get("reward_mean") or 0.0 for h in history]
    # Learning, by a margin: the first step's groups were sampled by the random model (≈ 0.03 rewarded); the
    # best 5-step stretch after it is far above. Not a window the trainer could beat by learning early.
    best = max(sum(rewards[i:i + 5]) / 5 for i in range(1, len(rewards) - 4))
    assert rewards[0] < 0.2 and best > rewards[0] + 0.5, rewards
