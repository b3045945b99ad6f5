"""The trainer's settings: one dataclass in the style of TRL's configs, each field's help in its metadata.

The CLI's run config (`commands/train.py: TrainRunConfig`) inherits this one and adds only what a run needs
besides the trainer (harness, dataset, model, sandbox, ports); every field here is also a `harness-train` flag
(`--max-step-kl`) and a `--config` YAML key (`max_step_kl`). docs/cli.md is generated from these fields.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from harness_trainer._exceptions import ConfigError
from harness_trainer.choices import choose
from harness_trainer.rollouts.config import check_choices, check_positive, option
from harness_trainer.serving.sync_steps import BACKENDS, VLLM_LORA_RANKS, lora_rank_served

# transformers.SchedulerType's values, written out: importing it imports torch and peft (5-10 s), and a job
# launcher checks a run's flags before it submits (tests/commands/test_train_command.py keeps the two lists equal)
LR_SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                "warmup_stable_decay", "greedy")
# the loss's choices (training/grpo.py), written here so checking a config needs no torch
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SCALE_REWARDS = ("none", "group", "batch")
IS_MODE_OF = {"tis": "token_truncate", "mis": "token_mask"}  # the deprecated is_mode's values
DTYPES = ("auto", "float32", "bfloat16", "float16")
POSITIVE = ("num_generations", "max_concurrent_rollouts", "max_steps", "weight_sync_steps", "save_steps",
            "groups_per_step", "lora_rank", "max_completion_length", "dynamic_sampling_max_tries")


@dataclass
class AsyncGRPOConfig:
    output_dir: str = option("runs/train", "where everything goes: checkpoints, final/, metrics, rollouts")
    vllm_server_base_url: str | None = option(None, "the engine the trainer syncs its weights into (the CLI sets "
                                                    "it to the engine it launched or attached)")
    # rollouts
    num_generations: int = option(4, "rollouts per task in a group")
    max_concurrent_rollouts: int = option(8, "rollouts running at once")
    max_staleness: int = option(2, "policy versions a rollout may lag the trainer")
    groups_per_step: int = option(1, "finished groups (tasks) per optimizer step, each with its own advantages")
    dynamic_sampling: bool = option(False, "DAPO's dynamic sampling: a group whose rewards are all equal (no "
                                           "gradient) or too stale is replaced by another until the step has "
                                           "groups_per_step groups that train")
    dynamic_sampling_max_tries: int = option(4, "dynamic sampling's cap: a step collects at most groups_per_step "
                                                "x this many groups, then trains on what it has and says so")
    temperature: float = option(1.0, "sampling temperature, also used in the loss")
    max_completion_tokens: int = option(256, "cap on tokens per model call")
    max_tool_calling_iterations: int | None = option(None, "white-box: tool rounds per episode (none: no bound)")
    max_completion_length: int = option(1024, "white-box: tokens after the prompt per episode, all turns together; "
                                              "dr_grpo's constant")
    shuffle_dataset: bool = option(True, "each pass over the dataset in its own seeded order")
    # optimisation
    max_steps: int = option(20, "optimizer steps")
    learning_rate: float = option(1e-5, "AdamW learning rate")
    max_grad_norm: float = option(1.0, "gradient norm clip")
    warmup_ratio: float = option(0.0, "share of --max-steps over which the learning rate rises from 0")
    lr_scheduler_type: str = option("constant", "learning-rate schedule, by transformers' names",
                                    choices=LR_SCHEDULES)
    seed: int = option(0, "seed for the trainer's RNGs")
    # the loss (training/grpo.py), under TRL GRPOConfig's names and meanings; a "sequence" is one rollout (every
    # trained token of all its turns), as TRL's multi-turn completion is one sequence with its tool outputs masked
    loss_type: str = option("dapo", "grpo (mean of each sequence's token mean), dr_grpo (sum / (sequences x "
                                    "max_completion_length)), dapo and bnpo (token mean over the step), cispo "
                                    "(clipped IS weight x logprob), sapo (soft gate), luspo (sequence-level, "
                                    "length-scaled)", choices=LOSS_TYPES)
    epsilon: float = option(0.2, "PPO clip range below 1")
    epsilon_high: float | None = option(None, "clip range above 1 (default: epsilon; DAPO uses 0.28; with cispo "
                                              "the IS weight's cap, e.g. 5.0)")
    delta: float | None = option(None, "two-sided clipping: the ratio is also capped at delta where the advantage "
                                       "is negative (INTELLECT-2; default none)")
    beta: float = option(0.0, "weight of a k3 KL term to the starting policy (0: none, no reference copy)")
    use_bias_correction_kl: bool = option(True, "multiply the KL term by the importance ratio (DeepSeek-V3.2)")
    importance_sampling_level: str = option("token", "token (a ratio per token) or sequence (GSPO: exp of the "
                                                     "mean log ratio over the rollout's trained tokens)",
                                                     choices=("token", "sequence"))
    # TRL's defaults (sequence_mask at 3.0, scale_rewards group), chosen over ours of before (token_truncate at
    # 2.0, none) by the demo's GRPO stage over 5 seeds: 28.0 held-out wins of 32 on average against 22.2, the
    # worst seed 24 against 11 (docs/results.md). A config that names a setting keeps it.
    vllm_importance_sampling_correction: bool = option(True, "weight each token by the policy at the step's start "
                                                             "over the one that sampled it")
    vllm_importance_sampling_mode: str = option("sequence_mask", "token_truncate, token_mask, sequence_truncate "
                                                                  "or sequence_mask (a sequence: the rollout)",
                                                                  choices=IS_MODES)
    vllm_importance_sampling_clip_min: float | None = option(None, "lower bound of the IS weight (default none)")
    vllm_importance_sampling_clip_max: float | None = option(3.0, "upper bound of the IS weight (none: unbounded)")
    off_policy_mask_threshold: float | None = option(None, "drop a rollout with a negative advantage whose mean "
                                                           "KL(sampler || policy) is past this (DeepSeek-V3.2; "
                                                           "e.g. 0.5)")
    scale_rewards: str = option("group", "group (r - mean, divided by the group's std: TRL's), none (r - mean: "
                                         "Dr. GRPO's, no difficulty bias) or batch (by the step's std)",
                                         choices=SCALE_REWARDS)
    mask_truncated_completions: bool = option(False, "leave out of the loss a rollout its step, token or time "
                                                     "limit stopped (it still counts in its group's mean)")
    top_entropy_quantile: float = option(1.0, "train only the step's top quantile of tokens by entropy (0.2 in "
                                              "'Beyond the 80/20 rule'; 1: all)")
    sapo_temperature_pos: float = option(1.0, "sapo: the gate's temperature where the advantage is positive")
    sapo_temperature_neg: float = option(1.05, "sapo: the gate's temperature elsewhere")
    # on-policy distillation (training/distill.py)
    teacher_url: str | None = option(None, "a vLLM engine serving the teacher (the model's tokenizer): it scores "
                                           "every trained token of every captured turn; the loss takes the "
                                           "reverse KL to it")
    distillation_weight: float = option(1.0, "with a teacher: the reverse-KL advantage's share, the group "
                                             "advantage's the rest (1: distillation alone, rewards only logged)")
    # deprecated spellings (harness-trainer's before TRL's names): they still work, with one line naming the new
    loss_mode: str | None = option(None, "", deprecated="vllm_importance_sampling_correction")
    clip_low: float | None = option(None, "", deprecated="epsilon")
    clip_high: float | None = option(None, "", deprecated="epsilon_high")
    is_mode: str | None = option(None, "", deprecated="vllm_importance_sampling_mode")
    is_bound: float | None = option(None, "", deprecated="vllm_importance_sampling_clip_max")
    kl_beta: float | None = option(None, "", deprecated="beta")
    # the trust region (training/trust_region.py)
    behaviour_clip: bool = option(True, "trust region to the behaviour policy: no gradient for a token whose ratio "
                                        "to the policy that sampled it is past the clip range")
    step_clip: float | None = option(0.2, "trust region: a step that moves a trained token's probability by more "
                                          "than this is shortened until it does not, or not taken (none: off)")
    step_clip_mode: str = option("probability", "what step_clip bounds: probability (|p_after - p_before|) or "
                                                "ratio (p_after / p_before within 1 +- step_clip, PPO's range)",
                                                choices=("probability", "ratio"))
    # off by default: on a sharp policy the per-token bound always bound first (both proofs), and from a flat one
    # (the random model: KL 0.2-0.3 a step while no token's probability moved 0.04) 0.01 cut every step to 1-10%
    # and nothing was learnt in 30 steps
    max_step_kl: float | None = option(None, "trust region: a step whose mean KL on its own batch is larger is "
                                             "shortened too, e.g. 0.01 (default none: off)")
    # memory and precision
    max_tokens_per_microbatch: int | None = option(16384, "tokens of the packed prefix tree per forward/backward: "
                                                          "bounds a step's memory (none: the whole tree at once)")
    dtype: str = option("auto", "weights' dtype in the trainer: auto (float32 weights; with --distributed fsdp on "
                                "GPU, bfloat16 compute over them), float32, bfloat16 or float16 (logprobs are "
                                "float32 either way)", choices=DTYPES)
    gradient_checkpointing: bool | None = option(None, "recompute each layer in the backward: less memory, more "
                                                       "time (default: on with --distributed fsdp on GPU)")
    # devices (serving/placement.py, training/sharding.py)
    trainer_gpus: str | None = option(None, "GPU indices the trainer's ranks take, e.g. 1,2,3 (default: the ones "
                                            "the engine does not; with one GPU, shared with the engine)")
    distributed: str = option("ddp", "with several trainer ranks: ddp (every rank holds the whole model) or fsdp "
                                     "(FSDP2: weights, gradients and optimizer state sharded; bf16 mixed precision "
                                     "on GPU)", choices=("ddp", "fsdp"))
    # LoRA (training/lora.py)
    use_peft: bool = option(False, "train a LoRA adapter, synced into vLLM by name (policy-vN), not every weight")
    lora_rank: int = option(16, "LoRA rank r")
    lora_alpha: int = option(32, "LoRA alpha (the update is scaled by alpha / r)")
    lora_dropout: float = option(0.0, "LoRA dropout (0: the trainer's logprobs match the engine's)")
    lora_target_modules: list[str] | None = option(None, "comma-separated module names (default: the attention "
                                                         "and MLP projections)")
    # the weight sync (serving/weight_sync.py, training/policy_sync.py)
    weight_sync_steps: int = option(1, "steps between weight syncs into vLLM")
    weight_sync_backend: str | None = option(None, "reload (any vLLM, CPU included), lora, nccl (GPU to "
                                                   "GPU) or ipc (one GPU shared); default: lora with --use-peft, "
                                                   "else the placement's (serving/placement.py)", choices=BACKENDS)
    weight_sync_timeout_s: float = option(120.0, "seconds each weight-sync request may take")
    probe_tolerance: float | None = option(None, "largest logprob gap vLLM vs trainer after a sync (default: 1e-3 "
                                                 "in float32, 5e-2 in 16-bit)")
    service_recovery_timeout_s: float = option(300.0, "seconds a step waits for a stopped engine or proxy "
                                                      "(restarted by the run) before the run stops, its last step "
                                                      "saved")
    # outputs
    logging_steps: int = option(1, "steps between log lines")
    save_steps: int = option(5, "steps between checkpoints")
    save_total_limit: int = option(2, "checkpoints kept")
    save_best: bool = option(False, "keep best/ beside final/: the model after the step with the best training "
                                    "reward (mean over --best-window steps)")
    best_window: int = option(4, "steps averaged for --save-best (one group's reward is too noisy to rank by)")
    resume_from_checkpoint: str | None = option(None, 'a checkpoint folder, or "latest" (the newest in '
                                                      '--output-dir)')

    def __post_init__(self):
        self._prepare()
        self.check()

    def _prepare(self) -> None:
        """Values in their field's form, deprecated names moved to TRL's (checked after, by check())."""
        if hasattr(super(), "_prepare"):  # a run's config inherits the rollout settings' too
            super()._prepare()
        self._undeprecate()
        if isinstance(self.scale_rewards, bool) or str(self.scale_rewards).lower() in ("true", "false"):
            self.scale_rewards = "group" if str(self.scale_rewards).lower() == "true" else "none"  # TRL's bools
        if isinstance(self.lora_target_modules, str):  # a flag or YAML value "q_proj,v_proj"
            self.lora_target_modules = [m.strip() for m in self.lora_target_modules.split(",") if m.strip()]

    def _undeprecate(self) -> None:
        """Old spellings -> TRL's names, one line each; then the old field is cleared (only loss_mode ppo stays: it
        has no TRL name, LossConfig reads it)."""
        for f in dataclasses.fields(self):
            new, value = f.metadata.get("deprecated"), getattr(self, f.name)
            if not new or value is None:
                continue
            hint = f"use {new}"
            if f.name == "loss_mode":
                choose("--loss-mode", value, ("decoupled", "ppo"), hint=" (deprecated: see --loss-type)")
                hint = ("decoupled is the default (the IS weight to the sampler, vllm_importance_sampling_correction)"
                        if value == "decoupled" else "ppo (the ratio to the sampler itself) has the same gradient as "
                        "the default with --vllm-importance-sampling-clip-max none")
                self.loss_mode = None if value == "decoupled" else value
            elif f.name == "is_mode":
                choose("--is-mode", value, ("tis", "mis", "none"), hint=" (deprecated: see "
                       "--vllm-importance-sampling-mode)")
                self.vllm_importance_sampling_correction = value != "none"
                self.vllm_importance_sampling_mode = IS_MODE_OF.get(value, self.vllm_importance_sampling_mode)
                if value in IS_MODE_OF:  # with the bound it meant then (is_bound, later, overrides it)
                    self.vllm_importance_sampling_clip_max = 2.0
                hint = "use --vllm-importance-sampling-mode token_truncate|token_mask (none: " \
                       "--vllm-importance-sampling-correction false)"
                self.is_mode = None
            else:
                setattr(self, new, value)
                setattr(self, f.name, None)
            print(f"harness-train: {f.name} is deprecated and will be removed: {hint}", file=sys.stderr)

    def check(self) -> None:
        """Every check of these settings, here, so the Python API and the CLI refuse the same values with the
        same words (a ConfigError naming the flag, whose field is its name in snake case)."""
        self._check_values()
        self._check_together()
        if hasattr(super(), "check"):  # a run's config: the rollout settings' rules too
            super().check()

    def _check_values(self) -> None:
        """Each setting on its own."""
        check_positive(self, POSITIVE)
        check_choices(self)
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio!r}")
        if not 0 <= self.top_entropy_quantile <= 1:
            raise ConfigError(f"--top-entropy-quantile must be in [0, 1], got {self.top_entropy_quantile!r}")
        if not 0 <= self.distillation_weight <= 1:
            raise ConfigError(f"--distillation-weight must be in [0, 1], got {self.distillation_weight!r}")
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise ConfigError(f"--max-tokens-per-microbatch must be a positive integer or none, "
                              f"got {self.max_tokens_per_microbatch!r}")

    def _check_together(self) -> None:
        """Settings that only make sense beside others."""
        if self.lr_scheduler_type == "constant" and self.warmup_ratio:
            raise ConfigError("--warmup-ratio needs a schedule with a warm-up: add --lr-scheduler-type "
                              "constant_with_warmup (or linear, cosine)")
        if self.dynamic_sampling and self.teacher_url and self.distillation_weight == 1:
            raise ConfigError("--dynamic-sampling drops groups whose rewards are equal, but with --distillation-weight "
                              "1 rewards are not trained on: every group has the teacher's signal")
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            raise ConfigError("--loss-type luspo scales sequence-level ratios: add --importance-sampling-level "
                              "sequence")
        if self.use_peft and self.distributed == "fsdp":
            raise ConfigError("--use-peft with --distributed fsdp is not supported: an adapter is small, train it "
                              "with --distributed ddp")
        if self.weight_sync_backend is not None and (self.weight_sync_backend == "lora") != self.use_peft:
            raise ConfigError(f"--weight-sync-backend {self.weight_sync_backend} with --use-peft "
                              f"{str(self.use_peft).lower()}: --weight-sync-backend lora and --use-peft go together "
                              "(an adapter is synced by name, full weights by reload, nccl or ipc)")
        if self.use_peft and not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout!r}")
        if self.use_peft and lora_rank_served(self.lora_rank) is None:
            raise ConfigError(f"--lora-rank {self.lora_rank} is larger than the largest rank vLLM serves "
                              f"({VLLM_LORA_RANKS[-1]}): choose {VLLM_LORA_RANKS[-1]} or less")


def same_as(name: str, default=dataclasses.MISSING):
    """For another command's config: the trainer's setting of that name, its help, and its default unless given."""
    trainer = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig)}[name]
    return option(trainer.default if default is dataclasses.MISSING else default, trainer.metadata["help"],
                  **{k: v for k, v in trainer.metadata.items() if k == "choices"})


def choices_of(names) -> dict[str, tuple]:
    """The trainer's settings among `names` with a fixed set of values, and those values (grpo.LossConfig checks
    its own with them)."""
    return {f.name: f.metadata["choices"] for f in dataclasses.fields(AsyncGRPOConfig)
            if f.name in names and "choices" in f.metadata}
