"""The harness-train command line: help, and clear errors for a bad model directory."""

from __future__ import annotations

import subprocess
import sys

from harness_trainer.cli import main


def test_help_lists_commands_with_defaults():
    result = subprocess.run([sys.executable, "-m", "harness_trainer.cli", "serve", "--help"],
                            capture_output=True, text=True, check=True)
    assert "--max-model-len" in result.stdout and "(default: 32768)" in result.stdout


def test_serve_with_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "harness-train model tiny" in err


def test_model_tiny_prints_the_build(tiny_model_dir, tmp_path, capsys):
    assert main(["model", "tiny", "--out", str(tmp_path / "m")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert (tmp_path / "m" / "config.json").exists()


def test_proxy_refuses_a_public_bind_without_admin_key():
    result = subprocess.run([sys.executable, "-m", "harness_trainer.cli", "proxy", "--upstream", "http://127.0.0.1:9",
                             "--host", "0.0.0.0"], capture_output=True, text=True,
                            env={k: v for k, v in __import__("os").environ.items() if k != "HARNESS_PROXY_ADMIN_KEY"})
    assert result.returncode == 2 and "without an admin key" in result.stderr


def test_eval_with_unknown_dataset_is_a_clear_error_before_anything_starts(capsys):
    assert main(["eval", "--dataset", "builtin:nope"]) == 1
    assert "no builtin dataset 'nope'" in capsys.readouterr().err
