"""LoRA: train a low-rank adapter instead of every weight, and hand each version to the same vLLM as a named
adapter (`policy-v{N}`), loaded at runtime: the engine never pauses and never reloads its base weights.

    y = W x  +  (alpha / r) * B (A x)        A: r x d_in (random), B: d_out x r (zero at the start)

- Training: peft's `get_peft_model` injects the lora layers into the model in place, so the trainer's forward
  (tree attention, micro-batches) runs unchanged and only A, B get gradients. The KL reference is the same
  model with the adapter disabled: no second copy of the weights.
- Engine: `--enable-lora --max-lora-rank R --max-loras K` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`.
- Sync (`LoraSync`): save the adapter (safetensors: KBs to MBs) to a RAM folder, `POST /v1/load_lora_adapter`
  under the version's name; the proxy then sends every new model call to that name, so each captured turn
  records the adapter that sampled it; old versions are unloaded once no call in flight uses them.
- Outputs: a checkpoint holds the adapter; final/ a merged model vLLM serves alone, with adapter/ beside it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from harness_trainer.weight_sync import WeightSyncError, ram_dir

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank accepts
ENGINE_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}  # /v1/load_lora_adapter and /v1/unload_lora_adapter
ENGINE_FLAGS_HINT = ("start vLLM with --enable-lora --max-lora-rank R --max-loras K (K >= max_staleness + 2) and "
                     "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (harness-train does when it launches the engine)")


@dataclass
class LoraSettings:
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0  # > 0 makes the trainer's logprobs noisy next to the engine's (which has none)
    target_modules: list[str] | None = None  # None: the attention and MLP projections the model has


def add_lora(model, settings: LoraSettings):
    """Inject the adapter into `model` in place; returns the PeftModel (for saving, disabling, merging)."""
    from peft import LoraConfig, get_peft_model

    if settings.rank < 1:
        raise ValueError(f"lora_rank must be a positive integer, got {settings.rank}")
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = list(settings.target_modules or [t for t in DEFAULT_TARGETS if t in names])
    missing = [t for t in targets if t not in names]
    if not targets or missing:
        raise ValueError(f"lora_target_modules {missing or targets}: the model has no such modules; give names of "
                         f"its linear layers (e.g. {', '.join(DEFAULT_TARGETS)})")
    return get_peft_model(model, LoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                                            lora_dropout=settings.dropout, target_modules=targets, bias="none",
                                            task_type="CAUSAL_LM"))


def engine_args(rank: int, max_loras: int) -> list[str]:
    """vLLM flags for serving adapters up to `rank` (rounded up to a rank vLLM accepts)."""
    allowed = next((r for r in VLLM_RANKS if r >= rank), None)
    if allowed is None:
        raise ValueError(f"lora_rank {rank} is larger than vLLM's largest --max-lora-rank ({VLLM_RANKS[-1]})")
    return ["--enable-lora", "--max-lora-rank", str(allowed), "--max-loras", str(max_loras)]


def adapter_name(version: int) -> str:
    return f"policy-v{version}"


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


class LoraSync:
    """The `lora` weight-sync backend: each version loaded into vLLM by name, old ones unloaded when idle."""

    def __init__(self, url: str, timeout_s: float = 120.0):
        self.base = url.rstrip("/")
        self.timeout_s = timeout_s
        self.loaded: dict[int, Path] = {}  # version -> its adapter folder (vLLM may re-read it on a cache miss)

    def _post(self, route: str, body: dict, step: str) -> httpx.Response:
        try:
            response = httpx.post(f"{self.base}{route}", json=body, timeout=self.timeout_s)
        except httpx.TimeoutException:
            raise WeightSyncError(f"weight sync step '{step}' timed out after {self.timeout_s} s") from None
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"weight sync step '{step}' could not reach {self.base}: {exc}") from None
        if response.status_code == 404 and response.text.strip() == '{"detail":"Not Found"}':  # no such route
            raise WeightSyncError(f"weight sync step '{step}': the engine has no {route} route: {ENGINE_FLAGS_HINT}")
        return response

    def load(self, peft_model, version: int) -> str:
        """Save the adapter and load it as `policy-v{version}`; returns the name."""
        name, directory = adapter_name(version), ram_dir(f"harness-lora-v{version}-")
        peft_model.save_pretrained(directory)
        body = {"lora_name": name, "lora_path": str(directory)}
        response = self._post("/v1/load_lora_adapter", body, "load_lora_adapter")
        if response.status_code == 400 and "already" in response.text.lower():  # a resumed run, same engine
            self._post("/v1/unload_lora_adapter", {"lora_name": name}, "unload_lora_adapter")
            response = self._post("/v1/load_lora_adapter", body, "load_lora_adapter")
        if not response.is_success:
            shutil.rmtree(directory, ignore_errors=True)
            raise WeightSyncError(f"weight sync step 'load_lora_adapter' failed: HTTP {response.status_code}: "
                                  f"{response.text[:400]}. If LoRA is off in the engine: {ENGINE_FLAGS_HINT}")
        if (old := self.loaded.get(version)) is not None:  # loaded again (the engine restarted)
            shutil.rmtree(old, ignore_errors=True)
        self.loaded[version] = directory
        return name

    def unload_idle(self, oldest_kept: int, in_flight: dict[str, int]) -> list[int]:
        """Unload versions older than `oldest_kept` that no model call in flight uses; returns them."""
        gone = []
        for version in sorted(v for v in self.loaded if v < oldest_kept):
            if in_flight.get(adapter_name(version)):
                continue  # a call still samples from it: try again after the next sync
            response = self._post("/v1/unload_lora_adapter", {"lora_name": adapter_name(version)},
                                  "unload_lora_adapter")
            if not response.is_success and response.status_code != 404:
                raise WeightSyncError(f"weight sync step 'unload_lora_adapter' failed: HTTP "
                                      f"{response.status_code}: {response.text[:400]}")
            shutil.rmtree(self.loaded.pop(version), ignore_errors=True)
            gone.append(version)
        return gone

    def close(self) -> None:
        for directory in self.loaded.values():
            shutil.rmtree(directory, ignore_errors=True)
        self.loaded.clear()
