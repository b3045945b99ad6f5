"""What a run stands on, built one way for training, eval and white-box runs:

    engine (launched for a model folder, --engines N of them, or attached by --vllm-url, repeated for several)
      [<- the oracle upstream: each task's known solution, for eval --policy oracle]
      <- capture proxy (journal and log in the output folder)
      -> a session factory over the proxy: agents in sandboxes (LocalSessionFactory) or a white-box
         environment (EnvironmentSessionFactory); the trainer calls it with its sampling policy

The settings it reads are rollouts/config.py's RolloutConfig (the train and eval configs inherit it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from harness_trainer.agents.registry import FILE_EDITS, KEYSTROKES, READ_BEFORE_EDIT
from harness_trainer.models.hub import ModelRef
from harness_trainer.proxy.client import ProxyClient, ProxyServer
from harness_trainer.rollouts.config import RolloutConfig
from harness_trainer.rollouts.environments import EnvironmentSessionFactory
from harness_trainer.rollouts.session import LocalSessionFactory
from harness_trainer.sandboxes.registry import SandboxProvider
from harness_trainer.serving.engine import EngineConfig, VLLMServer
from harness_trainer.serving.placement import Placement, plan_placement, resolve_weight_sync, visible_gpus
from harness_trainer.serving.supervise import Supervisor
from harness_trainer.serving.sync_steps import GPU_BACKENDS, NCCL


@dataclass
class Services:
    engine: VLLMServer
    proxy: ProxyServer
    session_factory: Callable  # SamplingPolicy -> the factory of rollout sessions (session.py: SessionFactory)
    supervisor: Supervisor | None = None


def run_placement(cfg: RolloutConfig, trainer_gpus: str | None = None, *, training: bool = False) -> Placement:
    """Where this run's engines and (`training`) the trainer go on the host's GPUs; eval's engines take every GPU.
    PlacementError for a layout that cannot work."""
    return plan_placement(visible_gpus(), cfg.engine_gpus, trainer_gpus, cfg.engines, cfg.engine_memory_share,
                          attached=bool(cfg.vllm_url), trainer=training)


def environment_session_factory(proxy: ProxyClient, environment, *, max_tool_calling_iterations: int | None,
                                max_completion_length: int, agent_timeout_s: float | None = None) -> Callable:
    """The session factory of a white-box `environment` class (rollouts/environments.py)."""
    return partial(EnvironmentSessionFactory, proxy=proxy, environment_factory=environment,
                   max_tool_calling_iterations=max_tool_calling_iterations,
                   max_completion_length=max_completion_length, agent_timeout_s=agent_timeout_s)


def session_factory(cfg, proxy: ProxyClient, environment=None, output_dir: Path | None = None,
                    upload_solution: bool = False, sandboxes: SandboxProvider | None = None) -> Callable:
    """The factory the trainer (or eval) calls with its sampling policy: `cfg` is the run's RolloutConfig (the
    train and eval configs add max_tool_calling_iterations and max_completion_length for a white-box class).
    `sandboxes`: the run's provider (its caller closes it), else the factory makes one from cfg.sandbox."""
    if environment is not None:
        return environment_session_factory(proxy, environment, agent_timeout_s=cfg.agent_timeout,
                                           max_tool_calling_iterations=cfg.max_tool_calling_iterations,
                                           max_completion_length=cfg.max_completion_length)
    return partial(LocalSessionFactory, proxy=proxy, harness=cfg.harness, sandbox=sandboxes or cfg.sandbox,
                   output_dir=output_dir or Path("runs/rollouts"), step_limit=cfg.agent_step_limit,
                   agent_timeout_s=cfg.agent_timeout, reward_key=cfg.reward_key, agent_command=cfg.agent_command,
                   agent_config=cfg.agent_config, public_url=cfg.public_url, upload_solution=upload_solution)


@contextlib.contextmanager
def run_services(cfg: RolloutConfig, out: Path, *, model: ModelRef | None, environment=None,
                 rollouts_dir: Path | None = None, oracle_tasks: list | None = None,
                 oracle_mistake_rate: float = 0.0, supervise: bool = False, lora_rank: int = 0,
                 max_loras: int = 4, placement: Placement | None = None,
                 weight_sync_backend: str | None = None) -> Iterator[Services]:
    """Engine, [oracle,] proxy and the session factory, stopped on exit. `placement`: a training run's (eval's
    engines take every GPU); `weight_sync_backend`: how its weights reach the engines. `oracle_tasks`: answer
    model calls with those tasks' solutions. `supervise`: a server of ours that dies is started again on its port (the
    trainer waits for it and puts back what it lost, serving/supervise.py)."""
    with contextlib.ExitStack() as stack:
        engines = []
        if cfg.vllm_url:  # several: the first answers for all (they serve the same model); the proxy uses each
            engine = VLLMServer.attach(cfg.vllm_url[0])
        else:  # on the placement's GPUs (serving/placement.py), else side by side on the CPU
            placement = placement or run_placement(cfg)
            transfer = resolve_weight_sync(weight_sync_backend, lora_rank > 0, placement)
            for i in range(cfg.engines):
                engines.append(stack.enter_context(VLLMServer(EngineConfig(
                    model=str(model.path), served_model_name=model.name, port=cfg.engine_port + i if cfg.engine_port
                    else 0, log_path=out / (f"vllm{i}.log" if i else "vllm.log"), max_model_len=cfg.max_model_len,
                    tool_call_parser=cfg.tool_call_parser, reasoning_parser=cfg.reasoning_parser, lora_rank=lora_rank,
                    max_loras=max_loras, devices=placement.engine_devices(i), gpu=placement.gpu,
                    tensor_parallel=placement.tensor_parallel(i), gpu_memory_utilization=placement.memory_share,
                    weight_transfer=transfer if transfer in GPU_BACKENDS else NCCL))))
            engine = engines[0]
        upstream = [engine.url, *(cfg.vllm_url or [])[1:], *(e.url for e in engines[1:])]
        if oracle_tasks is not None:
            from harness_trainer.rollouts.oracle import OracleUpstream

            upstream = stack.enter_context(OracleUpstream(engine.url, oracle_tasks, model=engine.model_name,
                                                          mistake_rate=oracle_mistake_rate,
                                                          read_before_edit=cfg.harness in READ_BEFORE_EDIT,
                                                          file_edits=cfg.harness in FILE_EDITS,
                                                          keystrokes=cfg.harness in KEYSTROKES)).url
        host = "0.0.0.0" if cfg.public_url else "127.0.0.1"  # remote sandboxes reach it from outside
        proxy = stack.enter_context(ProxyServer(upstream, model=engine.model_name, port=cfg.proxy_port, host=host,
                                                journal=out / "journal", log_path=out / "proxy.log"))
        supervisor = None
        if supervise:
            watched = {"the capture proxy": (proxy.managed, proxy.startup_timeout_s)}
            for i, launched in enumerate(engines):
                watched[f"vLLM {i}" if i else "vLLM"] = (launched.managed, launched.cfg.startup_timeout_s)
            supervisor = stack.enter_context(Supervisor(watched))
        sandboxes = None if environment is not None else stack.enter_context(SandboxProvider(
            cfg.sandbox, public_url=cfg.public_url, log_dir=(rollouts_dir or Path("runs/rollouts")) / "builds"))
        yield Services(engine, proxy, session_factory(cfg, proxy.client, environment, rollouts_dir,
                                                      upload_solution=oracle_tasks is not None,
                                                      sandboxes=sandboxes), supervisor)


def environment_sessions(environment_factory, vllm_url: str | None, output_dir: str | Path, *,
                         max_completion_length: int, max_tool_calling_iterations: int | None
                         ) -> tuple[Callable, ProxyServer]:
    """For a trainer given only environment_factory (TRL's call shape): a capture proxy of its own in front of
    the engine at `vllm_url` (started and stopped by the trainer) and the session factory over it."""
    from harness_trainer._exceptions import EnvironmentContractError

    if not vllm_url:
        raise EnvironmentContractError("an environment_factory run samples from vLLM through the capture proxy: set "
                                       "vllm_server_base_url (start one with `harness-train serve --model DIR`)")
    out = Path(output_dir)
    engine = VLLMServer.attach(vllm_url)
    proxy = ProxyServer(engine.url, model=engine.model_name, journal=out / "journal", log_path=out / "proxy.log")
    return environment_session_factory(proxy.client, environment_factory,
                                       max_completion_length=max_completion_length,
                                       max_tool_calling_iterations=max_tool_calling_iterations), proxy
