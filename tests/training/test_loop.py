"""The trainer's loop (training/trainer.py) with a stub for each collaborator, as TRL tests its async trainer: a
scripted session factory (no agent, no proxy), a policy with no model, an engine sync with no engine. What is
real here is the loop itself and the rollout pool it drives: groups, staleness, cancellation, syncs, the
checkpoint and the metrics line of each step, resume, and the stops. No clock: a rollout "still running" is held
on an event the test owns. And the loop alone, on a rollout source with no threads (the `rollouts=` seam). The
real parts end to end: tests/training/test_trainer_end_to_end.py."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from stubs import ScriptedSessions, StubPolicy, StubSync, scripted_turns

from harness_trainer import TrainingStopped
from harness_trainer.rollouts.session import run_rollout
from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer, task_index


@dataclass
class Task:
    name: str
    agent_timeout_s: float = 60.0


def rewarded(task, index: int, episode: str, version: int):
    """Rollout i of a group is rewarded when i is even: every group has a gradient."""
    return scripted_turns([1, 5, 7], [20 + index, 21], version), float(index % 2 == 0)


def trainer(tmp_path, sessions=None, sync=None, policy=None, tasks=("a", "b"), rollouts=None, **settings):
    sync = sync or StubSync()
    sessions = sessions or ScriptedSessions(rewarded, version=lambda: sync.version)
    args = AsyncGRPOConfig(**{"output_dir": str(tmp_path / "run"), "vllm_server_base_url": "http://stub",
                              "num_generations": 2, "max_concurrent_rollouts": 2, "max_steps": 3, "save_steps": 1,
                              "shuffle_dataset": False, **settings})
    return HarnessAsyncGRPOTrainer(None, sessions, args, [Task(t) for t in tasks], policy=policy or StubPolicy(),
                                   sync=sync, **({"rollouts": rollouts} if rollouts else {}))


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_step_trains_one_group_then_syncs_and_saves(tmp_path):
    run = trainer(tmp_path)
    history = run.train()
    assert [h["step"] for h in history] == [1, 2, 3] and run.sync.synced == [0, 1, 2, 3]  # the cold sync first
    assert [h["version"] for h in history] == [2, 3, 4] and run.version == 4
    assert [h["task"] for h in history] == ["a", "b", "a"] and all(h["trained_tokens"] == 4 for h in history)
    assert [len(episodes) for _, episodes in run.policy.steps] == [2, 2, 2]
    assert [m["step"] for m in lines(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    assert len(lines(tmp_path / "run" / "rollouts.jsonl")) == 6 and run.sync.closed and run.factory.closed
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert run.factory.sampling.training and run.factory.sampling.max_tokens_cap == 256  # its SamplingPolicy
    # where each step's time went (training/timing.py): the stub sync has no engine, so no rollout-side idle
    for h in history:
        assert h["sampled_tokens"] == 4 and h["discarded_tokens/stale"] == h["discarded_tokens/flat"] == 0
        assert 0 <= h["trainer/idle_ratio"] <= 1 and h["wait_for_groups_s"] <= h["step_time_s"]
        assert h["generation_s"] >= 0 and "rollouter/idle_ratio" not in h


class InlineRollouts:
    """A RolloutSource (training/protocols.py) with no threads: a group's rollouts run to their end as it is
    launched, one after another, and are scored as the pool scores them. Made as the trainer makes RolloutPool."""
    made: list[InlineRollouts] = []

    def __init__(self, factory, out, workers, score, on_launch=None, on_rollout=None):
        self.factory, self.score, self.pending, self.closed, self.cancels = factory, score, deque(), False, 0
        InlineRollouts.made.append(self)

    def launch(self, task, n, episode, version=0):
        records = [run_rollout(self.factory, task, f"{episode}-{i}") for i in range(n)]
        self.score(records, task)
        self.pending.append(SimpleNamespace(task=task, records=records))

    def next(self):
        return self.pending.popleft()

    def cancel_stale(self, version, max_staleness):
        self.cancels += 1
        return 0

    def discard(self):
        self.pending.clear()

    def close(self):
        self.closed = True


def test_the_loop_runs_on_a_rollout_source_of_its_own_with_no_threads(tmp_path):
    """rollouts= takes the maker of any RolloutSource (RolloutPool by default, TRL's rollout_worker=): the loop
    trains what it yields, cancels stale work after each sync, and closes the source it made."""
    InlineRollouts.made.clear()
    run = trainer(tmp_path, rollouts=InlineRollouts)
    history = run.train()
    (source,) = InlineRollouts.made
    assert [h["step"] for h in history] == [1, 2, 3] and [h["task"] for h in history] == ["a", "b", "a"]
    assert source.closed and source.cancels == 3 and run.sync.synced == [0, 1, 2, 3]
    assert [len(episodes) for _, episodes in run.policy.steps] == [2, 2, 2] and len(run.factory.created) == 2 * 3


def test_no_group_is_launched_that_could_not_train_within_max_staleness(tmp_path, caplog):
    """max_staleness 1, slots for three groups, one a step: a third group in flight would be two versions old
    when collected (groups are collected in launch order, a sync each step), so at most two run; every group
    launched trains and nothing sampled is discarded. The start says why the third slot is not used."""
    run = trainer(tmp_path, tasks=("a", "b", "c"), max_staleness=1, max_concurrent_rollouts=6, max_steps=4)
    with caplog.at_level("WARNING", logger="harness_trainer"):
        history = run.train()
    assert [h["task"] for h in history] == ["a", "b", "c", "a"] and all(h["staleness"] <= 1 for h in history)
    assert all(h["dropped_stale"] == h["cancelled_in_flight"] == h["discarded_tokens/stale"] == 0 for h in history)
    # launched: two at the start, then one a step (the fifth group still runs at the end and is stopped)
    assert len(run.factory.created) == 2 * 5
    assert "at most 4 rollouts run at once" in caplog.text and "Raise max_staleness to 2" in caplog.text


def test_a_stale_rollout_leaves_its_group_and_the_rest_trains(tmp_path):
    """Each rollout is judged by the versions it would train on: rollout 0 of every group was stamped one version
    behind (its first call before the last sync); with max_staleness 0 it alone is dropped, counted, and the group
    trains on the other two."""
    sync = StubSync()

    def first_one_behind(task, index, episode, version):
        return scripted_turns([1, 5, 7], [20 + index, 21], version - (index == 0)), float(index % 2 == 0)

    run = trainer(tmp_path, ScriptedSessions(first_one_behind, version=lambda: sync.version), sync, num_generations=3,
                  max_concurrent_rollouts=3, max_staleness=0, max_steps=2)
    history = run.train()
    assert all(h["dropped_stale_rollouts"] == 1 and h["dropped_stale"] == 0 for h in history)
    assert all(h["discarded_tokens/stale"] == 2 and h["sampled_tokens"] == 4 for h in history)
    assert [sorted(e[-1] for e in episodes) for _, episodes in run.policy.steps] == [["1", "2"], ["1", "2"]]


def test_the_synchronous_loop_launches_only_what_its_step_needs(tmp_path):
    """max_staleness 0: a group launched ahead would be a version old at the sync, so none is: every rollout is
    trained on and nothing is discarded, however many rollouts may be in flight."""
    run = trainer(tmp_path, max_staleness=0, max_concurrent_rollouts=8)
    history = run.train()
    assert len(lines(tmp_path / "run" / "rollouts.jsonl")) == 6 and len(run.factory.created) == 6
    assert all(h["dropped_stale"] == h["cancelled_in_flight"] == h["discarded_tokens/stale"] == 0 for h in history)


def test_a_resumed_run_trains_every_step_once_from_the_checkpoint(tmp_path):
    first = trainer(tmp_path, max_steps=2)
    first.train()
    resumed = trainer(tmp_path, max_steps=4, resume_from_checkpoint=str(tmp_path / "run" / "latest"))
    assert resumed.step == 2 and resumed.version == 3 and resumed.task_cursor == first.task_cursor
    assert resumed.policy.restored["path"].endswith("checkpoint-2")
    history = resumed.train()
    assert [h["step"] for h in history] == [3, 4]
    assert [m["step"] for m in lines(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_service_gone_for_good_stops_the_run_with_its_last_step_kept(tmp_path):
    run = trainer(tmp_path, sync=StubSync(stop_services_at=2), save_steps=10)
    with pytest.raises(TrainingStopped, match="has not answered"):
        run.train()
    assert [m["step"] for m in lines(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert (tmp_path / "run" / "checkpoint-2").exists()  # kept whatever save_steps says


def test_a_failed_sync_keeps_the_step_it_follows(tmp_path):
    run = trainer(tmp_path, sync=StubSync(stop_sync_at=2), save_steps=10)
    with pytest.raises(TrainingStopped, match="weight sync at step 2 failed"):
        run.train()
    logged = lines(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in logged] == [1, 2] and "failed" in logged[-1]["stopped"]
    assert (tmp_path / "run" / "checkpoint-2").exists()


def test_dynamic_sampling_replaces_groups_without_a_gradient_up_to_its_cap(tmp_path):
    def only_b_varies(task, index, episode, version):
        return scripted_turns([1, 5], [30 + index], version), float(task.name == "b" and index == 0)

    sync = StubSync()
    run = trainer(tmp_path, ScriptedSessions(only_b_varies, version=lambda: sync.version), sync, max_steps=2,
                  dynamic_sampling=True, dynamic_sampling_max_tries=2)
    history = run.train()
    assert [h["task"] for h in history] == ["b", "b"]  # "a" (all 0) was skipped each time
    assert history[0]["dynamic_skipped"] == 1 and history[0]["groups_collected"] == 2
    assert history[0]["discarded_tokens/flat"] == 2 and history[0]["sampled_tokens"] == 2  # one token a rollout

    only_a = trainer(tmp_path / "cap", ScriptedSessions(only_b_varies), tasks=("a",), max_steps=1,
                     dynamic_sampling=True, dynamic_sampling_max_tries=3)
    (step,) = only_a.train()
    assert step["groups_collected"] == 3 and "0 of 1 groups could train" in step["warnings"][0]


def test_dataset_order_is_shuffled_per_pass_and_resumes_from_the_cursor():
    order = [task_index(cursor, 6, seed=3) for cursor in range(12)]
    assert sorted(order[:6]) == sorted(order[6:]) == list(range(6))  # every pass sees every task once
    assert order[:6] != list(range(6)) and order[:6] != order[6:]  # shuffled, and differently each pass
    assert [task_index(cursor, 6, seed=3) for cursor in range(7, 12)] == order[7:12]  # the cursor alone decides
    assert [task_index(cursor, 3, seed=3, shuffle=False) for cursor in range(4)] == [0, 1, 2, 0]
