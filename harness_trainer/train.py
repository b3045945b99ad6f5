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
import socket
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import yaml


def _opt(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass
class TrainRunConfig:
    """Every field is a `harness-train` flag (`--num-generations`) and a --config YAML key (`num_generations`),
    in the style of TRL's config dataclasses (the help text lives in the field's metadata)."""
    harness: str = _opt("mini-swe-agent", "mini-swe-agent, opencode, claude-code, codex or command")
    dataset: str = _opt("builtin:toy-train", "folder of Harbor tasks, builtin:NAME or hf:OWNER/NAME; with "
                                             "--environment, a .jsonl (or .json) of rows with a 'prompt' column")
    environment: str | None = _opt(None, "white-box instead of an agent: module:Class, TRL's environment_factory "
                                         "(reset(**row) and tool methods), run by the built-in loop")
    reward_funcs: str | None = _opt(None, "comma-separated module:function reward functions f(environments, "
                                          "**kwargs) -> list, summed (None skipped), each logged as its own metric")
    max_tool_calling_iterations: int | None = _opt(None, "white-box: tool rounds per episode (none: no bound)")
    max_completion_length: int = _opt(1024, "white-box: tokens after the prompt per episode, all turns together")
    model: str | None = _opt(None, "model folder (default: the embedded tiny model)")
    sandbox: str = _opt("local", "local, e2b, docker or harbor[:ENV]")
    vllm_url: str | None = _opt(None, "attach to a running vLLM instead of launching one for --model")
    engine_port: int = _opt(0, "port for the launched engine (0: a free one)")
    proxy_port: int = _opt(0, "port for the capture proxy (0: a free one)")
    public_url: str | None = _opt(None, "URL at which remote sandboxes (e2b) reach the proxy; the proxy then "
                                        "listens on all interfaces")
    num_generations: int = _opt(4, "rollouts per task in a group")
    max_concurrent_rollouts: int = _opt(8, "rollouts running at once")
    max_steps: int = _opt(20, "optimizer steps")
    learning_rate: float = _opt(1e-5, "AdamW learning rate")
    temperature: float = _opt(1.0, "sampling temperature, also used in the loss")
    max_staleness: int = _opt(2, "policy versions a rollout may lag the trainer")
    groups_per_step: int = _opt(1, "finished groups (tasks) per optimizer step, each with its own advantages")
    warmup_ratio: float = _opt(0.0, "share of --max-steps over which the learning rate rises from 0")
    lr_scheduler_type: str = _opt("constant", "learning-rate schedule: constant, constant_with_warmup, linear, "
                                              "cosine, ... (transformers' names)")
    step_clip: float | None = _opt(0.2, "trust region: a step that moves a trained token's probability by more "
                                        "than a factor 1 +- this is halved until it does not (none: off)")
    max_step_kl: float | None = _opt(0.01, "trust region: a step whose mean KL on its own batch is larger is "
                                           "halved too (none: off)")
    behaviour_clip: bool = _opt(True, "trust region to the behaviour policy: no gradient for a token whose ratio "
                                      "to the policy that sampled it is past the clip range")
    max_tokens_per_microbatch: int | None = _opt(16384, "tokens of the packed prefix tree per forward/backward: "
                                                        "bounds a step's memory (none: the whole tree at once)")
    dtype: str = _opt("float32", "weights' dtype in the trainer: float32, or bfloat16 / float16 on GPU "
                                 "(logprobs are float32 either way)")
    gradient_checkpointing: bool = _opt(False, "recompute each layer in the backward: less memory, more time")
    use_peft: bool = _opt(False, "train a LoRA adapter, synced into vLLM by name (policy-vN), not every weight")
    lora_rank: int = _opt(16, "LoRA rank r")
    lora_alpha: int = _opt(32, "LoRA alpha (the update is scaled by alpha / r)")
    lora_dropout: float = _opt(0.0, "LoRA dropout (0: the trainer's logprobs match the engine's)")
    lora_target_modules: str | None = _opt(None, "comma-separated module names (default: the attention and MLP "
                                                 "projections)")
    save_best: bool = _opt(False, "keep best/ beside final/: the model after the step with the best training "
                                  "reward (mean over 4 steps)")
    max_completion_tokens: int = _opt(256, "cap on tokens per model call")
    agent_timeout: float | None = _opt(None, "seconds per rollout (default: the task's)")
    agent_step_limit: int = _opt(6, "agent steps per rollout")
    agent_command: str | None = _opt(None, "for --harness command: a template with {instruction}")
    agent_config: str | None = _opt(None, "mini-swe-agent: YAML layered over its default config, or 'compact'")
    reward: str | None = _opt(None, "per-rollout reward: verifier (the default without --reward-funcs), "
                                    "verifier+tools, module:function or an entry-point name")
    reward_key: str = _opt("reward", "key of the verifier's reward.json")
    weight_sync_steps: int = _opt(1, "steps between weight syncs into vLLM")
    service_recovery_timeout: float = _opt(300.0, "seconds a step waits for a stopped engine or proxy (restarted "
                                                  "by the run) before the run stops, its last step saved")
    save_steps: int = _opt(5, "steps between checkpoints")
    output_dir: str = _opt("runs/train", "where everything goes")
    resume: str | None = _opt(None, 'a checkpoint folder, or "latest" (the newest in --output-dir)')
    report_to: str = _opt("trackio", "trackio (local), wandb or none")
    seed: int = _opt(0, "seed for the trainer's RNGs")


class ConfigError(ValueError):
    """A config file or flag value is wrong; the message names it and says what to do."""


FIELDS = {f.name: f for f in dataclasses.fields(TrainRunConfig)}


def parse_bool(text) -> bool:
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def parse_optional_float(text) -> float | None:
    return None if text is None or str(text).strip().lower() in ("none", "off") else float(text)


def parse_optional_int(text) -> int | None:
    return None if text is None or str(text).strip().lower() in ("none", "off") else int(text)


# field type (a string here) -> converter, for flags and config-file values
NUMBER_TYPES = {"int": int, "float": float, "float | None": parse_optional_float, "int | None": parse_optional_int,
                "bool": parse_bool}


def load_config_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path} must be a mapping of option names to values, e.g. `max_steps: 10`")
    normalised = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(normalised) - set(FIELDS))
    if unknown:
        raise ConfigError(f"--config {path}: unknown option(s) {', '.join(unknown)}; the keys are the flag names: "
                          f"{', '.join(sorted(FIELDS))}")
    for name, value in normalised.items():  # YAML 1.1 reads 1e-3 as a string: coerce numbers by the field's type
        kind = NUMBER_TYPES.get(str(FIELDS[name].type))
        if kind and value is not None and not isinstance(value, bool):
            try:
                normalised[name] = kind(value)
            except (TypeError, ValueError):
                raise ConfigError(f"--config {path}: {name} must be a {FIELDS[name].type}, got {value!r}") from None
    return normalised


def resolve_config(file_values: dict, flag_values: dict) -> TrainRunConfig:
    """Defaults < config file < flags given on the command line."""
    cfg = TrainRunConfig(**(file_values | flag_values))
    if cfg.report_to not in ("trackio", "wandb", "none"):
        raise ConfigError(f"--report-to {cfg.report_to}: choose trackio, wandb or none")
    if not 0 <= cfg.warmup_ratio < 1:
        raise ConfigError(f"--warmup-ratio must be in [0, 1), got {cfg.warmup_ratio!r}")
    from transformers import SchedulerType

    schedules = [t.value for t in SchedulerType]
    if cfg.lr_scheduler_type not in schedules:
        raise ConfigError(f"--lr-scheduler-type {cfg.lr_scheduler_type}: choose one of {', '.join(schedules)}")
    if cfg.lr_scheduler_type == "constant" and cfg.warmup_ratio:
        raise ConfigError("--warmup-ratio needs a schedule with a warm-up: add --lr-scheduler-type "
                          "constant_with_warmup (or linear, cosine)")
    if cfg.dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype {cfg.dtype}: choose float32, bfloat16 or float16")
    if cfg.max_tokens_per_microbatch is not None and cfg.max_tokens_per_microbatch < 1:
        raise ConfigError(f"--max-tokens-per-microbatch must be a positive integer or none, "
                          f"got {cfg.max_tokens_per_microbatch!r}")
    if cfg.use_peft and not 0 <= cfg.lora_dropout < 1:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout!r}")
    if cfg.environment and not (cfg.reward_funcs or cfg.reward):
        raise ConfigError("--environment needs --reward-funcs module:f[,module:g]: functions f(environments, "
                          "**kwargs) returning one reward (or None) per environment")
    for name in ("num_generations", "max_concurrent_rollouts", "max_steps", "weight_sync_steps", "save_steps",
                 "groups_per_step", "lora_rank", "max_completion_length"):
        if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(cfg, name)!r}")
    return cfg


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


def resolve_model(name: str) -> Path:
    """A local model folder, or a Hub repo id (OWNER/NAME) downloaded into the Hub cache."""
    from harness_trainer.engine import check_model_dir

    path = Path(name).expanduser()
    if path.exists() or name.startswith(("/", ".", "~")) or name.count("/") != 1:
        return check_model_dir(path)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name))
    except Exception as exc:  # offline, gated, missing: all the same to the user
        raise ConfigError(f"--model {name}: not a folder here, and the Hub repo could not be fetched ({exc}). "
                          "Give a local model folder, or check the repo id, HF_TOKEN and network") from None


def white_box(cfg) -> tuple | None:
    """For --environment: the class (checked: it builds, has reset, its tools' schemas build) and the rows."""
    if not cfg.environment:
        return None
    from harness_trainer.environments import EnvironmentContractError, check_environment, load_object, load_rows

    try:
        environment = load_object(cfg.environment, "--environment")
        check_environment(environment)
        return environment, load_rows(cfg.dataset)
    except EnvironmentContractError as exc:
        raise ConfigError(str(exc)) from None


def run_training(cfg: TrainRunConfig, callbacks: list | None = None) -> dict:
    """The whole run; returns the summary (also written to OUTPUT_DIR/summary.json)."""
    from harness_trainer.adapters.harnesses import make_harness
    from harness_trainer.adapters.sandbox import make_sandbox
    from harness_trainer.adapters.session import LocalSessionFactory
    from harness_trainer.adapters.tasks import load_dataset
    from harness_trainer.engine import EngineConfig, VLLMServer
    from harness_trainer.proxy.client import ProxyServer
    from harness_trainer.environments import EnvironmentSessionFactory
    from harness_trainer.rewards import resolve_reward_fn, resolve_reward_funcs
    from harness_trainer.supervise import Supervisor
    from harness_trainer.tiny_model import ensure_tiny_model
    from harness_trainer.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

    # 1. Everything that can fail offline fails here, before a process is started.
    environment = white_box(cfg)  # (class, rows) for an --environment run, else None
    if environment is None:
        make_harness(cfg.harness, cfg.agent_command, cfg.agent_config).check_installed()
    tasks = environment[1] if environment else load_dataset(cfg.dataset)
    model_dir = resolve_model(cfg.model) if cfg.model else ensure_tiny_model()
    if cfg.sandbox != "local" and environment is None:  # raises with what is missing (credentials, daemon, URL)
        make_sandbox(cfg.sandbox, Path("/nonexistent"), public_url=cfg.public_url)
    reward_fn = resolve_reward_fn(cfg.reward) if cfg.reward or not cfg.reward_funcs else None
    reward_funcs = resolve_reward_funcs(cfg.reward_funcs)
    out = Path(cfg.output_dir)
    resume = str(out / "latest") if cfg.resume == "latest" else cfg.resume
    if resume and resume != str(out / "latest") and not Path(resume, "trainer_state.json").exists():
        raise ConfigError(f"--resume {resume}: not a checkpoint folder (no trainer_state.json); give "
                          "OUTPUT_DIR/checkpoint-N or 'latest'")
    if not resume and (out / "metrics.jsonl").exists():
        raise ConfigError(f"{out} already holds a run (metrics.jsonl): pass --resume latest to continue it, or "
                          "choose a new --output-dir")
    reporter = MetricsReporter(cfg.report_to, out.name, dataclasses.asdict(cfg))
    attached = VLLMServer.attach(cfg.vllm_url) if cfg.vllm_url else None
    if not attached:
        check_port_free(cfg.engine_port, "--engine-port")
    check_port_free(cfg.proxy_port, "--proxy-port")

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    started = time.time()
    with contextlib.ExitStack() as stack:
        # 2. The servers: engine, then the capture proxy in front of it.
        if attached:
            engine = attached
        else:
            engine = stack.enter_context(VLLMServer(EngineConfig(
                model=str(model_dir), port=cfg.engine_port, log_path=out / "vllm.log",
                lora_rank=cfg.lora_rank if cfg.use_peft else 0, max_loras=cfg.max_staleness + 2)))
        host = "0.0.0.0" if cfg.public_url else "127.0.0.1"  # remote sandboxes reach it from outside
        proxy = stack.enter_context(ProxyServer(engine.url, model=engine.model_name, port=cfg.proxy_port, host=host,
                                                journal=out / "journal", log_path=out / "proxy.log"))
        # A server of ours that dies (killed, crashed) is started again on its port; the trainer waits for it and
        # puts back what it lost (supervise.py).
        watched = {"the capture proxy": (proxy.managed, proxy.startup_timeout_s)}
        if not attached:
            watched["vLLM"] = (engine.managed, engine.cfg.startup_timeout_s)
        supervisor = stack.enter_context(Supervisor(watched))
        # 3. The trainer, driving rollouts through the proxy and syncing into the same engine.
        if environment:
            factory = partial(EnvironmentSessionFactory, proxy=proxy.client, environment_factory=environment[0],
                              max_tool_calling_iterations=cfg.max_tool_calling_iterations,
                              max_completion_length=cfg.max_completion_length, agent_timeout_s=cfg.agent_timeout)
        else:
            factory = partial(LocalSessionFactory, proxy=proxy.client, harness=cfg.harness, sandbox=cfg.sandbox,
                              output_dir=out / "rollouts", step_limit=cfg.agent_step_limit,
                              agent_timeout_s=cfg.agent_timeout, reward_key=cfg.reward_key,
                              agent_command=cfg.agent_command, agent_config=cfg.agent_config,
                              public_url=cfg.public_url)
        args = AsyncGRPOConfig(
            output_dir=str(out), vllm_server_base_url=engine.url, num_generations=cfg.num_generations,
            max_concurrent_rollouts=cfg.max_concurrent_rollouts, max_staleness=cfg.max_staleness,
            max_steps=cfg.max_steps, learning_rate=cfg.learning_rate, temperature=cfg.temperature,
            max_completion_tokens=cfg.max_completion_tokens, weight_sync_steps=cfg.weight_sync_steps,
            service_recovery_timeout_s=cfg.service_recovery_timeout,
            save_steps=cfg.save_steps, seed=cfg.seed, resume_from_checkpoint=resume,
            groups_per_step=cfg.groups_per_step, warmup_ratio=cfg.warmup_ratio,
            lr_scheduler_type=cfg.lr_scheduler_type, behaviour_clip=cfg.behaviour_clip, save_best=cfg.save_best,
            step_clip=cfg.step_clip, max_step_kl=cfg.max_step_kl,
            max_tokens_per_microbatch=cfg.max_tokens_per_microbatch, torch_dtype=cfg.dtype,
            gradient_checkpointing=cfg.gradient_checkpointing, use_peft=cfg.use_peft, lora_rank=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
            lora_target_modules=cfg.lora_target_modules.split(",") if cfg.lora_target_modules else None)
        trainer = HarnessAsyncGRPOTrainer(str(model_dir), factory, args, tasks, rollout_reward_fn=reward_fn,
                                          callbacks=[*(callbacks or []), reporter], reward_funcs=reward_funcs)
        reporter.start()
        try:
            trainer.train()
        finally:
            reporter.finish()
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
               "wall_time_s": round(time.time() - started, 1), "traces": str(out / "traces.jsonl"),
               "reward_curve": str(out / "reward_curve.png")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
