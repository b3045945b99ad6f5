"""LoRA on the trainer's side: train a low-rank adapter instead of every weight.

    y = W x  +  (alpha / r) * B (A x)        A: r x d_in (random), B: d_out x r (zero at the start)

- peft's `get_peft_model` injects the lora layers into the model in place, so the trainer's forward (tree
  attention, micro-batches) runs unchanged and only A, B get gradients. The KL reference is the same model with
  the adapter disabled: no second copy of the weights.
- The engine's side (each version loaded into vLLM by name, `policy-v{N}`): serving/weight_sync.py, LoraSync.
- Outputs: a checkpoint holds the adapter; final/ a merged model vLLM serves alone, with adapter/ beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness_trainer._exceptions import ConfigError

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
@dataclass
class LoraSettings:
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0  # > 0 makes the trainer's logprobs noisy next to the engine's (which has none)
    target_modules: list[str] | None = None  # None: the attention and MLP projections the model has


def lora_targets(model, requested: list[str] | None) -> list[str]:
    """The modules the adapter goes into: `requested`, else the attention and MLP projections the model has; a
    ConfigError names any the model lacks."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = list(requested or [t for t in DEFAULT_TARGETS if t in names])
    missing = [t for t in targets if t not in names]
    if not targets or missing:
        raise ConfigError(f"--lora-target-modules {','.join(missing or targets)}: the model has no such modules; give "
                          f"names of its linear layers (e.g. {', '.join(DEFAULT_TARGETS)})")
    return targets


def check_lora_targets(model_dir, requested: list[str] | None) -> None:
    """Before any process starts: the model's modules read from its config alone (built on the meta device: no
    weights loaded, no memory used)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    lora_targets(model, requested)


def add_lora(model, settings: LoraSettings):
    """Inject the adapter into `model` in place; returns the PeftModel (for saving, disabling, merging)."""
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model, settings.target_modules)
    return get_peft_model(model, LoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                                            lora_dropout=settings.dropout, target_modules=targets, bias="none",
                                            task_type="CAUSAL_LM"))


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The base weights with every adapter's delta added (W + alpha/r B A), under the model's own key names: what
    a model without peft holds. Layer by layer, so no second copy of the model is made."""
    from peft.tuners.lora import LoraLayer

    deltas = {name: module.get_delta_weight("default") for name, module in model.named_modules()
              if isinstance(module, LoraLayer) and "default" in module.lora_A}
    merged = {}
    for key, value in model.state_dict().items():
        if ".lora_" in key:
            continue
        clean = key.replace(".base_layer.", ".")
        layer = clean.rsplit(".", 1)[0]
        merged[clean] = (value + deltas[layer].to(value.dtype)) if clean.endswith(".weight") and layer in deltas \
            else value
    return merged
