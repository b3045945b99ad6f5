"""Async GRPO over unmodified agents: rollouts keep running while the trainer steps.

    for each step:
        fill the rollout pool up to max_concurrent_rollouts (groups of num_generations rollouts of one task)
        take the oldest finished group; drop it if its turns are more than max_staleness versions old
        (groups still running that can no longer finish in time are cancelled after each sync)
        rewards -> group advantages -> chains -> prefix-tree packing -> loss -> optimizer step
        every weight_sync_steps: weights -> the same vLLM (reload), version += 1 in vLLM and the proxy,
                                 probe: vLLM's teacher-forced logprobs must equal the trainer's
        every save_steps: checkpoint (model, optimizer, step, version, RNG, dataset position)

Staleness is read from the policy version the proxy stamped on each captured turn, not from dispatch time.
A failed rollout never stops the loop; a malformed capture (CaptureContractError) always does.

Data parallel (`accelerate launch` / `torchrun`, one process per device, CPU included): rank 0 runs the
rollouts, syncs weights and saves; it broadcasts each group's records, every rank packs the rollouts
i % world_size == rank, and gradients are summed across ranks. The loss divides by the global number of
trained tokens, so the summed gradient equals the single-process one and every rank takes the same step.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import shutil
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from harness_trainer.adapters.session import CaptureContractError, RolloutRecord, run_rollout
from harness_trainer.adapters.tasks import Task
from harness_trainer.engine import teacher_forced_logprobs
from harness_trainer.evaluate import write_record
from harness_trainer.grpo import LossConfig, group_advantages, policy_loss
from harness_trainer.rewards import resolve_reward_fn, score
from harness_trainer.rows import chains_from_trace, pack, tree_logprobs
from harness_trainer.traces import TrainingTrace
from harness_trainer.weight_sync import WeightSyncError, ram_dir, reload_weights, save_weights

log = logging.getLogger("harness_trainer")


@dataclass
class AsyncGRPOConfig:
    output_dir: str = "runs/grpo"
    vllm_server_base_url: str | None = None
    num_generations: int = 4
    max_concurrent_rollouts: int = 4
    max_staleness: int = 2
    max_steps: int = 10
    learning_rate: float = 1e-5
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    max_completion_tokens: int = 256
    weight_sync_steps: int = 1
    weight_sync_backend: str = "reload"  # reload (any vLLM, CPU included) or nccl (GPU)
    weight_sync_timeout_s: float = 120.0
    probe_tolerance: float = 1e-3
    logging_steps: int = 1
    save_steps: int = 5
    save_total_limit: int = 2
    loss_mode: str = "decoupled"
    clip_low: float = 0.2
    clip_high: float = 0.2
    is_mode: str = "tis"
    is_bound: float = 2.0
    kl_beta: float = 0.0
    scale_rewards: bool = False
    seed: int = 0
    shuffle_dataset: bool = True
    resume_from_checkpoint: str | None = None


class TrainingStopped(RuntimeError):
    """The run cannot go on (a failed weight sync, a probe mismatch); the message says why."""


class HarnessAsyncGRPOTrainer:
    def __init__(self, model, harness_session_factory, args: AsyncGRPOConfig, train_dataset: list[Task],
                 rollout_reward_fn=None, callbacks: list | None = None):
        """callbacks: objects with any of on_launch(n), on_rollout(record_or_exception), on_step(metrics),
        log(metrics)."""
        from transformers import AutoModelForCausalLM

        self.args = args
        if args.weight_sync_backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("weight_sync_backend='nccl' streams weights GPU to GPU and needs CUDA on the trainer and "
                             "vLLM on the same host; this machine has no CUDA device. Use weight_sync_backend='reload'.")
        if args.weight_sync_backend not in ("reload", "nccl"):
            raise ValueError(f"unknown weight_sync_backend '{args.weight_sync_backend}': choose reload or nccl")
        if args.weight_sync_backend == "nccl":
            raise NotImplementedError("the nccl weight-sync backend is not built yet; use weight_sync_backend='reload', "
                                      "which works on GPU too")
        self.model_dir = Path(model) if isinstance(model, (str, Path)) else None
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32) if self.model_dir else model
        self.model.config._attn_implementation = "eager"  # the tree attention mask is a custom 4D mask
        self.rank, self.world_size = _init_distributed()
        # One device per rank: the rank's GPU where there is one (the engine holds its own), else the CPU.
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.model.to(self.device)
        # A frozen copy of the starting policy, only when the loss has a KL term to it.
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False) if args.kl_beta else None
        # The trainer owns the sampling policy and hands it to the factory before any session starts
        # (on rank 0 only: the other ranks never run a rollout).
        self.factory = harness_session_factory(
            {"training": True, "temperature": args.temperature, "max_tokens_cap": args.max_completion_tokens}
        ) if self.rank == 0 else None
        self.tasks = list(train_dataset)
        if not self.tasks:
            raise ValueError("train_dataset is empty: give at least one task")
        self.reward_fn = resolve_reward_fn(rollout_reward_fn)
        self.loss_cfg = LossConfig(args.loss_mode, args.clip_low, args.clip_high, args.is_mode, args.is_bound,
                                   args.kl_beta)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.learning_rate)
        self.step, self.version, self.task_cursor = 0, 0, 0
        self.out = Path(args.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(args.seed)
        torch.manual_seed(args.seed)
        self.history: list[dict] = []
        self.callbacks = list(callbacks or [])
        if args.resume_from_checkpoint:
            self._load(Path(args.resume_from_checkpoint))

    # ---- rollouts ----------------------------------------------------------------------------------------

    def _next_task(self) -> Task:
        """Each pass over the dataset in its own seeded order; the cursor alone fixes the position (resume)."""
        n = len(self.tasks)
        epoch, index = divmod(self.task_cursor, n)
        order = random.Random(f"{self.args.seed}-{epoch}").sample(range(n), n) if self.args.shuffle_dataset \
            else range(n)
        self.task_cursor += 1
        return self.tasks[order[index]]

    def _launch_group(self, pool: ThreadPoolExecutor) -> tuple[Task, list[Future], list]:
        task, sessions = self._next_task(), _Sessions()
        futures = [pool.submit(run_rollout, self.factory, task, f"s{self.step}-v{self.version}-{task.name}-{g}",
                               sessions.add) for g in range(self.args.num_generations)]
        self._notify("on_launch", len(futures))
        for future in futures:
            future.add_done_callback(self._rollout_done)
        return task, futures, sessions

    def _rollout_done(self, future: Future) -> None:
        if future.cancelled():  # never started: stale before its turn
            self._notify("on_rollout", SimpleNamespace(status="cancelled"))
            return
        self._notify("on_rollout", future.exception() or future.result())

    def _notify(self, hook: str, payload) -> None:
        for callback in self.callbacks:
            if fn := getattr(callback, hook, None):
                fn(payload)

    def _cancel_stale(self, pending) -> int:
        """Stop groups that can no longer finish within max_staleness, instead of finishing and dropping them."""
        cancelled = 0
        for _, futures, sessions, launched in pending:
            if self.version - launched > self.args.max_staleness:
                for future in futures:
                    cancelled += future.cancel()  # not started yet
                cancelled += sessions.cancel_all()
        return cancelled

    def _collect(self, futures: list[Future]) -> list[RolloutRecord]:
        records = []
        for future in futures:
            try:
                records.append(future.result())
            except CaptureContractError:
                raise
            except Exception as exc:  # a failed rollout never stops the loop
                log.warning("rollout failed: %s", exc)
        for record in records:  # every rollout and its trace, trained on or not
            write_record(self.out, record)
        return records

    # ---- one optimisation step ---------------------------------------------------------------------------

    def _train_on(self, records: list[RolloutRecord]) -> dict:
        rewards = [score(self.reward_fn, r.outcome) if r.status != "unscorable" else None for r in records]
        group = group_advantages(rewards, scale_std=self.args.scale_rewards)
        verifier = [r.outcome.env_reward for r in records if r.outcome.env_reward is not None]
        metrics = {"reward_mean": _mean([r for r in rewards if r is not None]), "zero_variance": group.zero_variance,
                   "verifier_reward_mean": _mean(verifier),
                   "scorable": group.scorable, "rollouts": len(records),
                   "failed": sum(r.status == "unscorable" for r in records)}
        seen: set = set()
        chains, advantages = [], []
        for record, adv in zip(records, group.advantages):
            if adv is None or not record.training_trace or group.zero_variance:
                continue
            trace = TrainingTrace.model_validate(record.training_trace)
            chains += chains_from_trace(trace, len(advantages), seen)
            advantages.append(adv)
        total = sum(sum(c.trained) for c in chains)  # the global batch's trained tokens, on every rank
        if total == 0:
            return metrics | {"trained_tokens": 0}
        # This rank's share: whole rollouts, so a fork's supervised-once bookkeeping stays within one rank.
        chains = [c for c in chains if c.rollout % self.world_size == self.rank]
        self.model.train()
        self.optimizer.zero_grad()
        loss, stats = torch.zeros((), device=self.device), {}
        if chains and (tree := pack(chains)).trained.any():
            adv = torch.tensor(advantages)[tree.rollout[tree.trained]].to(self.device)
            behaviour = tree.behaviour[tree.trained].to(self.device)
            proximal = reference = None
            with torch.no_grad():
                if self.loss_cfg.mode == "decoupled":
                    proximal = tree_logprobs(self.model, tree, self.args.temperature)
                if self.ref_model is not None:
                    reference = tree_logprobs(self.ref_model, tree, self.args.temperature)
            logp, entropy = tree_logprobs(self.model, tree, self.args.temperature, entropy=True)
            loss, stats = policy_loss(logp, behaviour, adv, self.loss_cfg, total, proximal=proximal,
                                      reference=reference)
            loss.backward()
            stats |= {"tree_tokens": len(tree), "row_tokens": tree.chain_tokens, "entropy": float(entropy.mean())}
        if self.world_size > 1:
            loss = self._all_reduce_gradients(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        self.optimizer.step()
        return metrics | stats | {"loss": float(loss.detach()), "grad_norm": float(grad_norm),
                                  "trained_tokens": total}

    def _all_reduce_gradients(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum gradients (and the loss, for logging) over ranks; a rank with no tokens adds zeros."""
        for p in self.model.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
        dist.all_reduce(loss)
        return loss

    # ---- weights back into vLLM ----------------------------------------------------------------------------

    def sync_weights(self) -> float:
        url = self.args.vllm_server_base_url
        if not url:
            raise TrainingStopped("vllm_server_base_url is not set: the trainer has no engine to sync weights into")
        directory = ram_dir()
        started = time.perf_counter()
        try:
            save_weights(self.model, directory)
            reload_weights(url, directory, version=self.version + 1, timeout_s=self.args.weight_sync_timeout_s)
        except WeightSyncError as exc:
            raise TrainingStopped(f"weight sync at step {self.step} failed: {exc}") from None
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        self.version += 1
        proxy = getattr(self.factory, "proxy", None)
        if proxy is not None:
            proxy.set_policy_version(self.version)
        self._probe(url)
        return time.perf_counter() - started

    def _probe(self, url: str) -> None:
        """vLLM must now score a fixed sequence exactly as the trainer's weights do."""
        ids = [1, 10, 20, 30, 40, 50, 60, 70, 2]
        served = torch.tensor(teacher_forced_logprobs(url, ids))
        with torch.no_grad():
            self.model.eval()
            logits = self.model(torch.tensor([ids], device=self.device)).logits[0, :-1].cpu()
            ours = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        gap = float((served.double() - ours).abs().max())
        if gap > self.args.probe_tolerance:
            raise TrainingStopped(f"after syncing version {self.version}, vLLM's logprobs differ from the trainer's "
                                  f"by {gap:.2e} (> {self.args.probe_tolerance}): the engine did not take the weights")
        self.last_probe_gap = gap

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def save_model(self, path: str | Path) -> Path:
        """The policy in Hugging Face format, with its tokenizer: a folder vLLM can serve."""
        path = Path(path)
        self.model.save_pretrained(path)
        if self.model_dir:
            for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
                if (self.model_dir / name).exists() and not (path / name).exists():
                    shutil.copy2(self.model_dir / name, path / name)
        return path

    def _save(self) -> Path:
        path = self.out / f"checkpoint-{self.step}"
        tmp = self.out / f".checkpoint-{self.step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.save_model(tmp)
        torch.save({"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                    "rng": self.rng.getstate()}, tmp / "trainer_state.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(
            {"step": self.step, "version": self.version, "task_cursor": self.task_cursor}))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)  # a crash mid-save leaves the previous checkpoint whole
        checkpoints = sorted(self.out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        for old in checkpoints[:-self.args.save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def _load(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        if path.name == "latest":
            found = sorted(path.parent.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
            if not found:
                raise FileNotFoundError(f"no checkpoint-* in {path.parent} to resume from")
            path = found[-1]
        state = json.loads((path / "trainer_state.json").read_text())
        blob = torch.load(path / "trainer_state.pt", weights_only=False)
        self.model.load_state_dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict())
        self.optimizer.load_state_dict(blob["optimizer"])
        torch.set_rng_state(blob["torch_rng"])
        self.rng.setstate(blob["rng"])
        self.step, self.version, self.task_cursor = state["step"], state["version"], state["task_cursor"]

    # ---- the loop ----------------------------------------------------------------------------------------

    def train(self) -> list[dict]:
        if self.rank != 0:
            return self._follow()
        try:
            return self._lead()
        finally:
            if self.world_size > 1:
                _broadcast(None)  # releases the other ranks, on success or error

    def _follow(self) -> list[dict]:
        """Ranks > 0: take rank 0's groups and step in lockstep with it until it says stop."""
        while (records := _broadcast(None)) is not None:
            self._train_on(records)
            self.step += 1
        return self.history

    def _lead(self) -> list[dict]:
        args = self.args
        groups_in_flight = max(1, args.max_concurrent_rollouts // args.num_generations)
        if args.vllm_server_base_url:
            # A cold sync: the engine serves exactly the trainer's weights before the first rollout (after a
            # resume it may still hold weights of a step that was never checkpointed).
            self.sync_weights()
        pending: deque[tuple[Task, list[Future], list, int]] = deque()
        with ThreadPoolExecutor(max(args.max_concurrent_rollouts, args.num_generations)) as pool:
            try:
                while self.step < args.max_steps:
                    while len(pending) < groups_in_flight:
                        task, futures, sessions = self._launch_group(pool)
                        pending.append((task, futures, sessions, self.version))
                    task, futures, _, launched = pending[0]
                    records = self._collect(futures)  # an interrupt here still finds the group in `pending`
                    pending.popleft()
                    versions = [v for r in records for v in r.policy_versions]
                    staleness = self.version - min(versions) if versions else self.version - launched
                    started = time.perf_counter()
                    if staleness > args.max_staleness or any(r.status == "cancelled" for r in records):
                        metrics = {"dropped_stale": True, "staleness": staleness,
                                   "cancelled": sum(r.status == "cancelled" for r in records)}
                    else:
                        if self.world_size > 1:
                            _broadcast(records)
                        metrics = self._train_on(records) | {"staleness": staleness}
                    metrics["train_time_s"] = time.perf_counter() - started
                    self.step += 1
                    if args.vllm_server_base_url and self.step % args.weight_sync_steps == 0:
                        metrics["weight_sync_time_s"] = self.sync_weights()
                        metrics["cancelled_in_flight"] = self._cancel_stale(pending)
                    metrics.update(step=self.step, version=self.version, task=task.name)
                    if self.step % args.save_steps == 0 or self.step == args.max_steps:
                        self._save()  # before the metrics line: a logged step is a saved step
                    self.history.append(metrics)
                    with (self.out / "metrics.jsonl").open("a") as f:
                        f.write(json.dumps(metrics) + "\n")
                    self._notify("on_step", metrics)
                    self._notify("log", metrics)
                    if self.step % args.logging_steps == 0:
                        log.info("step %d: %s", self.step, {k: v for k, v in metrics.items() if k != "task"})
            finally:
                for _, futures, sessions, _ in pending:  # in-flight work of a finished run is stopped
                    for future in futures:
                        future.cancel()
                    sessions.cancel_all()
        return self.history


class _Sessions(list):
    """The live sessions of one group. Once cancelled, a session registering late is cancelled on arrival."""
    stopped = False

    def add(self, session) -> None:
        self.append(session)
        if self.stopped:
            session.cancel()

    def cancel_all(self) -> int:
        self.stopped = True
        count = 0
        for session in list(self):
            if not session.cancelled:
                session.cancel()
                count += 1
        return count


def _init_distributed() -> tuple[int, int]:
    """(rank, world size): from the launcher's environment (accelerate launch, torchrun), else (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def _broadcast(obj):
    """Rank 0's object to every rank (None means: no more steps)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


__all__ = ["AsyncGRPOConfig", "HarnessAsyncGRPOTrainer", "TrainingStopped"]
