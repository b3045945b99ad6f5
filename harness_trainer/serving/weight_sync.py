"""The trainer's policy into the serving vLLM as version N: every backend behind one interface (WeightSync).
On GPU, nccl and ipc stream the weights without a file (gpu_sync.py); reload and lora are here.

reload (ReloadSync): every weight, on every vLLM build, CPU included.

    trainer weights --save_pretrained--> RAM-backed dir, then, with the engine paused (/pause?mode=keep):
        /collective_rpc reload_weights   the new weights, in place
        /reset_prefix_cache              cached keys/values were computed by the old weights; running
                                         requests are preempted and recompute theirs
        /update_weight_version           so every later answer can be told apart by version
    and /resume: requests in flight continue on the new weights, none is aborted.

lora (LoraSync): the adapter (KBs to MBs) saved to a RAM folder and loaded by name, `policy-v{N}`, with
`POST /v1/load_lora_adapter`: the engine never pauses and never reloads its base weights; the proxy sends every
new call to that name, so each captured turn records the adapter that sampled it; old versions are unloaded
once no call in flight uses them. The engine needs `--enable-lora --max-lora-rank R --max-loras K` and
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (engine_args, ENGINE_ENV).

Every HTTP step has a timeout and a non-2xx answer raises WeightSyncError naming the step: a sync either
finishes or fails loudly, it never hangs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Protocol

import httpx

from harness_trainer._exceptions import ConfigError, EngineUnreachable, WeightSyncError
from harness_trainer.choices import choose
from harness_trainer.models.untie import HEAD_FILE
from harness_trainer.serving.sync_steps import (
    BACKENDS,
    GPU_BACKENDS,
    LORA,
    RELOAD,
    VLLM_LORA_RANKS,
    lora_rank_served,
    post_step,
)


class WeightSync(Protocol):
    """One weight-sync backend: the policy into the engine at `url` as `version`."""

    def load(self, model, version: int, state_dict: dict | None = None) -> str | None:
        """Put `model` (a PeftModel for lora) into the engine as `version` (`state_dict`: its weights when the
        model does not hold them whole: FSDP shards); returns the model name the engine now serves it under, or
        None when it is the engine's own name."""

    def unload_idle(self, oldest_kept: int, in_flight: dict[str, int]) -> list[int]:
        """Release versions older than `oldest_kept` that no call in flight samples from; returns them."""

    def close(self) -> None:
        """Release what the backend holds on this side (folders)."""


def make_weight_sync(backend: str, url: str, timeout_s: float = 120.0) -> WeightSync:
    """The backend of that name for the engine at `url` (the registry: WEIGHT_SYNCS, after the classes)."""
    choose("weight_sync_backend", backend, WEIGHT_SYNCS)
    return WEIGHT_SYNCS[backend](url, timeout_s)


def ram_dir(prefix: str = "harness-weights-") -> Path:
    """A fresh directory for one sync's files: under $HARNESS_WEIGHTS_DIR when set (engines on other hosts read
    the path they are given: it must be storage they mount at the same path), else on a RAM-backed filesystem
    when there is one (/dev/shm), else the temp dir."""
    base = os.environ.get("HARNESS_WEIGHTS_DIR") or (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def save_weights(model, directory: str | Path, state_dict: dict | None = None) -> Path:
    """Write a model's weights (+config) as a Hugging Face checkpoint vLLM can reload from (`state_dict`: the
    weights, when the model does not hold them whole). A tied lm_head is written as a weight of its own too: the
    engine serves tied models untied (models/untie.py)."""
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True, state_dict=state_dict)
    if getattr(model.config, "tie_word_embeddings", False):
        from safetensors.torch import save_file

        head = (state_dict.get("lm_head.weight", state_dict["model.embed_tokens.weight"]) if state_dict else
                model.get_output_embeddings().weight).detach().contiguous().cpu()
        save_file({"lm_head.weight": head}, str(directory / HEAD_FILE))
    return directory


def reload_weights(server, checkpoint_dir: str | Path, version: int | str, timeout_s: float = 120.0) -> float:
    """Load `checkpoint_dir` into the running server and stamp it as `version`. Returns seconds taken.

    `server` is a URL or anything with a `.url` (a VLLMServer)."""
    base = (server if isinstance(server, str) else server.url).rstrip("/")
    checkpoint = Path(checkpoint_dir).resolve()
    # Checked here, before the engine is touched: vLLM's in-place reload moves layers off their device
    # first, so a reload that fails halfway leaves the engine unable to serve (EngineDeadError).
    if not checkpoint.is_dir() or not any(checkpoint.glob("*.safetensors")):
        raise WeightSyncError(f"weight sync step 'reload_weights' refused: {checkpoint} holds no *.safetensors "
                              "weights (write them with save_weights(model, dir) first); the engine was not touched")
    started = time.perf_counter()
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        # Freeze the engine: requests in flight keep their place (mode=keep) instead of being aborted.
        post_step(client, f"{base}/pause", "pause", params={"mode": "keep"})
        try:
            post_step(client, f"{base}/collective_rpc", "reload_weights", json={
                "method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}, "timeout": timeout_s})
            # Drop every cached key/value, those of running requests too: they are preempted and recompute
            # their prefix with the new weights, so no token is ever sampled from a mix of old and new KV.
            reset = post_step(client, f"{base}/reset_prefix_cache", "reset_prefix_cache",
                          params={"reset_running_requests": "true"})
            if not reset.json().get("success", True):
                raise WeightSyncError("weight sync step 'reset_prefix_cache' failed: vLLM could not drop the "
                                      "cached keys/values computed with the old weights")
            post_step(client, f"{base}/update_weight_version", "update_weight_version",
                  json={"new_version": str(version)})
        finally:
            post_step(client, f"{base}/resume", "resume")
    return time.perf_counter() - started


def weight_version(server) -> str | None:
    base = (server if isinstance(server, str) else server.url).rstrip("/")
    response = httpx.get(f"{base}/weight_info", timeout=10)
    response.raise_for_status()
    return response.json().get("weight_version")


class ReloadSync:
    """The `reload` backend: every weight saved to a RAM folder and reloaded in place (reload_weights)."""

    def __init__(self, url: str, timeout_s: float = 120.0):
        self.url, self.timeout_s = url, timeout_s

    def load(self, model, version: int, state_dict: dict | None = None) -> None:
        directory = ram_dir()
        try:
            save_weights(model, directory, state_dict)
            reload_weights(self.url, directory, version=version, timeout_s=self.timeout_s)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return None

    def unload_idle(self, oldest_kept: int, in_flight: dict[str, int]) -> list[int]:
        return []  # one set of weights: nothing older is held

    def close(self) -> None:
        pass


ENGINE_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}  # /v1/load_lora_adapter and /v1/unload_lora_adapter
ENGINE_FLAGS_HINT = ("start vLLM with --enable-lora --max-lora-rank R --max-loras K (K >= max_staleness + 2) and "
                     "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (harness-train does when it launches the engine)")


def engine_args(rank: int, max_loras: int) -> list[str]:
    """vLLM flags for serving adapters up to `rank` (rounded up to a rank vLLM accepts)."""
    allowed = lora_rank_served(rank)
    if allowed is None:  # the run's config refuses it first (training/config.py)
        raise ConfigError(f"lora_rank {rank} is larger than vLLM's largest --max-lora-rank ({VLLM_LORA_RANKS[-1]})")
    return ["--enable-lora", "--max-lora-rank", str(allowed), "--max-loras", str(max_loras)]


def adapter_name(version: int) -> str:
    return f"policy-v{version}"


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
        except httpx.TransportError as exc:
            raise EngineUnreachable(f"weight sync step '{step}' could not reach {self.base}: {exc}") from None
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"weight sync step '{step}' could not reach {self.base}: {exc}") from None
        if response.status_code == 404 and response.text.strip() == '{"detail":"Not Found"}':  # no such route
            raise WeightSyncError(f"weight sync step '{step}': the engine has no {route} route: {ENGINE_FLAGS_HINT}")
        return response

    def load(self, peft_model, version: int, state_dict: dict | None = None) -> str:
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


def _transfer(backend: str):
    def make(url: str, timeout_s: float) -> WeightSync:
        from harness_trainer.serving.gpu_sync import TransferSync  # torch and vllm: only where they run

        return TransferSync(backend, url, timeout_s)
    return make


# backend name -> make(url, timeout_s): a new backend is a class with WeightSync's methods and one entry here
WEIGHT_SYNCS = {RELOAD: ReloadSync, LORA: LoraSync, **{name: _transfer(name) for name in GPU_BACKENDS}}
assert tuple(WEIGHT_SYNCS) == BACKENDS
