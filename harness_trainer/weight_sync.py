"""Weights back into the serving vLLM: the `reload` path, which works on every vLLM build, CPU included.

    trainer weights --save_pretrained--> RAM-backed dir, then, with the engine paused (/pause?mode=keep):
        /collective_rpc reload_weights   the new weights, in place
        /reset_prefix_cache              cached keys/values were computed by the old weights; running
                                         requests are preempted and recompute theirs
        /update_weight_version           so every later answer can be told apart by version
    and /resume: requests in flight continue on the new weights, none is aborted.

Every HTTP step has a timeout and a non-2xx answer raises WeightSyncError naming the step: a sync either
finishes or fails loudly, it never hangs.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import httpx


class WeightSyncError(RuntimeError):
    """A weight-sync step failed or timed out; the message names the step and the server's answer."""


def ram_dir(prefix: str = "harness-weights-") -> Path:
    """A fresh directory on a RAM-backed filesystem when there is one (/dev/shm), else the temp dir."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def save_weights(model, directory: str | Path) -> Path:
    """Write a model's weights (+config) as a Hugging Face checkpoint vLLM can reload from."""
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _post(client: httpx.Client, url: str, step: str, **kwargs) -> httpx.Response:
    """POST one step; a failed reload step warns that the engine may now be unusable."""
    try:
        response = client.post(url, **kwargs)
    except httpx.TimeoutException:
        raise WeightSyncError(f"weight sync step '{step}' timed out after {client.timeout.read} s ({url})") from None
    except httpx.HTTPError as exc:
        raise WeightSyncError(f"weight sync step '{step}' could not reach {url}: {exc}") from None
    if not response.is_success:
        after = (" A reload that failed inside vLLM can leave it unable to serve: restart the engine."
                 if step == "reload_weights" else "")
        raise WeightSyncError(
            f"weight sync step '{step}' failed: HTTP {response.status_code} from {url}: {response.text[:500]}. "
            f"The server needs VLLM_SERVER_DEV_MODE=1 (harness-train serve sets it).{after}")
    return response


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
        _post(client, f"{base}/pause", "pause", params={"mode": "keep"})
        try:
            _post(client, f"{base}/collective_rpc", "reload_weights", json={
                "method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}, "timeout": timeout_s})
            # Drop every cached key/value, those of running requests too: they are preempted and recompute
            # their prefix with the new weights, so no token is ever sampled from a mix of old and new KV.
            reset = _post(client, f"{base}/reset_prefix_cache", "reset_prefix_cache",
                          params={"reset_running_requests": "true"})
            if not reset.json().get("success", True):
                raise WeightSyncError("weight sync step 'reset_prefix_cache' failed: vLLM could not drop the "
                                      "cached keys/values computed with the old weights")
            _post(client, f"{base}/update_weight_version", "update_weight_version",
                  json={"new_version": str(version)})
        finally:
            _post(client, f"{base}/resume", "resume")
    return time.perf_counter() - started


def weight_version(server) -> str | None:
    base = (server if isinstance(server, str) else server.url).rstrip("/")
    response = httpx.get(f"{base}/weight_info", timeout=10)
    response.raise_for_status()
    return response.json().get("weight_version")
