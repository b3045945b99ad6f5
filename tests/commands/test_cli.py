"""The harness-train command line: help, and clear errors for a bad model directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness_trainer.commands.cli import main


def test_help_lists_commands_with_defaults():
    result = subprocess.run([sys.executable, "-m", "harness_trainer.commands.cli", "serve", "--help"],
                            capture_output=True, text=True, check=True)
    text = " ".join(result.stdout.split())
    assert "--max-model-len" in text and "(default: the model's own)" in text
    assert "(default: 8000)" in result.stdout and "--tool-call-parser" in result.stdout


def help_text(command: str) -> str:
    result = subprocess.run([sys.executable, "-m", "harness_trainer.commands.cli", command, "--help"],
                            capture_output=True, text=True, check=True)
    return "".join(result.stdout.split())  # argparse wraps at hyphens too: compared without white space


def test_every_choice_list_in_the_help_is_the_code_that_decides_it():
    """A setting's values are declared with its field, and the help names each: the harnesses from the registry
    (aider and terminus-2 were once left out of a list written by hand), the loss types, the backends."""
    from harness_trainer.agents.registry import HARNESSES
    from harness_trainer.serving.sync_steps import BACKENDS
    from harness_trainer.training.config import LOSS_TYPES

    assert "aider" in HARNESSES and "terminus-2" in HARNESSES
    for command in ("train", "eval"):
        text = help_text(command)
        assert [name for name in HARNESSES if name not in text] == [], command
    train = help_text("train")
    assert [name for name in (*LOSS_TYPES, *BACKENDS) if name not in train] == []


def test_serve_with_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "harness-train model tiny" in err


def test_model_tiny_prints_the_build(tiny_model_dir, tmp_path, capsys):
    assert main(["model", "tiny", "--output-dir", str(tmp_path / "m")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert (tmp_path / "m" / "config.json").exists()


def test_proxy_refuses_a_public_bind_without_admin_key():
    result = subprocess.run([sys.executable, "-m", "harness_trainer.commands.cli", "proxy", "--upstream", "http://127.0.0.1:9",
                             "--host", "0.0.0.0"], capture_output=True, text=True,
                            env={k: v for k, v in __import__("os").environ.items() if k != "HARNESS_PROXY_ADMIN_KEY"})
    assert result.returncode == 2 and "without an admin key" in result.stderr


def test_eval_with_unknown_dataset_is_a_clear_error_before_anything_starts(capsys):
    assert main(["eval", "--dataset", "builtin:nope"]) == 1
    assert "builtin dataset 'nope': choose toy" in capsys.readouterr().err


# ---- one CLI vocabulary (commands/flags.py) ------------------------------------------------------------------

def test_the_same_setting_has_the_same_flag_in_every_command():
    from harness_trainer.commands.cli import build_parser

    parser = build_parser()
    for command in ("train", "eval"):
        args = parser.parse_args([command, "--num-generations", "3", "--max_concurrent_rollouts", "2",
                                  "--max-completion-tokens", "64", "--agent-step-limit", "5", "--output-dir", "x"])
        assert (args.num_generations, args.max_concurrent_rollouts, args.max_completion_tokens,
                args.agent_step_limit, args.output_dir) == (3, 2, 64, 5, "x")
    for argv in (["train", "--use-peft"], ["train", "--use-peft", "true"], ["sft", "--traces", "t", "--use_peft"]):
        assert parser.parse_args(argv).use_peft is True
    assert parser.parse_args(["train", "--use-peft", "false"]).use_peft is False


def test_old_spellings_still_work_with_a_deprecation_line(capsys):
    from harness_trainer.commands.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["eval", "-n", "3", "--concurrency", "2", "--max-tokens", "64"])
    assert (args.num_generations, args.max_concurrent_rollouts, args.max_completion_tokens) == (3, 2, 64)
    assert parser.parse_args(["train", "--resume", "latest"]).resume_from_checkpoint == "latest"
    assert parser.parse_args(["sft", "--traces", "t", "--epochs", "2"]).num_train_epochs == 2.0
    assert parser.parse_args(["model", "tiny", "--out", "m"]).output_dir == "m"
    err = capsys.readouterr().err
    for old, new in (("-n", "--num-generations"), ("--concurrency", "--max-concurrent-rollouts"),
                     ("--max-tokens", "--max-completion-tokens"), ("--resume", "--resume-from-checkpoint"),
                     ("--epochs", "--num-train-epochs"), ("--out", "--output-dir")):
        assert f"{old} is deprecated and will be removed: use {new}" in err


def test_the_loss_settings_old_names_become_trls_with_one_line_each(tmp_path, capsys):
    """Flags, YAML keys and Python keywords alike: the value lands on TRL's name, the old field is cleared."""
    from harness_trainer.commands.cli import build_parser
    from harness_trainer.commands.train import train_config
    from harness_trainer.training.config import AsyncGRPOConfig

    cfg = train_config(build_parser().parse_args(["train", "--kl-beta", "0.05", "--clip-high", "0.28",
                                                  "--is-mode", "mis", "--is-bound", "4", "--scale-rewards", "true"]))
    assert (cfg.beta, cfg.epsilon_high, cfg.vllm_importance_sampling_mode) == (0.05, 0.28, "token_mask")
    assert (cfg.vllm_importance_sampling_clip_max, cfg.scale_rewards, cfg.kl_beta, cfg.is_mode) == (4.0, "group",
                                                                                                    None, None)
    (tmp_path / "run.yaml").write_text("clip_low: 0.1\nis_mode: none\nloss_mode: decoupled\n")
    cfg = train_config(build_parser().parse_args(["train", "--config", str(tmp_path / "run.yaml")]))
    assert (cfg.epsilon, cfg.vllm_importance_sampling_correction, cfg.loss_mode) == (0.1, False, None)
    ppo = AsyncGRPOConfig(loss_mode="ppo")
    assert ppo.loss_mode == "ppo"  # no TRL name: kept, read by the loss (the ratio to the sampler)
    err = capsys.readouterr().err
    for old, new in (("kl_beta", "use beta"), ("clip_high", "use epsilon_high"), ("is_bound", "use "
                     "vllm_importance_sampling_clip_max"), ("clip_low", "use epsilon"), ("is_mode", "use "
                     "--vllm-importance-sampling-mode"), ("loss_mode", "decoupled is the default"),
                     ("loss_mode", "ppo (the ratio to the sampler itself) has the same gradient")):
        assert f"{old} is deprecated and will be removed: {new}" in err
    assert "--kl-beta" not in build_parser().format_help() and "kl-beta" not in (
        Path(__file__).parents[2] / "docs" / "cli.md").read_text()  # hidden from help and the reference


def test_an_old_key_in_a_config_file_still_works(tmp_path, capsys):
    from harness_trainer.commands.cli import build_parser
    from harness_trainer.commands.train import train_config

    (tmp_path / "run.yaml").write_text("resume: latest\nservice-recovery-timeout: 30\nmax_steps: 3\n")
    cfg = train_config(build_parser().parse_args(["train", "--config", str(tmp_path / "run.yaml")]))
    assert (cfg.resume_from_checkpoint, cfg.service_recovery_timeout_s, cfg.max_steps) == ("latest", 30.0, 3)
    assert "resume is deprecated and will be removed: use resume_from_checkpoint" in capsys.readouterr().err


def test_a_mistyped_command_or_flag_gets_did_you_mean(capsys):
    assert main(["evl", "--dataset", "builtin:toy"]) == 2
    assert "unknown command 'evl': did you mean 'eval'?" in capsys.readouterr().err
    try:
        main(["eval", "--num-generatoins", "2", "--dataset", "builtin:nope"])
    except SystemExit as exc:
        assert exc.code == 2
    assert "did you mean --num-generations?" in capsys.readouterr().err


def test_version():
    result = subprocess.run([sys.executable, "-m", "harness_trainer", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("harness-train 0.")


def test_an_unknown_dataset_lists_what_exists(capsys):
    assert main(["eval", "--dataset", "no-such-folder"]) == 1
    err = capsys.readouterr().err
    assert "builtin:toy-train" in err and "builtin:logs" in err and "NAME@VERSION" not in err


def test_the_proofs_grpo_settings_are_typed_and_checked_before_any_stage(tmp_path, capsys):
    from harness_trainer.commands.proof import grpo_settings
    from harness_trainer.commands.proof import main as proof

    assert grpo_settings(["scale_rewards=group", "learning_rate=1e-4", "mask_truncated_completions=false"]) == \
        {"scale_rewards": "group", "learning_rate": 1e-4, "mask_truncated_completions": False}
    assert proof(["--grpo", "nope=1", "--output-dir", str(tmp_path / "p")]) == 1
    assert "--grpo nope: AsyncGRPOConfig has no such setting" in capsys.readouterr().err
    assert proof(["--grpo", "scale_rewards=bad", "--output-dir", str(tmp_path / "p")]) == 1
    assert "--scale-rewards 'bad': choose none, group or batch" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()  # refused before anything was written
