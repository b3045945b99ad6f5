"""The trainer's collaborators as Protocols: what the loop (trainer.py), its checkpoints and its weight sync
need of each, so each can be passed in (TRL's async_grpo style: defaults built only when none is given) and the
loop tested on stubs.

    TrainablePolicy   the model being trained: a step, its whole weights, the probe's forward, saved folders
                      (policy.py: Policy)
    EngineSync        the policy into the engines after a step, and the services checked before one
                      (policy_sync.py: PolicySync, over a serving/weight_sync.py WeightSync)

The rollout side's contract (a session factory and its sessions) is rollouts/session.py's SessionFactory and
RolloutSession.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Protocol

import torch


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
