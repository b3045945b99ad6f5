"""Data parallel for the trainer (`accelerate launch` / `torchrun`, one process per device, CPU included).

Rank 0 runs the rollouts, syncs weights and saves; it broadcasts each step's groups, every rank packs the
rollouts i % world_size == rank, and gradients are summed across ranks. The loss divides by the global number
of trained tokens, so the summed gradient equals the single-process one and every rank takes the same step.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from harness_trainer.serving.placement import Placement, plan_placement

COLLECTIVE_TIMEOUT = timedelta(hours=6)
FAILED = "failed"  # rank 0's last broadcast when its loop raised: the followers must not wait for a final save


def trainer_placement(args) -> Placement:
    """For a trainer made without one (the Python API, attached to one engine it did not launch): the layout as
    this process sees its GPUs (serving/placement.py: --trainer-gpus, else the GPUs the engine does not take,
    else the engine's one); the CPU's when it sees none. `harness-train` decides its run's placement once, with
    the engines' settings, and passes it in (commands/train.py: prepare)."""
    visible = tuple(str(i) for i in range(torch.cuda.device_count())) if torch.cuda.is_available() else ()
    return plan_placement(visible, None, args.trainer_gpus, 1, 0.45, attached=True)


def trainer_device(placement: Placement) -> torch.device:
    """This rank's device: its GPU in the placement, or the CPU."""
    gpu = placement.trainer_device(int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu") if gpu is None else torch.device("cuda", gpu)


def init_distributed(device: torch.device | None = None) -> tuple[int, int]:
    """(rank, world size): from the launcher's environment (accelerate launch, torchrun), else (0, 1)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)  # before the process group: NCCL binds to the current device
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        # The other ranks wait in a broadcast while rank 0 collects a step's rollouts (agents can take many
        # minutes): the default collective timeout (10 min with NCCL) would kill a healthy run.
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return dist.get_rank(), dist.get_world_size()


def end_process(code: int):
    """The last call of every rank of a multi-process run: the process group is destroyed and the process ends
    without the interpreter's finalization. Why: gloo's worker threads release a finished collective's tensors
    after its caller has the result, and those tensors hold Python objects; a worker that gets there once
    finalization has begun cannot take the GIL, its thread is unwound inside a noexcept destructor and the rank
    aborts ("terminate called without an active exception", SIGABRT: pytorch#179291). destroy_process_group
    alone does not wait for those threads. A 2-rank FSDP script ending on a broadcast aborted in 9 of 40 runs
    (on a busy 2-core machine), and in none of 40 ending here. Output streams and log handlers are flushed first."""
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


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
