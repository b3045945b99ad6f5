"""Where the engine and the trainer run on one host: which GPUs each takes, and how weights cross between them.

    no GPU        engine and trainer on the CPU; weights by reload (a RAM folder)
    1 GPU         colocated: both on GPU 0, the engine held to --engine-memory-share of it (vLLM's
                  --gpu-memory-utilization), the trainer in the rest; weights by ipc (CUDA IPC handles, no copy)
    N >= 2 GPUs   split: the engine on the first ceil(N/2) (tensor parallel over them; --engines E splits them
                  into E data-parallel engines), the trainer on the rest (one rank each: `accelerate launch
                  --num_processes M`); weights by nccl (a broadcast from the trainer's rank 0 to the engine)

--engine-gpus / --trainer-gpus (indices among the visible GPUs, "0,1") override the split; give one and the other
takes the rest. A layout that cannot work is refused here, before anything starts (PlacementError).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from harness_trainer._exceptions import PlacementError
from harness_trainer.serving.sync_steps import IPC, LORA, NCCL, RELOAD


@dataclass(frozen=True)
class Placement:
    engines: tuple[tuple[int, ...], ...]  # per engine, its GPUs (indices among the visible); () each on the CPU
    trainer: tuple[int, ...]  # the trainer ranks' GPUs, rank i on trainer[i]; () on the CPU
    visible: tuple[str, ...] = ()  # the host's device ids behind the indices (CUDA_VISIBLE_DEVICES' entries)
    memory_share: float | None = None  # colocated: the engine's share of the GPU

    @property
    def gpu(self) -> bool:
        return bool(self.visible)

    @property
    def attached(self) -> bool:
        return not self.engines

    @property
    def colocated(self) -> bool:
        return self.gpu and any(set(e) & set(self.trainer) for e in self.engines)

    @property
    def weight_sync(self) -> str:
        """The default full-weight sync for this layout."""
        return RELOAD if not self.gpu else IPC if self.colocated else NCCL

    def engine_devices(self, i: int) -> str | None:
        """CUDA_VISIBLE_DEVICES for engine i (the host's ids), None on the CPU."""
        return ",".join(self.visible[g] for g in self.engines[i]) if self.gpu else None

    def tensor_parallel(self, i: int) -> int:
        return max(1, len(self.engines[i]))

    def trainer_device(self, local_rank: int) -> int | None:
        """The GPU index (among the visible) of trainer rank `local_rank`, None on the CPU."""
        if not self.gpu:
            return None
        if local_rank >= len(self.trainer):
            raise PlacementError(f"trainer rank {local_rank} has no GPU: --trainer-gpus gives "
                                 f"{len(self.trainer)} ({_ids(self.trainer)}); launch at most that many processes "
                                 f"(accelerate launch --num_processes {len(self.trainer)}) or give more GPUs")
        return self.trainer[local_rank]

    def describe(self) -> str:
        if not self.gpu:
            return f"CPU: {len(self.engines)} engine(s) and the trainer on the CPU; weights by reload"
        if self.attached:
            return f"an engine started elsewhere; trainer on GPU {_ids(self.trainer)}; weights by nccl"
        engines = "; ".join(f"engine {i} on GPU {_ids(e)} (tensor parallel {len(e)})"
                            for i, e in enumerate(self.engines))
        if not self.trainer:
            return engines + "; no trainer"
        share = f", engine held to {self.memory_share:.0%} of its memory" if self.colocated else ""
        return f"{engines}; trainer on GPU {_ids(self.trainer)}{share}; weights by {self.weight_sync}"


def visible_gpus() -> tuple[str, ...]:
    """The device ids this process may use: CUDA_VISIBLE_DEVICES' entries, else every GPU nvidia-smi lists."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return tuple(d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1")
    from harness_trainer.serving.engine import gpu_count

    return tuple(str(i) for i in range(gpu_count()))


def plan_placement(visible: tuple[str, ...] | list[str], engine_gpus: str | None = None,
                   trainer_gpus: str | None = None, engines: int = 1, memory_share: float = 0.45,
                   attached: bool = False, trainer: bool = True) -> Placement:
    """The layout for `visible` GPUs (the host's ids; empty: the CPU) and the flags given. `attached`: the
    engine was started elsewhere (--vllm-url, the Python API): the trainer takes --trainer-gpus or every visible
    GPU, and weights go by nccl (`harness-train serve` starts its engine for it). `trainer=False` (eval, serve):
    the engines take --engine-gpus or every visible GPU."""
    visible, n = tuple(visible), len(visible)
    if attached and n:
        trainer = _parse(trainer_gpus, n, "--trainer-gpus") or tuple(range(n))
        return Placement(engines=(), trainer=trainer, visible=visible)
    if not n:
        if engine_gpus or trainer_gpus:
            flag = "--engine-gpus" if engine_gpus else "--trainer-gpus"
            raise PlacementError(f"{flag} given but no GPU is visible (nvidia-smi finds none, or "
                                 "CUDA_VISIBLE_DEVICES is empty): leave it out to run on the CPU")
        return Placement(engines=((),) * engines, trainer=())
    if not trainer:
        engine = _parse(engine_gpus, n, "--engine-gpus") or tuple(range(n))
        return Placement(engines=_split(engine, engines), trainer=(), visible=visible)
    engine = _parse(engine_gpus, n, "--engine-gpus")
    trainer = _parse(trainer_gpus, n, "--trainer-gpus")
    if engine is None and trainer is None:
        if n == 1:
            engine = trainer = (0,)
        else:
            engine = tuple(range((n + 1) // 2))
            trainer = tuple(range(len(engine), n))
    elif engine is None:
        engine = tuple(g for g in range(n) if g not in trainer) or trainer
    elif trainer is None:
        trainer = tuple(g for g in range(n) if g not in engine) or engine
    shared = set(engine) & set(trainer)
    if shared and not (len(engine) == len(trainer) == 1):
        raise PlacementError(f"--engine-gpus {_ids(engine)} and --trainer-gpus {_ids(trainer)} share GPU "
                             f"{_ids(sorted(shared))}: give them disjoint GPUs, or one GPU to both (colocated)")
    split = _split(engine, engines)
    if shared and engines > 1:
        raise PlacementError("--engines > 1 on the trainer's only GPU: a colocated engine is one engine")
    if shared and not 0.05 <= memory_share <= 0.9:
        raise PlacementError(f"--engine-memory-share {memory_share}: give the colocated engine between 0.05 and "
                             "0.9 of the GPU (the trainer takes the rest)")
    return Placement(engines=split, trainer=trainer, visible=visible,
                     memory_share=memory_share if shared else None)


def resolve_weight_sync(requested: str | None, use_peft: bool, placement: Placement) -> str:
    """The weight-sync backend a run uses: the one asked for, lora with an adapter, else the placement's (nccl /
    ipc on GPU when this environment can run them: serving/gpu_sync.py, else reload)."""
    if requested:
        return requested
    if use_peft:
        return LORA
    if placement.weight_sync != RELOAD:
        from harness_trainer.serving.gpu_sync import transfer_available

        if transfer_available() is None:
            return placement.weight_sync
    return RELOAD


def _split(engine: tuple[int, ...], engines: int) -> tuple[tuple[int, ...], ...]:
    """The engine GPUs in `engines` equal groups, one per engine (tensor parallel within each)."""
    if len(engine) % engines:
        raise PlacementError(f"--engines {engines} cannot split the engine's {len(engine)} GPUs ({_ids(engine)}) "
                             f"evenly: give a multiple of {engines} engine GPUs, or another --engines")
    per = len(engine) // engines
    return tuple(engine[i * per:(i + 1) * per] for i in range(engines))


def _parse(value: str | None, n: int, flag: str) -> tuple[int, ...] | None:
    if value is None or value == "":
        return None
    try:
        gpus = tuple(int(v) for v in str(value).split(",") if v.strip())
    except ValueError:
        raise PlacementError(f"{flag} {value}: give GPU indices separated by commas, e.g. 0,1") from None
    if not gpus:
        raise PlacementError(f"{flag} is empty: give GPU indices, e.g. 0,1")
    if len(set(gpus)) != len(gpus):
        raise PlacementError(f"{flag} {value} names a GPU twice")
    if bad := [g for g in gpus if not 0 <= g < n]:
        raise PlacementError(f"{flag} {value}: GPU {_ids(bad)} is not visible; this host shows {n} "
                             f"(indices 0-{n - 1})")
    return gpus


def _ids(gpus) -> str:
    return ",".join(map(str, gpus))
