"""Data parallel for the trainer (`accelerate launch` / `torchrun`, one process per device, CPU included).

Rank 0 runs the rollouts, syncs weights and saves; it broadcasts each step's groups, every rank packs the
rollouts i % world_size == rank, and gradients are summed across ranks. The loss divides by the global number
of trained tokens, so the summed gradient equals the single-process one and every rank takes the same step.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_distributed() -> tuple[int, int]:
    """(rank, world size): from the launcher's environment (accelerate launch, torchrun), else (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def broadcast(obj):
    """Rank 0's object to every rank (None means: no more steps)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_gradients(model, loss: torch.Tensor) -> torch.Tensor:
    """Sum gradients (and the loss, for logging) over ranks; a rank with no tokens adds zeros."""
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
    dist.all_reduce(loss)
    return loss


def all_reduce(tensor: torch.Tensor, world_size: int, op: str = "sum") -> torch.Tensor:
    """In place over every rank (sum or max); a no-op in one process."""
    if world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor
