"""`harness-train` (the default action): one command runs engine, proxy, sandboxes and the trainer.

    check everything that can be checked offline (harness installed, dataset, model, sandbox, reward, ports)
    -> engine (launched for --model, or attached by --vllm-url) -> capture proxy -> HarnessAsyncGRPOTrainer
    -> output dir: checkpoints, final/ (HF format, servable by vLLM), rollouts.jsonl + traces.jsonl,
       metrics.jsonl, reward_curve.png, summary.json

Everything started is stopped on success, error or Ctrl-C (context managers; the trainer cancels its
in-flight sandboxes), so nothing outlives the command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from harness_trainer._exceptions import ConfigError
from harness_trainer.commands.flags import ArgumentParser, add_config_flags, build_config, config_values, fields_of
from harness_trainer.rollouts.config import RolloutConfig, option
from harness_trainer.training.config import AsyncGRPOConfig


@dataclass
class TrainRunConfig(AsyncGRPOConfig, RolloutConfig):
    """The run's config: the trainer's own (training/config.py) plus what a run needs around it
    (rollouts/services.py: harness, dataset, model, sandbox, ports) and its reporting. Every field is a
    `harness-train` flag (`--num-generations`) and a --config YAML key (`num_generations`)."""
    reward: str | None = option(None, "per-rollout reward: verifier (the default without --reward-funcs), "
                                      "verifier+tools, module:function or an entry-point name")
    report_to: str = option("trackio", "trackio (local), wandb or none", choices=("trackio", "wandb", "none"))
    teacher_model: str | None = option(None, "on-policy distillation: the teacher's model folder or Hub id, served "
                                             "by an engine of its own (or attach one: --teacher-url)")

    def scores_episodes(self) -> bool:
        return bool(self.reward_funcs or self.reward)

    def check(self) -> None:
        """The trainer's rules and the rollouts' (AsyncGRPOConfig.check, RolloutConfig.check), then the run's."""
        super().check()
        if self.teacher_model and self.teacher_url:
            raise ConfigError("give --teacher-model (an engine is started for it) or --teacher-url (one you run), "
                              "not both")


FIELDS = fields_of(TrainRunConfig, skip=("vllm_server_base_url",))  # the engine's URL is --vllm-url
# old spellings -> fields (they still work, with a deprecation line)
DEPRECATED = {"--resume": "resume_from_checkpoint", "--service-recovery-timeout": "service_recovery_timeout_s"}


def add_train_flags(parser) -> None:
    add_config_flags(parser, TrainRunConfig, skip=("vllm_server_base_url",), deprecated=DEPRECATED)


def train_config(args) -> TrainRunConfig:
    """Defaults < --config file < flags given on the command line, checked."""
    return resolve_config(config_values(args, TrainRunConfig, DEPRECATED))


def parse_train_args(argv: list[str]) -> TrainRunConfig:
    """`harness-train train` flags -> the run's config (what a job launcher checks before submitting)."""
    parser = ArgumentParser(prog="harness-train train")
    add_train_flags(parser)
    return train_config(parser.parse_args(argv))


def resolve_config(values: dict) -> TrainRunConfig:
    """The run's config from flag and file values (commands/flags.py: config_values), checked by the config
    itself: the Python API refuses the same values with the same words."""
    return build_config(TrainRunConfig, values)


def check_port_free(port: int, flag: str) -> None:
    if not port:
        return
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise ConfigError(f"port {port} is in use: choose another {flag} (0 picks a free one), or stop what "
                              "listens there") from None


class MetricsReporter:
    """trackio (local files, the default), W&B, or nothing; checked before anything starts."""

    def __init__(self, report_to: str, run_name: str, config: dict):
        self.backend = None
        if report_to == "none":
            return
        try:
            self.backend = __import__(report_to)
        except ImportError:
            raise ConfigError(f"--report-to {report_to}: the {report_to} package is not installed "
                              f"(`pip install {report_to}`), or use --report-to none") from None
        self.args = dict(project="harness-train", name=run_name, config=config)

    def start(self) -> None:
        if self.backend is not None:
            self.backend.init(**self.args)

    def log(self, metrics: dict) -> None:
        if self.backend is not None:
            self.backend.log({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"},
                             step=metrics.get("step"))

    def finish(self) -> None:
        if self.backend is not None:
            self.backend.finish()


def plot_reward_curve(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("reward_mean", "reward (rollout_reward_fn)"), ("verifier_reward_mean", "verifier reward")):
        points = [(h["step"], h[key]) for h in history if h.get(key) is not None]
        if points and (key == "reward_mean" or any(h.get(key) != h.get("reward_mean") for h in history)):
            ax.plot(*zip(*points), marker="o", markersize=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of the step's group")
    ax.set_ylim(-0.05, max([1.05] + [h.get("reward_mean") or 0 for h in history]))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def check_attached_engine(engine, cfg) -> None:
    """An engine started without harness-train that serves a tied model: a reload sync could not reach its
    lm_head (models/untie.py). Its folder is read from /v1/models' `root` when it is on this machine."""
    import httpx

    from harness_trainer.models.formats import ties_embeddings

    served = httpx.get(f"{engine.url}/v1/models", timeout=10).json().get("data") or [{}]
    root = Path(str(served[0].get("root") or ""))
    if not cfg.use_peft and (root / "config.json").is_file() and ties_embeddings(root):
        raise ConfigError(f"the engine at {engine.url} serves {root}, whose lm_head is tied to its embedding: vLLM's "
                          "in-place reload would leave lm_head on the old weights after the first sync. Start it "
                          "with `harness-train serve --model ...` (it serves an untied copy), or train with --use-peft")


def white_box(cfg) -> tuple | None:
    """For --environment: the class (checked: it builds, has reset, its tools' schemas build) and the rows."""
    if not cfg.environment:
        return None
    from harness_trainer._exceptions import EnvironmentContractError
    from harness_trainer.rollouts.environments import check_environment, load_object, load_rows

    try:
        environment = load_object(cfg.environment, "--environment")
        check_environment(environment)
        return environment, load_rows(cfg.dataset)
    except EnvironmentContractError as exc:
        raise ConfigError(str(exc)) from None


def follow_training(cfg: TrainRunConfig, ready: Prepared) -> dict:
    """A rank > 0 of `accelerate launch` / `torchrun`: no engine, proxy or rollout of its own; it steps on rank 0's
    groups, joins the gathers FSDP needs, and takes part in writing final/."""
    from harness_trainer.training.trainer import HarnessAsyncGRPOTrainer

    args = dataclasses.replace(cfg, resume_from_checkpoint=ready.resume, weight_sync_backend=ready.weight_sync_backend)
    trainer = HarnessAsyncGRPOTrainer(str(ready.model.path), lambda sampling: None, args, ready.tasks,
                                      placement=ready.placement)
    trainer.train()
    if trainer.lead_failed:  # rank 0 stopped with an error: it writes no final/, so no gather to join
        return {"rank": trainer.rank, "steps": trainer.step, "failed": True}
    trainer.save_model(Path(cfg.output_dir) / "final")
    return {"rank": trainer.rank, "steps": trainer.step}


@dataclasses.dataclass
class Prepared:
    """What run_training checked offline, before any process starts."""

    environment: tuple | None  # (class, rows) for an --environment run
    tasks: list
    model: object  # models/hub.py ModelRef
    reward_fn: object
    reward_funcs: object
    resume: str | None
    placement: object  # serving/placement.py Placement: decided here, once, and passed to all who need it
    weight_sync_backend: str  # the backend the run syncs with (the one asked for, else the placement's)
    teacher: object = None  # --teacher-model's ModelRef


def prepare(cfg: TrainRunConfig) -> Prepared:
    """Everything that can fail offline fails here: the agent, tasks, model, sandboxes, rewards, the checkpoint
    to resume and the GPU layout; ConfigError (or the part's own error) names what to change."""
    from harness_trainer._exceptions import PlacementError
    from harness_trainer.agents.registry import make_harness
    from harness_trainer.models.hub import model_or_default
    from harness_trainer.rollouts.rewards import resolve_rewards
    from harness_trainer.rollouts.services import run_placement
    from harness_trainer.rollouts.tasks import load_dataset
    from harness_trainer.sandboxes.registry import check_task_sandboxes
    from harness_trainer.serving.placement import resolve_weight_sync
    from harness_trainer.training.policy_sync import preflight

    environment = white_box(cfg)
    if environment is None:
        make_harness(cfg.harness, cfg.agent_command, cfg.agent_config).check_installed()
    tasks = environment[1] if environment else load_dataset(cfg.dataset, cfg.skip_invalid_tasks)
    model = model_or_default(cfg.model, cfg.model_revision)  # a Hub id is downloaded once, into the Hub cache
    if cfg.use_peft:  # the adapter's modules exist in this model (read from its config: no weights loaded)
        from harness_trainer.training.lora import check_lora_targets

        check_lora_targets(model.path, cfg.lora_target_modules)
    if environment is None:  # what is missing (credentials, daemon, URL), tasks refused, images built
        tasks = check_task_sandboxes(cfg.sandbox, tasks, Path(cfg.output_dir) / "builds", public_url=cfg.public_url,
                                     force_build=cfg.force_build, skip_invalid=cfg.skip_invalid_tasks)
        if not tasks:
            raise ConfigError(f"no task of {cfg.dataset} could be had (every environment failed; see above)")
    reward_fn, reward_funcs = resolve_rewards(cfg.reward, cfg.reward_funcs)
    out = Path(cfg.output_dir)
    resume = str(out / "latest") if cfg.resume_from_checkpoint == "latest" else cfg.resume_from_checkpoint
    if resume and resume != str(out / "latest") and not Path(resume, "trainer_state.json").exists():
        raise ConfigError(f"--resume-from-checkpoint {resume}: not a checkpoint folder (no trainer_state.json); "
                          "give OUTPUT_DIR/checkpoint-N or 'latest'")
    if not resume and (out / "metrics.jsonl").exists():
        raise ConfigError(f"{out} already holds a run (metrics.jsonl): pass --resume-from-checkpoint latest to "
                          "continue it, or choose a new --output-dir")
    try:  # a GPU layout that cannot work (serving/placement.py)
        placement = run_placement(cfg, cfg.trainer_gpus, training=True)
    except PlacementError as exc:
        raise ConfigError(str(exc)) from None
    backend = resolve_weight_sync(cfg.weight_sync_backend, cfg.use_peft, placement)  # once, passed on to all
    preflight(backend, int(os.environ.get("WORLD_SIZE", "1")))
    teacher = None
    if cfg.teacher_model:  # its tokenizer checked against the student's before any engine starts
        from harness_trainer.serving.teacher import check_same_tokenizer

        if placement.gpu:
            raise ConfigError("--teacher-model launches on the CPU only: on GPUs serve the teacher where it fits "
                              "(`harness-train serve --model TEACHER` on a GPU the placement leaves free) and pass "
                              "--teacher-url")
        teacher = model_or_default(cfg.teacher_model)
        check_same_tokenizer(str(model.path), str(teacher.path))
    return Prepared(environment, tasks, model, reward_fn, reward_funcs, resume, placement, backend, teacher)


@contextlib.contextmanager
def teacher_engine(cfg: TrainRunConfig, teacher, out: Path):
    """The teacher's URL for the run: --teacher-url, or an engine launched for --teacher-model (stopped on exit)."""
    if teacher is None:
        yield cfg.teacher_url
        return
    from harness_trainer.serving.engine import EngineConfig, VLLMServer

    with VLLMServer(EngineConfig(model=str(teacher.path), served_model_name=teacher.name,
                                 log_path=out / "teacher.log", max_model_len=cfg.max_model_len)) as engine:
        yield engine.url


def run_training(cfg: TrainRunConfig, callbacks: list | None = None) -> dict:
    """The whole run; returns the summary (also written to OUTPUT_DIR/summary.json)."""
    from harness_trainer.rollouts.services import run_services
    from harness_trainer.serving.engine import VLLMServer
    from harness_trainer.training.trainer import HarnessAsyncGRPOTrainer

    # 1. Everything that can fail offline fails here, before a process is started.
    ready = prepare(cfg)
    environment, model, resume, placement = ready.environment, ready.model, ready.resume, ready.placement
    out = Path(cfg.output_dir)
    if int(os.environ.get("RANK", "0")) != 0:  # rank 0 owns the engine, proxy and rollouts: this rank trains on
        return follow_training(cfg, ready)  # the groups it hands over (training/distributed.py)
    reporter = MetricsReporter(cfg.report_to, out.name, dataclasses.asdict(cfg))
    for url in cfg.vllm_url or []:
        check_attached_engine(VLLMServer.attach(url), cfg)  # answers, serves what a sync can reach
    if not cfg.vllm_url:
        check_port_free(cfg.engine_port, "--engine-port")
    check_port_free(cfg.proxy_port, "--proxy-port")

    out.mkdir(parents=True, exist_ok=True)
    print(f"harness-train: placement: {placement.describe()}", file=sys.stderr)
    (out / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    started = time.time()
    # 2. The servers: engine, then the capture proxy in front of it, supervised (rollouts/services.py).
    with run_services(cfg, out, model=model, environment=environment and environment[0],
                      rollouts_dir=out / "rollouts", supervise=True,
                      lora_rank=cfg.lora_rank if cfg.use_peft else 0, max_loras=cfg.max_staleness + 2,
                      placement=placement, weight_sync_backend=ready.weight_sync_backend) as services, \
            teacher_engine(cfg, ready.teacher, out) as teacher_url:
        # 3. The trainer, driving rollouts through the proxy and syncing into the same engine.
        args = dataclasses.replace(cfg, vllm_server_base_url=services.engine.url, resume_from_checkpoint=resume,
                                   teacher_url=teacher_url, teacher_model=None,
                                   weight_sync_backend=ready.weight_sync_backend)
        trainer = HarnessAsyncGRPOTrainer(str(model.path), services.session_factory, args, ready.tasks,
                                          rollout_reward_fn=ready.reward_fn, reward_funcs=ready.reward_funcs,
                                          callbacks=[*(callbacks or []), reporter], placement=placement)
        reporter.start()
        try:
            trainer.train()
        finally:
            reporter.finish()
        supervisor = services.supervisor
    # 4. What the run leaves behind.
    final = trainer.save_model(out / "final")
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    plot_reward_curve(history, out / "reward_curve.png")
    rewards = [h["reward_mean"] for h in history if h.get("reward_mean") is not None]
    summary = {"steps": len(history), "policy_version": trainer.version, "final_model": str(final),
               "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
               "trained_tokens": sum(h.get("trained_tokens", 0) for h in history),
               "dropped_stale_groups": sum(int(h.get("dropped_stale", 0)) for h in history),
               "warnings": [f"step {h['step']}: {w}" for h in history for w in h.get("warnings", [])],
               "best_model": str(out / "best") if (out / "best").exists() else None,
               "restarts": [f"{r.service} (exit {r.exit_code}), back in {r.seconds:.0f} s"
                            for r in supervisor.restarts],
               "placement": placement.describe(), "wall_time_s": round(time.time() - started, 1),
               "traces": str(out / "traces.jsonl"),
               "reward_curve": str(out / "reward_curve.png")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
