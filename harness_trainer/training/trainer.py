"""Async GRPO over unmodified agents: rollouts keep running while the trainer steps.

    for each step:
        fill the rollout pool up to max_concurrent_rollouts (groups of num_generations rollouts of one task:
        an unmodified agent in a sandbox, rollouts/session.py, or a white-box environment, rollouts/environments.py)
        score each finished group: reward functions over the group, rollout_reward_fn per rollout (rollouts/rewards.py)
        take the groups_per_step oldest finished groups; a rollout whose oldest turn is more than max_staleness
        versions old leaves its group (rollouts still running whose oldest turn is that old are stopped after each
        sync; the others go on across it), and a group with fewer than two left is dropped
        the engine and proxy must answer (waited for up to service_recovery_timeout_s: the CLI restarts
        them, supervise.py); one that restarted gets the policy back, and a restarted engine's rollouts are
        discarded (they may have sampled the weights it was launched with)
        rewards -> advantages per group -> chains -> prefix-tree packing -> loss -> one optimizer step
        (the tree in micro-batches of max_tokens_per_microbatch tokens, memory linear in its tokens:
         tree_forward.py; the proximal logprobs are the training forward's own, detached)
        (learning rate from the schedule: warmup_ratio, lr_scheduler_type, as in TRL)
        trust region: stale tokens past the clip range of their ratio to the behaviour policy get no gradient;
                      a step that moves a trained token's probability by more than a factor 1 +- step_clip,
                      or its batch by more than max_step_kl on average, is halved until it does not
        stability: ratios, trust-region cuts, IS weights, entropy, KL to the behaviour policy, answer length;
                   a warning when entropy or KL jumps or every rollout of the step scored zero
        every weight_sync_steps: weights -> the same vLLM (the weight sync), version += 1 in vLLM and the proxy,
                                 probe: vLLM's teacher-forced logprobs must equal the trainer's
        every save_steps: checkpoint (model, optimizer, step, version, RNG, dataset position)
        save_best: best/ holds the model after the step with the best training reward (mean of best_window steps)

Staleness is read from the policy version the proxy stamped on each captured turn, not from dispatch time.
A failed rollout never stops the loop; a malformed capture (CaptureContractError) always does. A stop
(TrainingStopped: a service gone past the bound, a failed sync) keeps the last trained step as a checkpoint.

The settings: config.py. The rollouts in flight (eval uses the same pool): rollouts/pool.py. The model, its
optimizer and ranks: policy.py (one optimizer step: step.py). The weight sync and its probe: policy_sync.py.
Data parallel: distributed.py. Checkpoints and best/: checkpoints.py. The trust region for fresh tokens and
the collapse warnings: trust_region.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from harness_trainer._exceptions import ConfigError, TrainingStopped
from harness_trainer.proxy.capture import SamplingPolicy
from harness_trainer.rollouts.config import check_white_box
from harness_trainer.rollouts.environments import load_rows
from harness_trainer.rollouts.pool import RolloutPool
from harness_trainer.rollouts.rewards import resolve_rewards, score_group
from harness_trainer.rollouts.services import environment_sessions
from harness_trainer.rollouts.session import RolloutRecord
from harness_trainer.rollouts.tasks import Task
from harness_trainer.serving.placement import Placement, resolve_weight_sync
from harness_trainer.serving.teacher import Teacher
from harness_trainer.serving.weight_sync import WeightSync
from harness_trainer.training.checkpoints import BestModel, LoopState, load_checkpoint, save_checkpoint
from harness_trainer.training.config import AsyncGRPOConfig
from harness_trainer.training.distill import score_with_teacher
from harness_trainer.training.distributed import FAILED, broadcast, init_distributed, trainer_device, trainer_placement
from harness_trainer.training.grpo import group_advantages
from harness_trainer.training.policy import Policy
from harness_trainer.training.policy_sync import PolicySync, preflight
from harness_trainer.training.protocols import EngineSync, RolloutSource, TeacherModel, TrainablePolicy
from harness_trainer.training.timing import StepClock, overlap_warnings, sampled_tokens
from harness_trainer.training.trust_region import StabilityMonitor

log = logging.getLogger("harness_trainer")


def task_index(cursor: int, n: int, seed: int, shuffle: bool = True) -> int:
    """The dataset's task at position `cursor` of the run: each pass over the n tasks in its own seeded order, so
    the cursor alone fixes the position (a resumed run goes on where the checkpoint was)."""
    epoch, index = divmod(cursor, n)
    return random.Random(f"{seed}-{epoch}").sample(range(n), n)[index] if shuffle else index


class HarnessAsyncGRPOTrainer:
    """The loop (rollouts -> step -> sync -> checkpoint) over its collaborators, each typed by a Protocol and built
    here only when none is passed in (TRL's async_grpo): the session factory (rollouts/session.py SessionFactory),
    `rollouts` (a RolloutSource's maker: RolloutPool, TRL's rollout_worker), `policy` (TrainablePolicy: Policy),
    `sync` (EngineSync: PolicySync, given `weight_sync`), `teacher` (TeacherModel: from teacher_url)."""
    pool: RolloutSource | None = None  # the rollouts in flight, while the loop runs

    def __init__(self, model, harness_session_factory=None, args: AsyncGRPOConfig | None = None,
                 train_dataset: list | None = None, rollout_reward_fn=None, callbacks: list | None = None, *,
                 environment_factory=None, reward_funcs=None, weight_sync: Callable[[str], WeightSync] | None = None,
                 policy: TrainablePolicy | None = None, sync: EngineSync | None = None,
                 placement: Placement | None = None, rollouts: Callable[..., RolloutSource] = RolloutPool,
                 teacher: TeacherModel | None = None):
        """Black-box: harness_session_factory (SamplingPolicy -> SessionFactory: a partial of LocalSessionFactory)
        and Harbor tasks. White-box, as TRL's GRPOTrainer takes it: environment_factory (the class), reward_funcs
        (group functions, rewards.py) and train_dataset rows with a `prompt` column; the trainer then runs its own
        capture proxy in front of vllm_server_base_url (rollouts/services.py). callbacks: objects with any of
        on_launch(n), on_rollout(record_or_exception), on_step(metrics), log(metrics).
        The parts, each built from `args` when not given: policy (from `model`, a folder or a loaded model);
        sync (the policy into the engines; weight_sync: engine url -> the WeightSync that loads one engine, TRL's
        weight_transfer, by default the backend weight_sync_backend names); placement (serving/placement.py: the
        run's GPU layout, decided once by the caller that launched the engines, else from args here)."""
        args = args or AsyncGRPOConfig()
        args.check()  # a config changed after it was made is checked again (training/config.py)
        check_white_box(environment_factory is not None, bool(reward_funcs) or rollout_reward_fn is not None,
                        "an environment_factory", "reward_funcs")
        self.args = args
        placement = placement or trainer_placement(args)
        backend = None if sync else resolve_weight_sync(args.weight_sync_backend, args.use_peft, placement)
        if backend:  # the default sync's backend can run on this machine, before anything is loaded (once a process)
            preflight(backend, int(os.environ.get("WORLD_SIZE", "1")))
        device = trainer_device(placement)  # one device per rank: the rank's GPU of the placement, else the CPU
        self.rank, self.world_size = init_distributed(device)
        self.policy = policy or Policy(model, args, device, self.rank, self.world_size)
        self.lead_failed = False  # a follower's view: rank 0's loop ended in an error (no final save will come)
        self.own_proxy = None  # the capture proxy a white-box run given no session factory starts for itself
        self.factory = self._sessions(harness_session_factory, environment_factory) if self.rank == 0 else None
        self.tasks = list(train_dataset or [])
        if self.tasks and isinstance(self.tasks[0], dict):  # dataset rows (white-box), not Harbor tasks
            self.tasks = load_rows(self.tasks)
        if not self.tasks:
            raise ConfigError("train_dataset is empty: give at least one task")
        self.reward_fn, self.reward_funcs = resolve_rewards(rollout_reward_fn, reward_funcs)
        self.make_rollouts, self.own_teacher = rollouts, teacher is None  # a teacher passed in: its maker closes it
        self.teacher = teacher or self._teacher()
        self.out = Path(args.output_dir)
        self.sync = sync or PolicySync(self.policy, args, getattr(self.factory, "proxy", None), backend,
                                       weight_sync, self.out)
        self.monitor = StabilityMonitor()
        self.step, self.task_cursor = 0, 0
        self.out.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(args.seed)
        torch.manual_seed(args.seed)
        self.history: list[dict] = []
        self.callbacks = list(callbacks or [])
        self.best = BestModel(self.out, args.best_window)
        if args.resume_from_checkpoint:
            self._restore(load_checkpoint(Path(args.resume_from_checkpoint), self.policy))

    def _sessions(self, harness_session_factory, environment_factory):
        """The run's session factory, made with the trainer's sampling policy (rank 0 only: the others never run a
        rollout); given only an environment_factory, over a capture proxy of its own."""
        args = self.args
        if environment_factory is not None and harness_session_factory is None:
            harness_session_factory, self.own_proxy = environment_sessions(
                environment_factory, args.vllm_server_base_url, args.output_dir,
                max_completion_length=args.max_completion_length,
                max_tool_calling_iterations=args.max_tool_calling_iterations)
        return harness_session_factory(SamplingPolicy(
            training=True, temperature=args.temperature, max_tokens_cap=args.max_completion_tokens))

    def _teacher(self) -> TeacherModel | None:
        """On-policy distillation: the engine that scores the student's tokens (distill.py), on rank 0."""
        if not self.args.teacher_url or self.rank != 0:
            return None
        teacher = Teacher(self.args.teacher_url, timeout_s=self.args.weight_sync_timeout_s * 5)
        if self.policy.model_dir is not None:
            teacher.check_tokenizer(str(self.policy.model_dir))
        return teacher

    @property
    def version(self) -> int:
        """The policy version the engines serve (the sync's)."""
        return self.sync.version

    @version.setter
    def version(self, value: int) -> None:
        self.sync.version = value

    @property
    def model(self):
        return self.policy.model

    @property
    def last_probe_gap(self) -> float | None:
        return self.sync.last_probe_gap

    # ---- rollouts ----------------------------------------------------------------------------------------

    def _next_task(self) -> Task:
        task = self.tasks[task_index(self.task_cursor, len(self.tasks), self.args.seed, self.args.shuffle_dataset)]
        self.task_cursor += 1
        return task

    def _notify(self, hook: str, payload) -> None:
        for callback in self.callbacks:
            if fn := getattr(callback, hook, None):
                fn(payload)

    def _score(self, records: list[RolloutRecord], task=None) -> None:
        """The group's rewards, on rank 0 before anything is written or broadcast."""
        score_group(records, self.reward_funcs, self.reward_fn, getattr(task, "row", None))
        if self.teacher is not None:
            score_with_teacher(self.teacher, records)

    def score(self, groups: list[list[RolloutRecord]]) -> list[list[RolloutRecord]]:
        """Groups built outside the rollout pool (a test, a bench, a loop of your own), scored in place by the
        trainer's reward functions, as the pool scores its own; returns them."""
        for records in groups:
            self._score(records)
        return groups

    # ---- checkpoints (harness_trainer/training/checkpoints.py) ------------------------------------------------------

    def save_model(self, path: str | Path) -> Path:
        """The policy in Hugging Face format, with its tokenizer: a folder vLLM can serve (with LoRA: the merged
        model, and the adapter in adapter/). Every rank calls it under FSDP; rank 0 writes."""
        return self.policy.save_model(path)

    def _save(self) -> Path:
        # the cursor of the oldest group not yet trained: a resumed run launches the groups that were in flight
        # (lost with the process) again, in the same order, under the same names
        cursor = self.task_cursor - (len(self.pool.pending) if self.pool is not None else 0)
        state = LoopState(self.step, self.version, cursor, self.rng.getstate(), self.best.state())
        return save_checkpoint(self.out, self.policy, state, self.args.save_total_limit)

    def _restore(self, state: LoopState) -> None:
        self.step, self.version, self.task_cursor = state.step, state.version, state.task_cursor
        self.rng.setstate(state.rng)
        self.best.restore(state.best)

    # ---- the loop ----------------------------------------------------------------------------------------

    def train(self) -> list[dict]:
        if self.rank != 0:
            return self._follow()
        finished = False
        try:
            with self.policy.lead(), self.own_proxy or contextlib.nullcontext():
                history = self._lead()
            finished = True
            return history
        finally:
            if self.world_size > 1:  # releases the other ranks, saying whether the run finished
                broadcast(None if finished else FAILED)
            self.sync.close()
            if self.teacher is not None and self.own_teacher:
                self.teacher.close()
            if (close := getattr(self.factory, "close", None)) is not None:  # one of your own may have none
                close()  # the factory it made: what its sessions shared (containers started ahead)

    def _follow(self) -> list[dict]:
        """Ranks > 0: take rank 0's groups and step in lockstep with it until it says stop; join the collectives
        it names (the policy's whole weights, optimizer state, the probe's forward)."""
        while (message := broadcast(None)) is not None:
            if message == FAILED:
                self.lead_failed = True
                break
            if isinstance(message, str):
                self.policy.together(message)
            else:
                self.policy.step(message, self.step)
                self.step += 1
        return self.history

    def _end_step(self, metrics: dict, tasks: list[str], save: bool = False) -> None:
        """Warnings, best/, the checkpoint and the metrics line of a trained step."""
        args = self.args
        metrics.update(step=self.step, version=self.version, task=",".join(tasks))
        metrics.update(self.sync.engine_metrics())  # several engines: each one's sessions, calls, cache hits
        if self.teacher is not None:  # what scoring this step's rollouts cost (since the last step)
            tokens, seconds = self.teacher.take_costs()
            metrics["teacher_tokens"], metrics["teacher_s"] = tokens, round(seconds, 3)
        if recovered := self.sync.take_recovered():  # what was put back since the last step (a restarted service)
            metrics["recovered"] = recovered
        if warnings := metrics.get("warnings", []) + self.monitor.check(metrics):
            metrics["warnings"] = warnings
            for warning in warnings:
                log.warning("step %d: %s", self.step, warning)
        # best/ before the checkpoint, so the checkpoint holds best/'s state after this step
        if args.save_best and self.best.update(self.step, metrics.get("reward_mean"), self.save_model):
            metrics["best"] = True
        if save or self.step % args.save_steps == 0 or self.step == args.max_steps:
            self._save()  # before the metrics line: a logged step is a saved step
        self.history.append(metrics)
        with (self.out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        self._notify("on_step", metrics)
        self._notify("log", metrics)
        if self.step % args.logging_steps == 0:
            log.info("step %d: %s", self.step, {k: v for k, v in metrics.items() if k != "task"})

    def _lead(self) -> list[dict]:
        args = self.args
        groups_in_flight = max(args.groups_per_step, args.max_concurrent_rollouts // args.num_generations)
        for warning in overlap_warnings(args, groups_in_flight):
            log.warning(warning)
        if args.vllm_server_base_url:
            # A cold sync: the engine serves exactly the trainer's weights before the first rollout (after a
            # resume it may still hold weights of a step that was never checkpointed).
            self.sync.sync_weights(self.step)
        workers = max(args.max_concurrent_rollouts, args.num_generations * groups_in_flight)
        with contextlib.closing(self.make_rollouts(  # its close stops what is still in flight
                self.factory, self.out, workers, self._score, on_launch=self._hook("on_launch"),
                on_rollout=self._hook("on_rollout"))) as pool:
            self.pool = pool
            clock, seconds = StepClock(self.sync.engine_time), []  # where each step's time went (timing.py)
            while self.step < args.max_steps:
                with clock.waiting():
                    groups, tasks, metrics = self._collect_step(pool, groups_in_flight, seconds)
                try:
                    weights_put_back = self.sync.ensure_services(self.step)
                except TrainingStopped:
                    if self.step and not (self.out / f"checkpoint-{self.step}").exists():
                        self._save()  # the last logged step is kept, whatever save_steps says
                    raise
                if weights_put_back:
                    # sampled (in part) by the weights the engine was launched with: not this policy's data
                    pool.discard()
                    log.warning("step %d: its rollouts and those in flight are discarded; collecting again",
                                self.step + 1)
                    continue
                started = time.perf_counter()
                if groups:
                    if self.world_size > 1:
                        broadcast(groups)
                    metrics |= self.policy.step(groups, self.step)
                metrics["train_time_s"] = time.perf_counter() - started
                self.step += 1
                if args.vllm_server_base_url and self.step % args.weight_sync_steps == 0:
                    try:
                        metrics["weight_sync_time_s"] = self.sync.sync_weights(self.step)
                    except TrainingStopped as exc:  # the step is trained: keep it, then stop
                        self._end_step(metrics | {"stopped": str(exc)}, tasks, save=True)
                        raise
                    metrics["probe_gap"] = self.sync.last_probe_gap
                    metrics["cancelled_in_flight"] = pool.cancel_stale(self.version, args.max_staleness)
                metrics |= clock.figures(metrics, seconds, groups_in_flight * args.num_generations)
                seconds.clear()
                self._end_step(metrics, tasks)
        return self.history

    def _collect_step(self, pool: RolloutSource, groups_in_flight: int, seconds: list[float]
                      ) -> tuple[list, list[str], dict]:
        """A step's groups_per_step groups, oldest first, the pool kept full. A group with a rollout more than
        max_staleness versions old (or cancelled) is dropped and counted; with dynamic_sampling so is a group
        whose rewards are all equal, and each dropped group is replaced by the next, up to the cap. Each collected
        rollout's seconds go to `seconds`; the tokens sampled for each group, kept or not, to the metrics."""
        args = self.args
        groups, tasks = [], []
        metrics = {"dropped_stale": 0, "dropped_stale_rollouts": 0, "cancelled": 0, "staleness": 0, "sampled_tokens": 0,
                   "discarded_tokens/stale": 0, "discarded_tokens/flat": 0}
        tries = args.groups_per_step * (args.dynamic_sampling_max_tries if args.dynamic_sampling else 1)
        looked = 0
        while len(groups) < args.groups_per_step and looked < tries:
            self._fill(pool, groups_in_flight, args.groups_per_step - len(groups), looked)
            group, looked = pool.next(), looked + 1
            seconds += [r.seconds for r in group.records]
            # each rollout judged by the versions it would train on: a stale or cancelled one leaves its group,
            # which trains on the rest while two remain (an advantage needs two)
            kept = [r for r in group.records if r.status != "cancelled" and self._staleness(r) <= args.max_staleness]
            left = [r for r in group.records if r not in kept]
            metrics["cancelled"] += sum(r.status == "cancelled" for r in left)
            metrics["dropped_stale_rollouts"] += len(left)
            metrics["discarded_tokens/stale"] += sampled_tokens(left)
            metrics["staleness"] = max([metrics["staleness"], *(self._staleness(r) for r in kept)])
            if len(kept) < min(2, len(group.records)):
                metrics["dropped_stale"] += 1
                metrics["discarded_tokens/stale"] += sampled_tokens(kept)
            elif args.dynamic_sampling and group_advantages([r.group_reward for r in kept]).zero_variance:
                metrics["dynamic_skipped"] = metrics.get("dynamic_skipped", 0) + 1
                metrics["discarded_tokens/flat"] += sampled_tokens(kept)
            else:
                metrics["sampled_tokens"] += sampled_tokens(kept)
                groups.append(kept)
                tasks.append(group.task.name)
        # Overlap comes from the groups left in flight while this step trains (two steps' rollouts: the defaults'),
        # not from launching the next step's here: that made every group a version stale (docs/benchmarks.md).
        if args.dynamic_sampling:
            metrics["groups_collected"] = looked
            if len(groups) < args.groups_per_step:
                metrics["warnings"] = [f"dynamic sampling: {len(groups)} of {args.groups_per_step} groups could "
                                       f"train after {looked} collected (the cap, dynamic_sampling_max_tries "
                                       f"{args.dynamic_sampling_max_tries}); the step trains on those"]
        return groups, tasks, metrics

    def _staleness(self, record: RolloutRecord) -> int:
        """Versions between the policy now and the oldest turn the rollout would train on (0 without turns)."""
        return self.version - min(record.policy_versions) if record.policy_versions else 0

    def _fill(self, pool: RolloutSource, groups_in_flight: int, needed: int, taken: int) -> None:
        """Keep up to groups_in_flight groups in flight, but none that could not train within max_staleness: groups
        are collected in launch order and each step syncs, so a group launched now, with `pending` groups before it
        and `taken` collected this step, trains (pending + taken) // groups_per_step versions from now. One
        launched further ahead would sample only to be dropped (half of all sampled tokens in bench/pipeline.py,
        two steps' rollouts in flight at max_staleness 1). The synchronous loop (max_staleness 0) so launches
        only the `needed` groups of the step being collected."""
        args = self.args
        in_time = (args.max_staleness + 1) * args.groups_per_step - taken
        while len(pool.pending) < max(needed, min(groups_in_flight, in_time)):
            n, task = self.task_cursor, self._next_task()  # n: the group's number in the run, unique
            pool.launch(task, args.num_generations, f"s{self.step}-v{self.version}-{task.name}-n{n}", self.version)

    def _hook(self, name: str):
        return (lambda payload: self._notify(name, payload)) if self.callbacks else None


__all__ = ["AsyncGRPOConfig", "HarnessAsyncGRPOTrainer", "TrainingStopped"]
