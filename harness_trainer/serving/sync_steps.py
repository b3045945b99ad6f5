"""What every weight-sync backend shares: the backends' names, and one HTTP step that either succeeds or fails
loudly (a timeout, an unreachable engine and a non-2xx answer each raise WeightSyncError naming the step)."""

from __future__ import annotations

import httpx

from harness_trainer._exceptions import EngineUnreachable, WeightSyncError

RELOAD, LORA, NCCL, IPC = "reload", "lora", "nccl", "ipc"  # every weight_sync_backend's name, defined here once
GPU_BACKENDS = (NCCL, IPC)  # GPU to GPU on vLLM's weight-transfer engines (gpu_sync.py)
BACKENDS = (RELOAD, LORA, *GPU_BACKENDS)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank accepts


def lora_rank_served(rank: int) -> int | None:
    """The --max-lora-rank an engine needs to serve adapters of `rank` (the next value vLLM accepts), or None
    when vLLM serves none that large (the run's config refuses it before anything starts)."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


def post_step(client: httpx.Client, url: str, step: str, **kwargs) -> httpx.Response:
    """POST one step; a failed reload step warns that the engine may now be unusable."""
    try:
        response = client.post(url, **kwargs)
    except httpx.TimeoutException:
        raise WeightSyncError(f"weight sync step '{step}' timed out after {client.timeout.read} s ({url})") from None
    except httpx.TransportError as exc:
        raise EngineUnreachable(f"weight sync step '{step}' could not reach {url}: {exc}") from None
    except httpx.HTTPError as exc:
        raise WeightSyncError(f"weight sync step '{step}' could not reach {url}: {exc}") from None
    if not response.is_success:
        after = (" A reload that failed inside vLLM can leave it unable to serve: restart the engine."
                 if step == "reload_weights" else "")
        raise WeightSyncError(
            f"weight sync step '{step}' failed: HTTP {response.status_code} from {url}: {response.text[:500]}. "
            f"The server needs VLLM_SERVER_DEV_MODE=1 (harness-train serve sets it).{after}")
    return response


