"""The trainer's collaborators as Protocols: what the loop (trainer.py), its checkpoints and its weight sync
need of each, so each can be passed in (TRL's async_grpo style: defaults built only when none is given) and the
loop tested on stubs.

    TrainablePolicy   the model being trained: a step, its whole weights, the probe's forward, saved folders
                      (policy.py: Policy)
    Learner           what one optimizer step reads of that policy (step.py's train_on; policy.py's Policy)
    EngineSync        the policy into the engines after a step, and the services checked before one
                      (policy_sync.py: PolicySync, over a serving/weight_sync.py WeightSync)
    RolloutSource     groups of rollouts launched, collected oldest first, stale ones cancelled (rollouts/pool.py:
                      RolloutPool); the trainer is given its maker, calls it with the run's and closes what it made
    TeacherModel      on-policy distillation's teacher: logprobs of the student's tokens (serving/teacher.py)

The rollout side's contract (a session factory and its sessions) is rollouts/session.py's SessionFactory and
RolloutSession.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sized
from pathlib import Path
from typing import Protocol

import torch

from harness_trainer.training.config import AsyncGRPOConfig
from harness_trainer.training.grpo import LossConfig


class TrainablePolicy(Protocol):
    """What the trainer, its checkpoints and its weight sync need of the policy: policy.py's Policy, or a test's stub.
    `model` is what a weight sync loads (with LoRA, `peft` is the adapter it loads instead); `dtype` what the
    forward computes in (the probe's tolerance)."""
    model: object
    peft: object | None
    dtype: torch.dtype
    model_dir: Path | None
    rank: int
    world_size: int

    def step(self, groups: list, step: int) -> dict: ...
    def together(self, work: str): ...
    def full_weights(self) -> dict | None: ...
    def optimizer_state(self) -> dict: ...
    def probe_logits(self) -> torch.Tensor: ...
    def save_model(self, path: str | Path) -> Path: ...
    def save_policy(self, path: str | Path) -> Path: ...
    def restore(self, path: Path, optimizer_state: dict) -> None: ...
    def lead(self) -> contextlib.AbstractContextManager: ...


class Learner(Protocol):
    """What one optimizer step (step.py) reads of the policy: its settings and loss, the model with its trained
    parameters and optimizer, the learning rate at a step, the frozen reference (beta; with LoRA, `peft`'s adapter
    disabled is the reference instead), where it computes and which rank of how many it is."""
    args: AsyncGRPOConfig
    loss_cfg: LossConfig
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    lr_at: Callable[[int], float]
    ref_model: torch.nn.Module | None
    peft: object | None
    device: torch.device
    rank: int
    world_size: int


class RolloutSource(Protocol):
    """Where the trainer's groups come from. `pending`: the groups launched and not collected, oldest first;
    `next()` the oldest once each of its rollouts ended, scored (its `task` and `records`); `cancel_stale` stops
    the rollouts in flight whose oldest turn is too old after a sync; `discard` forgets every pending group (the
    engine was restarted: they sampled other weights); `close` stops what runs and keeps what finished.
    Made by `rollouts(factory, out, workers, score, on_launch=, on_rollout=)`: RolloutPool is that maker."""
    pending: Sized  # groups launched and not collected (their count is what the trainer reads)

    def launch(self, task, n: int, episode: str, version: int = 0) -> object: ...
    def next(self): ...
    def cancel_stale(self, version: int, max_staleness: int) -> int: ...
    def discard(self) -> None: ...
    def close(self) -> None: ...


class TeacherModel(Protocol):
    """The teacher of on-policy distillation (distill.py): each sequence's per-token logprobs under it."""

    def logprobs(self, sequences: list) -> list: ...
    def close(self) -> None: ...


class EngineSync(Protocol):
    """Keeps the engines serving the policy: `version` is the policy version they serve (and the proxy stamps),
    `last_probe_gap` the probe's gap after the last sync."""
    version: int
    last_probe_gap: float | None

    def sync_weights(self, step: int) -> float: ...
    def ensure_services(self, step: int) -> bool: ...
    def engine_metrics(self) -> dict: ...
    def engine_time(self) -> dict[str, tuple[float, float]]: ...
    def take_recovered(self) -> list[str]: ...
    def close(self) -> None: ...
