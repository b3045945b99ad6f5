"""Each tiny architecture, tied and untied, through the whole path with the real vLLM: capture (eval of a white-box
environment through the proxy), SFT on those traces, then two GRPO steps from the SFT model whose every weight
sync is probed (vLLM's logprobs = the trainer's), by reload (every weight) and, for a tied model, by LoRA too.
The qwen3 runs name the model by a Hub id served by the local stand-in.
Slow (an engine start per run, ~3 min per architecture): make test-slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness_trainer.models.tiny import TinyModelSpec, ensure_tiny_model
from tests.hub_standin import HubStandIn

HARNESS_TRAIN = [sys.executable, "-m", "harness_trainer.commands.cli"]
ECHO = ["--environment", "harness_trainer.examples.echo:EchoEnv", "--dataset", "harness_trainer/examples/echo.jsonl"]
# A reward that differs between the answers of a group whatever they are (a random model never calls echo's tool,
# and a reasoning model's answers may all be empty), so GRPO has advantages to follow and every sync moves the
# weights the probe then checks. Not a task's reward: only something to train on.
SPREAD = "def reward_func(completions, **kwargs):\n    return [float(i % 2) for i in range(len(completions))]\n"


def run(args, env, timeout=900):
    result = subprocess.run(HARNESS_TRAIN + args, capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("arch, tied, sync", [("qwen2", True, "reload"), ("qwen3", True, "reload"),
                                              ("llama", False, "reload"), ("llama", True, "reload"),
                                              ("qwen3", True, "lora")], ids=lambda v: str(v))
def test_capture_sft_and_grpo_with_the_probe_after_every_sync(tmp_path, arch, tied, sync):
    model = ensure_tiny_model(TinyModelSpec(arch=arch, tie_embeddings=tied))
    (tmp_path / "spread.py").write_text(SPREAD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1"}
    rewards = ["--reward-funcs", "spread:reward_func"]
    with HubStandIn() as hub:
        hub.add(f"harness/tiny-{arch}", model)
        env["HF_ENDPOINT"] = hub.url
        name = f"harness/tiny-{arch}" if arch == "qwen3" else str(model)  # one goes through the Hub
        run(["eval", *ECHO, *rewards, "--model", name, "--num-generations", "2", "--limit", "2",
             "--max-completion-tokens", "16", "--output-dir", str(tmp_path / "eval")], env)
        turns = [t for line in (tmp_path / "eval" / "traces.jsonl").read_text().splitlines()
                 for t in json.loads(line)["turns"]]
        assert turns and all(sum(t["loss_mask"]) == len(t["completion_token_ids"]) for t in turns)
        if arch == "qwen3":  # every sampled reasoning token is in the trace, trained on
            assert all(t["response"]["choices"][0]["message"].get("reasoning") for t in turns)
        run(["sft", "--traces", str(tmp_path / "eval"), "--model", name, "--num-train-epochs", "1",
             "--output-dir", str(tmp_path / "sft")], env)
    final = tmp_path / "sft" / "final"
    assert json.loads((final / "config.json").read_text()).get("tie_word_embeddings", False) == tied
    run(["train", *ECHO, *rewards, "--model", str(final), "--max-steps", "2", "--num-generations", "4",
         "--max-concurrent-rollouts", "4", "--max-completion-tokens", "16", "--learning-rate", "1e-2",
         "--report-to", "none", "--output-dir", str(tmp_path / "train"),
         *(["--use-peft", "--lora-rank", "8"] if sync == "lora" else [])], env)
    metrics = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["probe_gap"] < 1e-3 for m in metrics)
    assert sum(m["trained_tokens"] for m in metrics) > 0  # the weights moved: the probe checked a real sync
