"""The settings every command that runs rollouts shares, under one name each: the train and eval configs
inherit RolloutConfig, so `--agent-step-limit` means the same in both. Light on purpose (no engine, proxy or
torch import): the CLI builds its flags from it before any work starts."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from harness_trainer._exceptions import ConfigError
from harness_trainer.agents.registry import HARNESSES
from harness_trainer.choices import choose, flag


def option(default, help_text: str, **metadata):
    """A config field whose help text is its flag's help (and its line in docs/cli.md). `choices=`: its values,
    when they are a fixed set (check_choices refuses the others; the help names them all)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help_text, **metadata})
    return field(default=default, metadata={"help": help_text, **metadata})


@dataclass
class RolloutConfig:
    harness: str = option("mini-swe-agent", "the agent program run against the capture proxy",
                          choices=tuple(HARNESSES))
    dataset: str = option("builtin:toy-train", "folder of Harbor tasks, builtin:NAME or hf:OWNER/NAME; with "
                                               "--environment, a .jsonl (or .json) of rows with a 'prompt' column")
    environment: str | None = option(None, "white-box instead of an agent: module:Class, TRL's "
                                           "environment_factory (reset(**row) and tool methods), run by the "
                                           "built-in loop")
    reward_funcs: str | None = option(None, "comma-separated module:function reward functions f(environments, "
                                            "**kwargs) -> list, summed (None skipped), each logged as its own "
                                            "metric")
    model: str | None = option(None, "model folder or Hub id OWNER/NAME (default: the embedded tiny model)")
    model_revision: str | None = option(None, "for a Hub id: the branch, tag or commit to use (default: main)")
    tool_call_parser: str | None = option(None, "vLLM's tool-call parser (default: read from the model's chat "
                                                "template, models/formats.py)")
    reasoning_parser: str | None = option(None, "vLLM's reasoning parser, or none (default: read from the model)")
    max_model_len: int | None = option(None, "context length the engine serves (default: the model's own)")
    vllm_url: list[str] | None = option(None, "attach to a running vLLM instead of launching one for --model; "
                                              "repeat for several engines behind one proxy (each rollout pinned "
                                              "to one, every sync to all)", repeat=True)
    engines: int = option(1, "engines to launch (not with --vllm-url): the engine GPUs split among them, else "
                             "side by side on the CPU; each rollout pinned to one, every sync to all")
    engine_gpus: str | None = option(None, "GPU indices the engine(s) take, e.g. 0,1: tensor parallel over them, "
                                           "split among --engines (default: the first half; one GPU: shared with "
                                           "the trainer)")
    engine_memory_share: float = option(0.45, "with one GPU for engine and trainer: the engine's share of its "
                                              "memory (vLLM's --gpu-memory-utilization)")
    engine_port: int = option(0, "port for the launched engine, the next ones on the following ports (0: free "
                                 "ones)")
    proxy_port: int = option(0, "port for the capture proxy (0: a free one)")
    sandbox: str = option("auto", "auto (a task with an image in a container, any other in bubblewrap), local "
                                   "(bubblewrap: tasks that need an image are refused), docker, e2b, harbor[:ENV], "
                                   "or module:Class (a Sandbox of your own, made from a Trial)")
    public_url: str | None = option(None, "URL at which remote sandboxes (e2b) reach the proxy; the proxy then "
                                          "listens on all interfaces")
    agent_step_limit: int = option(6, "agent steps per rollout")
    agent_timeout: float | None = option(None, "seconds per rollout (default: the task's)")
    agent_command: str | None = option(None, "for --harness command: a template with {instruction}")
    agent_config: str | None = option(None, "the agent's own set-up: full (its default), compact "
                                             "(mini-swe-agent, opencode: a short prompt), bare (claude-code), or "
                                             "a file: mini-swe-agent YAML or opencode.json, merged in")
    reward_key: str = option("reward", "key of the verifier's reward.json to train on (its only key when it has "
                                       "one; every key is kept in rollouts.jsonl)")
    skip_invalid_tasks: bool = option(False, "run a dataset's readable tasks whose environment could be had, and "
                                             "warn about the others (default: refuse it, listing every problem)")
    force_build: bool = option(False, "build a task's environment/Dockerfile even where it names a docker_image "
                                      "(by default the docker_image is used, as Harbor does)")

    def __post_init__(self):
        self._prepare()
        self.check()

    def _prepare(self) -> None:
        """Values as the flags and YAML give them, in their field's form (checked after, by check())."""
        if isinstance(self.vllm_url, str):  # one URL (the Python API, a YAML value), or "URL,URL"
            self.vllm_url = [u.strip() for u in self.vllm_url.split(",") if u.strip()]

    def scores_episodes(self) -> bool:
        """A white-box run has reward functions to score its episodes (a run's config adds --reward)."""
        return bool(self.reward_funcs)

    def check(self) -> None:
        """Every rule of these settings, once: the CLI and the Python API refuse the same values in the same
        words (a ConfigError naming the flag)."""
        check_choices(self)
        check_white_box(bool(self.environment), self.scores_episodes())
        if self.engines < 1:
            raise ConfigError(f"--engines {self.engines}: give 1 or more")
        if self.engines > 1 and self.vllm_url:
            raise ConfigError("--engines launches engines and --vllm-url attaches to running ones: give one of them "
                              "(repeat --vllm-url for several running engines)")


def check_choices(config) -> None:
    """Every field of `config` declared with `choices=` holds one of them (None: a default decided later)."""
    for f in fields(config):
        value = getattr(config, f.name)
        if "choices" in f.metadata and value is not None:
            choose(flag(f.name), value, f.metadata["choices"])


def check_positive(config, names: tuple[str, ...]) -> None:
    """Each of `names` is a positive integer."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{flag(name)} must be a positive integer, got {value!r}")


def check_white_box(environment: bool, scored: bool, what: str = "--environment",
                    how: str = "--reward-funcs module:f[,module:g]") -> None:
    """A white-box environment has no verifier: its episodes are scored by reward functions, or not at all. The
    one rule behind the run's and eval's configs and the trainer's own arguments (environment_factory)."""
    if environment and not scored:
        raise ConfigError(f"{what} needs {how}: functions f(environments, **kwargs) returning one reward (or None) "
                          "per environment")
