"""GPU to GPU weight syncs on vLLM's own weight-transfer engines (vllm.distributed.weight_transfer): no file, no
copy through the host.

    nccl   the engine on other GPUs: the trainer opens an NCCL group with the engine's workers (trainer = rank 0)
           and broadcasts every weight; vLLM's NCCLTrainerWeightTransferEngine drives both ends
    ipc    the engine on the trainer's own GPU: CUDA IPC handles to the trainer's tensors; the engine copies
           from them in place (IPCTrainerWeightTransferEngine)

Each sync, like the reload's (weight_sync.py): /pause?mode=keep, then vLLM's round trip over its RL routes
(/start_weight_update, /update_weights, /finish_weight_update, through its HTTPVLLMWeightSyncClient),
/update_weight_version, /reset_prefix_cache (keys/values of the old weights), /resume. The engine is started with
`--weight-transfer-config {"backend": ...}` (serving/engine.py does, from the placement).

Bounded, never hung: the transfer runs on a worker thread while this one watches the engine's /health. If the
engine stops answering, or the transfer outlives timeout_s, the sync raises WeightSyncError at once. A failed NCCL
transfer leaves its group unusable on both sides (NCCL cannot be cancelled): the backend is then broken, the run
stops with the last step saved, and a restarted engine and run start a fresh group.

The trainer's environment needs `vllm` (on GPU, scripts/setup.sh installs it beside the trainer: the release pins
the trainer's torch); the CPU has neither CUDA nor these backends (reload there).
"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlparse

import httpx

from harness_trainer._exceptions import WeightSyncError
from harness_trainer.choices import choose
from harness_trainer.serving.process import HEALTH_EVERY_S, engine_answers, free_port
from harness_trainer.serving.sync_steps import GPU_BACKENDS, NCCL, post_step


def transfer_available() -> str | None:
    """None when this process can run the nccl / ipc syncs, else why not (a line a user can act on)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "this process sees no CUDA device (the nccl and ipc syncs stream GPU memory): use reload"
    try:
        import vllm.distributed.weight_transfer  # noqa: F401
    except ImportError as exc:
        return (f"the trainer's environment has no vllm ({exc}): `make setup` on a GPU host installs vllm beside "
                "the trainer, or `pip install vllm==0.32.0` there; or use weight_sync_backend='reload'")
    return None


class TransferSync:
    """One engine's nccl / ipc weight sync (the WeightSync protocol of weight_sync.py)."""

    def __init__(self, backend: str, url: str, timeout_s: float = 120.0):
        choose("weight_sync_backend", backend, GPU_BACKENDS)
        if (missing := transfer_available()) is not None:
            raise WeightSyncError(f"weight sync backend '{backend}' cannot run: {missing}")
        self.backend, self.base, self.timeout_s = backend, url.rstrip("/"), timeout_s
        self.engine = None  # vLLM's trainer-side engine, made at the first sync (it needs the model)
        self.source = None
        self.broken: str | None = None  # why the transfer group can no longer be used

    def load(self, model, version: int, state_dict: dict | None = None) -> None:
        if self.broken:
            raise WeightSyncError(f"weight sync backend '{self.backend}' is unusable after an earlier failure "
                                  f"({self.broken}): restart the engine and resume the run")
        self.source_of(model, state_dict)
        with httpx.Client(timeout=httpx.Timeout(self.timeout_s, connect=10.0)) as client:
            if self.engine is None:
                self._guarded("init_weight_transfer_engine", self._init)
            post_step(client, f"{self.base}/pause", "pause", params={"mode": "keep"})
            try:
                self._guarded("send_weights", self.engine.send_weights)
                post_step(client, f"{self.base}/update_weight_version", "update_weight_version",
                      json={"new_version": str(version)})
                post_step(client, f"{self.base}/reset_prefix_cache", "reset_prefix_cache",
                      params={"reset_running_requests": "true"})
            finally:
                try:
                    post_step(client, f"{self.base}/resume", "resume")
                except WeightSyncError:
                    if not self.broken:  # after a broken transfer the engine may be gone: the first error stands
                        raise
        return None

    def source_of(self, model, state_dict: dict | None):
        """What is sent, in vLLM's WeightSource form: the model's parameters as they are on its GPU, or the
        gathered weights (FSDP) moved to the GPU one tensor at a time. A tied lm_head is sent as its own weight:
        the engine serves tied models untied (models/untie.py)."""
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

        head = getattr(model.config, "tie_word_embeddings", False) and (
            state_dict is None or "lm_head.weight" not in state_dict)

        def named():  # (name, tensor) where it lives: the GPU, or the CPU for gathered weights
            yield from state_dict.items() if state_dict is not None else model.named_parameters()
            if head:
                yield "lm_head.weight", model.get_output_embeddings().weight

        class Weights(WeightSource):
            def metadata(self):
                return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in named()]

            def __iter__(self):
                import torch

                device = torch.device("cuda", torch.cuda.current_device())
                return ((name, t.detach().to(device, non_blocking=True)) for name, t in named())

        self.source = Weights()
        if self.engine is not None:
            self.engine.source = self.source
        return self.source

    def _init(self) -> None:
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

        client = HTTPVLLMWeightSyncClient(self.base, timeout=self.timeout_s)
        if self.backend == NCCL:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            workers = engine_world_size(self.base)
            info = NCCLTrainerInitInfo(master_address=address_towards(self.base), master_port=free_port(),
                                       world_size=1 + workers, rank=0)
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(rank=0)
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source)

    def _guarded(self, step: str, work) -> None:
        """Run `work` on a worker thread, watching the engine: a dead engine or an overrun fails the step now."""
        import torch

        done, failure = threading.Event(), []
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def run():
            try:
                if device is not None:  # the current CUDA device is per thread: NCCL and IPC bind to it
                    torch.cuda.set_device(device)
                work()
            except BaseException as exc:  # noqa: BLE001 - carried to the caller
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name=f"weight-sync-{step}", daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        while not done.wait(HEALTH_EVERY_S):
            if not engine_answers(self.base):
                self.broken = f"the engine at {self.base} stopped answering during '{step}'"
                raise WeightSyncError(f"weight sync step '{step}' failed: {self.broken}")
            if time.monotonic() > deadline:
                self.broken = f"'{step}' took more than {self.timeout_s:.0f} s"
                raise WeightSyncError(f"weight sync step '{step}' timed out after {self.timeout_s:.0f} s "
                                      f"({self.base}); the {self.backend} group is left unusable")
        if failure:
            exc = failure[0]
            if self.backend == NCCL and step == "send_weights":
                self.broken = f"'{step}' failed: {exc}"
            raise WeightSyncError(f"weight sync step '{step}' failed: {type(exc).__name__}: {exc}. "
                                  f"{_hint(exc, self.backend)}") from None

    def unload_idle(self, oldest_kept: int, in_flight: dict[str, int]) -> list[int]:
        return []  # one set of weights in the engine

    def close(self) -> None:
        if self.engine is not None and not self.broken:
            try:
                self.engine.shutdown()
            except Exception:  # noqa: BLE001 - best effort at the end of a run
                pass
        self.engine = None


def engine_world_size(base: str) -> int:
    """The engine's workers (tensor x pipeline parallel) that join the NCCL group."""
    try:
        response = httpx.get(f"{base}/get_world_size", params={"include_dp": "false"}, timeout=10)
        response.raise_for_status()
        return int(response.json().get("world_size", 1))
    except (httpx.HTTPError, ValueError) as exc:
        raise WeightSyncError(f"weight sync step 'get_world_size' failed at {base}: {exc}. The server needs "
                              "VLLM_SERVER_DEV_MODE=1 (harness-train serve sets it)") from None


def address_towards(base: str) -> str:
    """This host's address as the engine at `base` reaches it (the NCCL rendezvous listens there)."""
    host = urlparse(base).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the outgoing interface
        return s.getsockname()[0]


def _hint(exc: BaseException, backend: str) -> str:
    text = str(exc)
    if "404" in text or "Not Found" in text:
        return "The engine has no RL routes: it needs VLLM_SERVER_DEV_MODE=1 (harness-train serve sets it)."
    if "weight transfer" in text.lower() or "500" in text or "400" in text:
        return (f"Start the engine with --weight-transfer-config '{{\"backend\": \"{backend}\"}}' (harness-train "
                "does when it launches it), or use weight_sync_backend='reload'.")
    return "See the engine's log."
