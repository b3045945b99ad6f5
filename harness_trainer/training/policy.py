"""The policy on this rank: the model being trained and everything that changes it or reads it whole.

    Policy(model, args, device, rank, world_size)      (TrainablePolicy: what the trainer needs of one)
        .step(groups, step)    one optimizer step on scored groups (step.py)
        .full_weights()        the whole model's weights (FSDP: gathered from every rank), or None: the model holds them
        .optimizer_state()     the optimizer's whole state (a checkpoint)
        .probe_logits()        the logits along the probe's fixed sequence (policy_sync.py)
        .save_model(path)      a folder vLLM can serve; .save_policy(path): what a checkpoint keeps of it
        .restore(path, optimizer_state)   a checkpoint's weights (or adapter) and optimizer state back
        .lead()                rank 0's loop: inside it, whole-model work calls the other ranks in

With FSDP (sharding.py) the whole weights, the optimizer's state and the probe's forward need every rank's shard:
rank 0, inside its loop (`leading`), broadcasts the work's name and the other ranks, waiting between steps in
the trainer's follower loop, join in (`together`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

import torch

from harness_trainer.training.checkpoints import save_model
from harness_trainer.training.config import AsyncGRPOConfig
from harness_trainer.training.distributed import broadcast
from harness_trainer.training.grpo import LossConfig
from harness_trainer.training.lora import LoraSettings, add_lora, merged_state_dict
from harness_trainer.training.sharding import (
    full_optimizer_state,
    full_state_dict,
    gathered,
    is_sharded,
    load_full_state,
    shard_model,
)
from harness_trainer.training.step import train_on
from harness_trainer.training.tree_attention import use_tree_attention

PROBE_IDS = [1, 10, 20, 30, 40, 50, 60, 70, 2]  # a fixed sequence the engine and the trainer both score


class Policy:
    def __init__(self, model, args: AsyncGRPOConfig, device: torch.device, rank: int = 0, world_size: int = 1):
        """model: a folder (or Hub id already resolved to one) or a loaded transformers model."""
        from transformers import AutoModelForCausalLM

        self.args, self.device, self.rank, self.world_size = args, device, rank, world_size
        self.leading = False  # rank 0 inside its loop (lead()): the other ranks are waiting to be called in
        self.model_dir = Path(model) if isinstance(model, (str, Path)) else None
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=_dtype(args.dtype)) if self.model_dir else model
        # With LoRA the adapter is injected into self.model in place; self.peft is its wrapper (save, disable).
        self.peft = add_lora(self.model, LoraSettings(args.lora_rank, args.lora_alpha, args.lora_dropout,
                                                      args.lora_target_modules)) if args.use_peft else None
        use_tree_attention(self.model)  # a token attends to its ancestors in the packed tree (tree_attention.py)
        if args.gradient_checkpointing or (args.gradient_checkpointing is None and args.distributed == "fsdp"
                                           and device.type == "cuda"):
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.to(device)
        # A frozen copy of the starting policy, only when the loss has a KL term to it (with LoRA: the same
        # model with its adapter disabled).
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False) \
            if args.beta and not self.peft else None
        self.dtype = next(self.model.parameters()).dtype
        if args.distributed == "fsdp" and world_size > 1:  # sharding.py
            mixed = device.type == "cuda" and args.dtype == "auto"
            self.model = shard_model(self.model, mixed_precision=mixed)
            if self.ref_model is not None:
                self.ref_model = shard_model(self.ref_model, mixed_precision=mixed)
            self.dtype = torch.bfloat16 if mixed else self.dtype  # what the forward computes in
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # all, or the adapter's
        self.loss_cfg = LossConfig.from_args(args)
        self.optimizer = torch.optim.AdamW(self.params, lr=args.learning_rate)
        self.lr_at = _schedule(self.optimizer, args)

    def step(self, groups: list, step: int) -> dict:
        """One optimizer step on finished, scored groups (every rank, on the same groups); its metrics."""
        return train_on(self, groups, step)

    def together(self, work: str):
        """`work` ("weights", "optimizer" or "probe") computed by every rank at once; rank 0's result."""
        if self.rank == 0 and self.leading and self.world_size > 1:
            broadcast(work)
        if work == "weights":
            return full_state_dict(self.model)
        if work == "optimizer":
            return full_optimizer_state(self.model, self.optimizer)
        if work == "probe":
            return self._probe_forward()
        raise ValueError(f"unknown collective work '{work}'")

    def full_weights(self) -> dict | None:
        """With FSDP the whole model's weights (on rank 0, on the CPU; every rank must take part), else None:
        the model holds them."""
        return self.together("weights") if is_sharded(self.model) else None

    def optimizer_state(self) -> dict:
        return self.together("optimizer") if is_sharded(self.model) else self.optimizer.state_dict()

    def probe_logits(self) -> torch.Tensor:
        """The logits along PROBE_IDS (with FSDP every rank runs this forward at once)."""
        return self.together("probe") if is_sharded(self.model) else self._probe_forward()

    def _probe_forward(self) -> torch.Tensor:
        with torch.no_grad(), gathered(self.model):
            self.model.eval()
            return self.model(torch.tensor([PROBE_IDS], device=self.device)).logits[0, :-1].float().cpu()

    def save_model(self, path: str | Path) -> Path:
        """The policy in Hugging Face format, with its tokenizer: a folder vLLM can serve (with LoRA: the merged
        model, and the adapter in adapter/)."""
        if self.peft is None:
            weights = self.full_weights()  # FSDP: gathered from every rank; rank 0 writes
            return save_model(self.model, path, self.model_dir, state_dict=weights) if self.rank == 0 else Path(path)
        path = save_model(self.model, path, self.model_dir, state_dict=merged_state_dict(self.model))
        self.peft.save_pretrained(path / "adapter")
        return path

    @contextlib.contextmanager
    def lead(self) -> Iterator[None]:
        """Rank 0's loop: while inside, whole-model work (together) first calls the waiting ranks in."""
        self.leading = True
        try:
            yield
        finally:
            self.leading = False

    def restore(self, path: Path, optimizer_state: dict) -> None:
        """A checkpoint's policy (checkpoints.py): the weights, or the adapter alone with LoRA (the base weights
        never changed), and the optimizer's state. With FSDP every rank reads the whole state, keeps its shard."""
        from transformers import AutoModelForCausalLM

        if is_sharded(self.model):
            weights = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
            load_full_state(self.model, self.optimizer, weights, optimizer_state)
            return
        if self.peft is not None:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(self.peft, load_file(path / "adapter_model.safetensors"))
        else:
            self.model.load_state_dict(AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).state_dict())
        self.optimizer.load_state_dict(optimizer_state)

    def save_policy(self, path: str | Path) -> Path:
        """What a checkpoint holds of the policy: the adapter with LoRA, else the whole servable model."""
        if self.peft is None:
            return self.save_model(path)
        self.peft.save_pretrained(path)
        return Path(path)


def _schedule(optimizer, args: AsyncGRPOConfig):
    """step -> learning rate, from transformers' schedulers (the names TRL's configs take)."""
    import math

    from transformers import get_scheduler

    warmup = math.ceil(args.warmup_ratio * args.max_steps)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                              num_training_steps=args.max_steps)  # a known name (config.py checks it)
    factor = scheduler.lr_lambdas[0]
    return lambda step: args.learning_rate * factor(step)


def _dtype(name: str) -> torch.dtype:
    """The weights' dtype as loaded. auto: float32 (with FSDP on GPU the forward then computes in bfloat16 over
    those float32 masters: sharding.py); not pure bfloat16 weights, where AdamW's updates below bf16's resolution
    (a relative 4e-3: lr 1e-6 steps) would be rounded away."""
    return {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]  # a known name (config.py checks it)
