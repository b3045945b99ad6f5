"""Supervised fine-tuning on the prefix tree: the same loss as TRL's completion-only SFT, fewer tokens.

An agent's traces share its system prompt (opencode's is ~3.4k tokens of the embedded tokenizer, ~11k of a
real one) and each task's instruction. One row per chain runs that prefix once per row; packed as one prefix
tree (training/packing.py), a batch runs it once:

    rows of a batch  B chains, the shared prefix P tokens long, each S tokens of its own
    tokens fed       rows: B (P + S)          tree: P + B S          (opencode, B = 8: 28k vs 5k)
    loss             -(1/N) sum over the batch's N trained tokens of log p(token)   (TRL's token mean)

Each epoch visits every chain once in a seeded order; the learning rate warms up linearly over
`warmup_steps` and then follows the schedule; AdamW and gradient clipping as in TRL's defaults (betas
0.9/0.999, weight decay 0, gradient norm 1).
"""

from __future__ import annotations

import random
import time

import torch

from harness_trainer.training.packing import Chain, pack
from harness_trainer.training.tree_forward import tree_backward


def train_on_tree(model, chains: list[Chain], epochs: float, learning_rate: float, batch_size: int,
                  schedule: str = "constant_with_warmup", warmup_steps: int = 5, seed: int = 0,
                  max_tokens_per_microbatch: int | None = 16384, log=None) -> dict:
    """Train `model` in place on the chains' trained tokens (a LoRA model: its adapter, the only parameters
    left trainable); returns the losses and the tokens fed."""
    from transformers import get_scheduler

    steps_per_epoch = -(-len(chains) // batch_size)
    total_steps = max(1, round(epochs * steps_per_epoch))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    scheduler = get_scheduler(schedule, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)
    rng = random.Random(seed)
    order: list[Chain] = []
    losses, fed, rows, started = [], 0, 0, time.monotonic()
    model.train()
    for step in range(total_steps):
        if len(order) < batch_size:  # the next epoch's order after what is left of this one
            epoch = list(chains)
            rng.shuffle(epoch)
            order += epoch
        batch, order = order[:batch_size], order[batch_size:]
        tree = pack(batch)
        n = int(tree.trained.sum())
        optimizer.zero_grad()
        logp, _ = tree_backward(model, tree, lambda lp, index, n=n: -lp.sum() / n, 1.0, max_tokens_per_microbatch)
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # TRL's (transformers') max_grad_norm
        optimizer.step()
        scheduler.step()
        losses.append(float(-logp.sum() / n))
        fed, rows = fed + len(tree), rows + tree.chain_tokens
        if log and (step + 1) % 20 == 0:
            log(f"sft step {step + 1}/{total_steps}: loss {sum(losses[-20:]) / 20:.4f}")
    return {"steps": total_steps, "losses": losses, "train_loss": sum(losses) / len(losses),
            "tokens_fed": fed, "row_tokens": rows, "seconds": time.monotonic() - started}
