"""R1: faults injected during real training runs (tiny model, real vLLM, real proxy, real bubblewrap sandboxes,
an agent program that retries its API as real ones do). For each: the run ends in bounded time (done, or
stopped with a clear error), no finished turn is lost, every trace is valid, every step is logged once.

The trainer killed -9 mid-run and resumed is
tests/training/test_trainer_end_to_end.py::test_kill_and_resume_trains_every_step_exactly_once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from functools import partial
from pathlib import Path

import pytest
from faults import AGENT_HARNESS
from say_agent import say_task  # reward 1 when the agent's answer starts with a digit
from stubs import Link, wait_until

from harness_trainer._exceptions import TrainingStopped
from harness_trainer.proxy.client import ProxyClient, ProxyServer
from harness_trainer.rollouts.session import LocalSessionFactory
from harness_trainer.rollouts.tasks import load_task
from harness_trainer.serving.process import free_port
from harness_trainer.serving.supervise import Supervisor
from harness_trainer.traces.files import TrainingTrace
from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer


def make_trainer(tmp_path: Path, model, engine_url: str, proxy: ProxyClient, instruction: str,
                 agent_timeout_s: float | None = None, **overrides) -> HarnessAsyncGRPOTrainer:
    task = load_task(say_task(tmp_path / "tasks", "fault", instruction))
    factory = partial(LocalSessionFactory, proxy=proxy, harness=AGENT_HARNESS, output_dir=tmp_path / "r",
                      agent_timeout_s=agent_timeout_s)
    args = dict(output_dir=str(tmp_path / "run"), vllm_server_base_url=engine_url, num_generations=2,
                max_concurrent_rollouts=2, max_steps=2, learning_rate=1e-3, max_completion_tokens=48, save_steps=1,
                service_recovery_timeout_s=240)
    return HarnessAsyncGRPOTrainer(str(model), factory, AsyncGRPOConfig(**args | overrides), [task])


def records(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def steps(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def turns(tmp_path: Path) -> dict[str, int]:
    """Captured turns per rollout (episode id), each trace validated against the contract."""
    out: dict[str, int] = {}
    for line in (tmp_path / "run" / "traces.jsonl").read_text().splitlines():
        trace = TrainingTrace.model_validate(json.loads(line))
        episode = trace.turns[0].metadata["episode_id"]
        out[episode] = out.get(episode, 0) + len(trace.turns)
    return out


def assert_steps_once(tmp_path: Path, n: int) -> None:
    assert [m["step"] for m in steps(tmp_path)] == list(range(1, n + 1))


def test_an_agent_that_hangs_is_stopped_at_its_timeout_and_keeps_its_turn(fresh_engine, proxy, tiny_model_dir,
                                                                         tmp_path):
    started = time.monotonic()
    make_trainer(tmp_path, tiny_model_dir, fresh_engine.url, proxy.client, "Say a number, then hang.",
                 agent_timeout_s=6).train()
    assert time.monotonic() - started < 150
    assert_steps_once(tmp_path, 2)
    done = records(tmp_path)
    assert done and all(r["status"] == "timeout" for r in done)
    assert all(n == 1 for n in turns(tmp_path).values()) and len(turns(tmp_path)) == len(done)


def test_an_agent_that_crashes_keeps_its_turn_and_says_so(fresh_engine, proxy, tiny_model_dir, tmp_path):
    make_trainer(tmp_path, tiny_model_dir, fresh_engine.url, proxy.client, "Say a number, then crash.").train()
    assert_steps_once(tmp_path, 2)
    done = records(tmp_path)
    assert all(r["status"] == "ok" and "killed by SIGKILL" in r["reason"] for r in done), done[0]["reason"]
    assert all(n == 1 for n in turns(tmp_path).values()) and len(turns(tmp_path)) == len(done)


def test_a_sandbox_killed_under_its_agent_ends_the_rollout_at_once(fresh_engine, proxy, tiny_model_dir, tmp_path):
    stop, killed = threading.Event(), []

    def kill_sandboxes():  # every agent sandbox, once its agent has written its answer (its call is captured)
        while not stop.wait(0.2):
            found = subprocess.run(["pgrep", "-f", f"^bwrap .*{tmp_path}.*OPENAI_MODEL"], capture_output=True,
                                   text=True).stdout.split()
            for pid in map(int, found):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
                except OSError:
                    continue  # gone meanwhile
                app = next((a for a, b in zip(argv, argv[1:]) if b == "/app"), None)  # --bind TRIAL/app /app
                if app and Path(app, "answer.txt").exists() and pid not in killed:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)

    killer = threading.Thread(target=kill_sandboxes, daemon=True)
    killer.start()
    started = time.monotonic()
    try:
        make_trainer(tmp_path, tiny_model_dir, fresh_engine.url, proxy.client, "Say a number, then hang.").train()
    finally:
        stop.set()
    assert time.monotonic() - started < 150 and len(killed) >= 4  # not the agents' 120 s timeout, twice
    assert_steps_once(tmp_path, 2)
    done = records(tmp_path)
    assert all(r["status"] == "ok" and "with its sandbox" in r["reason"] for r in done), done[0]["reason"]
    assert all(n == 1 for n in turns(tmp_path).values()) and len(turns(tmp_path)) == len(done)


def test_the_proxy_killed_9_mid_rollout_is_restarted_and_loses_no_turn(fresh_engine, tiny_model_dir, tmp_path):
    proxy = ProxyServer(fresh_engine.url, port=free_port(), journal=tmp_path / "journal",
                        log_path=tmp_path / "proxy.log").start()
    with Supervisor({"the capture proxy": (proxy.managed, 30)}) as supervisor:
        def kill_once():  # when the first rollout has its first turn, and waits to make its second
            wait_until(lambda: any(s["calls"] == 1 for s in proxy.client.http.get("/sessions").json()["sessions"]),
                       120, "a first captured turn")
            os.killpg(proxy.managed.process.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once, daemon=True)
        killer.start()
        make_trainer(tmp_path, tiny_model_dir, fresh_engine.url, proxy.client,
                     "Say a number, then twice.").train()
        killer.join()
    proxy.stop()
    assert len(supervisor.restarts) == 1 and supervisor.restarts[0].seconds < 30
    print(f"fault: proxy killed -9, back in {supervisor.restarts[0].seconds:.1f} s")
    assert_steps_once(tmp_path, 2)
    done = records(tmp_path)
    assert sum(r["status"] == "ok" for r in done) >= 3, [r["reason"] for r in done]
    captured = turns(tmp_path)
    for r in done:  # a rollout that ran through the restart still has both its turns
        if r["status"] == "ok":
            assert captured[r["episode_id"]] == 2, r


@pytest.mark.slow  # a second vLLM start (~1 min)
def test_vllm_killed_mid_stream_is_restarted_and_synced_again(fresh_engine, proxy, tiny_model_dir, tmp_path):
    if fresh_engine.managed is None:
        pytest.skip("the engine is attached (HARNESS_TEST_VLLM_URL): this test restarts the session's own")
    trainer = make_trainer(tmp_path, tiny_model_dir, fresh_engine.url, proxy.client, "Say a stream of numbers.",
                           max_steps=3)
    with Supervisor({"vLLM": (fresh_engine.managed, fresh_engine.cfg.startup_timeout_s)}) as supervisor:
        def kill_mid_stream():  # after step 1, while a stream is being sampled
            wait_until(lambda: (tmp_path / "run" / "metrics.jsonl").exists(), 300, "step 1")
            wait_until(lambda: proxy.client.policy_state()["in_flight"], 120, "a call in flight", poll_s=0.01)
            os.killpg(fresh_engine.managed.process.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_mid_stream, daemon=True)
        killer.start()
        started = time.monotonic()
        trainer.train()
        killer.join()
    assert len(supervisor.restarts) == 1 and time.monotonic() - started < 480
    print(f"fault: vLLM killed -9 mid-stream, back in {supervisor.restarts[0].seconds:.1f} s, run "
          f"{time.monotonic() - started:.0f} s")
    assert_steps_once(tmp_path, 3)
    recovered = [line for m in steps(tmp_path) for line in m.get("recovered", [])]
    assert any("restarted without the policy" in line for line in recovered), recovered
    assert trainer.last_probe_gap < 1e-3  # the engine serves the trainer's weights again
    for r in records(tmp_path):
        assert r["status"] in ("ok", "unscorable", "cancelled"), r
        if r["status"] == "ok":
            assert turns(tmp_path)[r["episode_id"]] >= 1


def test_an_engine_gone_for_good_stops_the_run_with_a_clear_error(fresh_engine, tiny_model_dir, tmp_path):
    link = Link(int(fresh_engine.url.rsplit(":", 1)[1]))
    with ProxyServer(link.url, model="tiny", log_path=tmp_path / "proxy.log") as proxy:
        trainer = make_trainer(tmp_path, tiny_model_dir, link.url, proxy.client, "Say a number.",
                               agent_timeout_s=10, max_steps=4, service_recovery_timeout_s=5, save_steps=10)
        cut = threading.Thread(target=lambda: (wait_until(lambda: (tmp_path / "run" / "metrics.jsonl").exists(),
                                                          300, "step 1"), link.cut()), daemon=True)
        cut.start()
        with pytest.raises(TrainingStopped, match="the engine at .* has not answered for 5 s") as stopped:
            trainer.train()
        stopped_after = time.monotonic() - link.cut_at
    assert "resume the run from" in str(stopped.value)
    # bounded: the agents' timeout (10 s) and the recovery bound (5 s) are fixed; the verifier and the step take
    # what the machine gives them (20 s alone, far more beside a CPU hog), so they get a wide margin
    assert stopped_after < 10 + 5 + 120
    print(f"fault: engine gone, run stopped {stopped_after:.1f} s after the cut")
    logged = [m["step"] for m in steps(tmp_path)]
    assert logged and (tmp_path / "run" / f"checkpoint-{logged[-1]}").exists()  # the last step is kept


def test_a_stalled_weight_sync_stops_in_bounded_time_and_resumes_without_losing_the_step(fresh_engine, proxy,
                                                                                          tiny_model_dir, tmp_path):
    link = Link(int(fresh_engine.url.rsplit(":", 1)[1]))
    trainer = make_trainer(tmp_path, tiny_model_dir, link.url, proxy.client, "Say a number.", max_steps=3,
                           weight_sync_timeout_s=3, save_steps=10)
    stall = threading.Thread(target=lambda: (wait_until(lambda: (tmp_path / "run" / "metrics.jsonl").exists(), 300,
                                                        "step 1"), link.hold(b"/collective_rpc")), daemon=True)
    stall.start()
    with pytest.raises(TrainingStopped, match="weight sync at step 2 failed: .*timed out after 3"):
        trainer.train()
    print(f"fault: sync stalled, run stopped {time.monotonic() - link.held_at:.1f} s after the stall")
    logged = steps(tmp_path)
    assert [m["step"] for m in logged] == [1, 2] and "timed out" in logged[-1]["stopped"]
    link.hold(None)
    make_trainer(tmp_path, tiny_model_dir, link.url, proxy.client, "Say a number.", max_steps=3,
                 resume_from_checkpoint=str(tmp_path / "run" / "latest")).train()
    assert_steps_once(tmp_path, 3)  # step 2 trained once: kept at the stall, not trained again on resume
    link.cut()
