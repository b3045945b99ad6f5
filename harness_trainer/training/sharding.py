"""FSDP2 for the trainer (`--distributed fsdp`): parameters, gradients and optimizer state sharded over the ranks
with torch's `fully_shard`, one unit per decoder layer and one for the rest (embedding, final norm, lm_head).

Why the step gathers the layers up front. The ranks train different rollouts, so they cut different numbers of
micro-batch ranges (tree_forward.py), and some rank may hold none at all; FSDP's per-layer all-gathers assume
every rank runs the same forwards. So a step (gathered(model)):

    unshard every unit (one all-gather each, every rank)      no resharding after forward or backward
    each rank's own ranges, forward and backward              no collective: gradients accumulate unsharded
    one 1-token forward + backward of weight 0, every rank    FSDP reduce-scatters the accumulated gradients
    reshard                                                    (summed: the loss is already a global token mean)

so a step holds the unsharded 16-bit weights and their gradients for its duration (like ZeRO-2), while the fp32
master weights and AdamW's two moments stay sharded between steps: 16 of a full fine-tune's ~18 bytes per
parameter are divided by the world size. Mixed precision on GPU: bf16 compute and all-gathers, fp32 reductions.

The whole model leaves the shards only for the weight sync, the probe and the saved folders (full_state_dict:
gathered on rank 0, on the CPU, every rank taking part).
"""

from __future__ import annotations

import contextlib

import torch


def shard_model(model, mixed_precision: bool):
    """fully_shard each decoder layer, then the root; returns the same model, its parameters now DTensors."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    for layer in model.get_decoder().layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy, reshard_after_forward=True)  # the root too: parameters() stay the shards
    for unit in units(model):
        unit.set_gradient_divide_factor(1.0)  # summed like DDP's all-reduce here: the loss divides by all tokens
        unit.set_force_sum_reduction_for_comms(True)  # plain sums: gloo (the CPU) has no pre-multiplied sum
        unit.set_reduce_scatter_unused_params(True)  # every rank reduces every parameter, used or not
    # FSDP names its root by the first forward through it: run it now, before a step calls the decoder directly
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=_device(model)))
    for unit in units(model):
        unit.reshard()
    return model


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def units(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model, train: bool = False):
    """Every rank holds the whole model inside (one all-gather per unit), and runs whatever forwards and
    backwards it likes without a collective; with train=True the gradients are reduce-scattered on the way out.
    A no-op for a model that is not sharded."""
    if model is None or not is_sharded(model):
        yield
        return
    fsdp_units = units(model)
    for unit in fsdp_units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.set_reshard_after_backward(False, recurse=False)
        if train:
            unit.set_requires_gradient_sync(False, recurse=False)
        unit.unshard()
    try:
        yield
        if train:  # the one collective backward: reduce-scatter what every rank accumulated
            for unit in fsdp_units:
                unit.set_requires_gradient_sync(True, recurse=False)
            logits = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=_device(model))).logits
            (logits.float().sum() * 0.0).backward()
    finally:
        for unit in fsdp_units:
            unit.set_requires_gradient_sync(True, recurse=False)
            unit.set_reshard_after_forward(True, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)
            unit.reshard()


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0, on the CPU (empty on the other ranks); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(model, optimizer, model_state: dict, optimizer_state: dict | None) -> None:
    """Every rank passes the full dicts (read from the checkpoint); each keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    if optimizer_state is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def _device(model) -> torch.device:
    param = next(model.parameters())
    return param.device if not hasattr(param, "to_local") else param.to_local().device
