"""`harness-train` end to end: the 2-step smoke run on the embedded default with mini-swe-agent (on the session's
engine; launching its own in the slow tier), Ctrl-C cleanup, config-file + flag precedence, and the clear errors —
each of which must leave nothing running. `sft` on captured traces, on the exact ids."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch
from stubs import wait_until

from harness_trainer._exceptions import ConfigError
from harness_trainer.commands.cli import build_parser, main
from harness_trainer.commands.train import train_config

HARNESS_TRAIN = [sys.executable, "-m", "harness_trainer.commands.cli"]


def _leftovers(marker: str) -> list[str]:
    """Processes whose command line mentions `marker` (the test's own folder): engine, proxy, jails."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if marker in cmdline and p.pid != os.getpid():
            found.append(f"{p.pid}: {cmdline[:160]}")
    return found


def test_two_step_smoke_run_leaves_a_servable_checkpoint_and_nothing_running(smoke_run, engine, tiny_model_dir):
    from harness_trainer.serving.engine import teacher_forced_logprobs
    from harness_trainer.serving.weight_sync import reload_weights

    out = smoke_run  # the run itself is the session fixture (conftest.py): the viewer's tests browse it too
    assert _leftovers(str(out.parent)) == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["policy_version"] == 3
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert len((out / "rollouts.jsonl").read_text().splitlines()) == 4
    # where each step's time went, the engine's side read from the real proxy (training/timing.py)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for step in steps:
        assert 0 <= step["trainer/idle_ratio"] <= 1 and 0 <= step["rollouter/idle_ratio"] <= 1
        assert step["sampled_tokens"] > 0 and step["calls_in_flight_mean"] > 0 and step["ideal_speedup"] >= 1
    # The checkpoint is a folder vLLM serves: its tokenizer is there, and the engine scores as transformers does.
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "tokenizer.json").exists() and (checkpoint / "chat_template.jinja").exists()
    from transformers import AutoModelForCausalLM

    try:
        reload_weights(engine, checkpoint, version=0)
        ids = [1, 10, 20, 30, 40, 2]
        served = torch.tensor(teacher_forced_logprobs(engine.url, ids))
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        logits = model(torch.tensor([ids])).logits[0, :-1]
        ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert torch.allclose(served, ours.detach(), atol=1e-3)
    finally:
        reload_weights(engine, tiny_model_dir, version=0)


@pytest.mark.slow
def test_the_smoke_run_with_an_engine_of_its_own_leaves_nothing_running(tmp_path):
    """The README's command as a user runs it first: `harness-train` launches vLLM itself (the default tier's smoke
    run attaches to the session's engine)."""
    from conftest import run_smoke

    out = run_smoke(tmp_path)
    assert _leftovers(str(tmp_path)) == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["policy_version"] == 3
    assert (out / "checkpoint-2" / "model.safetensors").exists() and (out / "vllm.log").exists()


def test_ctrl_c_stops_everything(engine, tiny_model_dir, tmp_path):
    """SIGINT mid-rollout: exit 130, resume hint, nothing left running — also when this test itself was started
    with SIGINT ignored (a background job of a script), which the child inherits."""
    out = tmp_path / "run"
    proc = subprocess.Popen(HARNESS_TRAIN + [
        "--vllm-url", engine.url, "--max-steps", "50", "--num-generations", "2", "--max-concurrent-rollouts", "2",
        "--report-to", "none", "--output-dir", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    def jailed() -> bool:  # an agent is running in its jail (the command still running)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        return any("bwrap" in line for line in _leftovers(str(tmp_path)))

    wait_until(jailed, 300, "an agent in its jail")
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # say where it hangs before failing: every thread's stack (SIGUSR1)
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(2)
        os.kill(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"no exit 120 s after Ctrl-C; its stderr ends:\n{err[-12000:]}")
    assert proc.returncode == 130 and "--resume-from-checkpoint latest" in err
    try:  # the jails' last processes may still be exiting (killed, not yet reaped)
        wait_until(lambda: _leftovers(str(tmp_path)) == [], 30, "nothing left running")
    except AssertionError:
        assert _leftovers(str(tmp_path)) == []


def test_flags_override_the_config_file_which_overrides_defaults(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 7\nlearning-rate: 1e-3\nharness: opencode\nnum_generations: 3\n")
    args = build_parser().parse_args(["train", "--config", str(config), "--harness", "mini-swe-agent",
                                      "--num-generations", "5"])
    cfg = train_config(args)
    assert (cfg.max_steps, cfg.learning_rate, cfg.harness, cfg.num_generations) == (7, 1e-3, "mini-swe-agent", 5)
    assert cfg.temperature == 1.0 and cfg.output_dir == "runs/train"  # untouched defaults
    config.write_text("warmup_ratio: 0.1\nlr_scheduler_type: cosine\nsave_best: yes\n")
    cfg = train_config(build_parser().parse_args(["train", "--config", str(config), "--groups-per-step", "2",
                                                  "--behaviour-clip", "false", "--step-clip", "none"]))
    assert (cfg.warmup_ratio, cfg.lr_scheduler_type, cfg.save_best, cfg.groups_per_step, cfg.behaviour_clip) == \
        (0.1, "cosine", True, 2, False)
    assert cfg.step_clip is None and cfg.max_step_kl is None and cfg.step_clip_mode == "probability"
    assert (cfg.max_tokens_per_microbatch, cfg.dtype, cfg.gradient_checkpointing) == (16384, "auto", None)
    assert (cfg.distributed, cfg.trainer_gpus, cfg.engine_gpus, cfg.engine_memory_share) == ("ddp", None, None, 0.45)
    cfg = train_config(build_parser().parse_args(["train", "--max-tokens-per-microbatch", "none", "--dtype",
                                                  "bfloat16", "--gradient-checkpointing", "true"]))
    assert (cfg.max_tokens_per_microbatch, cfg.dtype, cfg.gradient_checkpointing) == (None, "bfloat16", True)
    config.write_text("max_step: 7\n")
    with pytest.raises(ConfigError, match="unknown option.*max_step.*max_steps"):
        train_config(build_parser().parse_args(["train", "--config", str(config)]))


def _occupied_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize("flags, says", [
    (["--harness", "crush"],
     "--harness 'crush': choose mini-swe-agent, opencode, claude-code, codex, cline, gemini-cli, qwen-code, "
     "aider, terminus-2 or command"),
    (["--dataset", "builtin:nope"], "builtin dataset 'nope': choose toy"),
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--vllm-url", "http://127.0.0.1:9"], "no healthy vLLM server at http://127.0.0.1:9"),
    (["--engine-port", "PORT"], "is in use: choose another --engine-port"),
    (["--harness", "command", "--agent-command", "/nonexistent/agent {instruction}"],
     "the agent program /nonexistent/agent (from --agent-command) does not exist"),
    (["--sandbox", "e2b"], "needs E2B_API_KEY"),
    (["--reward", "no_such_module:fn"], "cannot import fn from no_such_module"),
    (["--report-to", "tensorboard"], "--report-to 'tensorboard': choose trackio, wandb or none"),
    (["--engines", "2", "--vllm-url", "http://127.0.0.1:9"], "--engines launches engines and --vllm-url attaches"),
    (["--engines", "0"], "--engines 0: give 1 or more"),
    (["--step-clip-mode", "wavy"], "--step-clip-mode 'wavy': choose probability or ratio"),
    (["--lr-scheduler-type", "wavy"], "--lr-scheduler-type 'wavy': choose linear, cosine"),
    (["--warmup-ratio", "0.1"], "--warmup-ratio needs a schedule with a warm-up"),
    (["--groups-per-step", "0"], "--groups-per-step must be a positive integer"),
    (["--dtype", "float64"], "--dtype 'float64': choose auto, float32, bfloat16 or float16"),
    (["--max-tokens-per-microbatch", "0"], "--max-tokens-per-microbatch must be a positive integer or none"),
    (["--environment", "harness_trainer.examples.echo:EchoEnv"], "--environment needs --reward-funcs"),
    (["--use-peft", "--lora-rank", "1024"], "--lora-rank 1024 is larger than the largest rank vLLM serves"),
    (["--use-peft", "--lora-target-modules", "c_attn"], "--lora-target-modules c_attn: the model has no such"),
    (["--use-peft", "--weight-sync-backend", "reload"], "--weight-sync-backend lora and --use-peft go together"),
    (["--use-peft", "--distributed", "fsdp"], "--use-peft with --distributed fsdp is not supported"),
    (["--sandbox", "nosuch"], "--sandbox 'nosuch': choose auto, local, docker, e2b, harbor"),
    (["--sandbox", "no_such_module:Box"], "--sandbox no_such_module:Box: cannot import Box from no_such_module"),
])
def test_clear_errors_start_nothing(flags, says, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    extra = ["--output-dir", str(tmp_path / "run")] + ([] if "--report-to" in flags else ["--report-to", "none"])
    with _occupied_port() as busy:
        flags = [str(busy.getsockname()[1]) if f == "PORT" else f for f in flags]
        assert main(flags + extra) == 1
    err = capsys.readouterr().err
    assert err.startswith("harness-train: ") and says in err, err
    # What main() started is a new child of this process (or below one). A process already running (the
    # session's engine, booting beside the tests) may start its own children meanwhile: vLLM runs lscpu.
    new = [p for p in psutil.Process().children() if p.pid not in before]
    started = new + [c for p in new for c in p.children(recursive=True)]
    assert not started, [" ".join(p.cmdline()) for p in started]
    assert not (tmp_path / "run").exists()


# the settings' own checks (training/config.py, rollouts/config.py): field -> (bad value, what the CLI says)
CONFIG_REFUSALS = {"num_generations": (0, "--num-generations must be a positive integer"),
                   "groups_per_step": (0, "--groups-per-step must be a positive integer"),
                   "lr_scheduler_type": ("wavy", "--lr-scheduler-type 'wavy': choose linear, cosine"),
                   "warmup_ratio": (0.1, "--warmup-ratio needs a schedule with a warm-up"),
                   "dtype": ("float64", "--dtype 'float64': choose auto, float32, bfloat16 or float16"),
                   "max_tokens_per_microbatch": (0, "--max-tokens-per-microbatch must be a positive integer or none"),
                   "step_clip_mode": ("wavy", "--step-clip-mode 'wavy': choose probability or ratio"),
                   "distributed": ("mesh", "--distributed 'mesh': choose ddp or fsdp"),
                   "loss_type": ("ppo", "--loss-type 'ppo': choose grpo, dr_grpo, dapo"),
                   "vllm_importance_sampling_mode": ("tis", "--vllm-importance-sampling-mode 'tis': choose "),
                   "scale_rewards": ("std", "--scale-rewards 'std': choose none, group or batch"),
                   "importance_sampling_level": ("turn", "--importance-sampling-level 'turn': choose token or"),
                   "top_entropy_quantile": (1.5, "--top-entropy-quantile must be in [0, 1]"),
                   "distillation_weight": (2, "--distillation-weight must be in [0, 1]"),
                   "dynamic_sampling_max_tries": (0, "--dynamic-sampling-max-tries must be a positive integer"),
                   "lora_rank": (1024, "--lora-rank 1024 is larger than the largest rank vLLM serves")}
CONFIG_CONTEXT = {"lora_rank": {"use_peft": True}}  # a rule that applies only beside another setting


@pytest.mark.parametrize("field", sorted(CONFIG_REFUSALS))
def test_the_python_api_refuses_what_the_cli_refuses_in_the_same_words(field, tmp_path, capsys):
    """The CLI flag, the config made in Python, and a config changed after it was made and handed to the trainer:
    one ConfigError, one message, before anything is loaded or started."""
    from harness_trainer import ConfigError as PublicConfigError
    from harness_trainer import HarnessAsyncGRPOTrainer
    from harness_trainer.training.config import AsyncGRPOConfig

    value, says = CONFIG_REFUSALS[field]
    context = CONFIG_CONTEXT.get(field, {})
    flags = [f"--{name.replace('_', '-')}" for name in context]  # boolean flags
    assert main(flags + ["--" + field.replace("_", "-"), str(value), "--report-to", "none",
                         "--output-dir", str(tmp_path / "cli")]) == 1
    assert says in capsys.readouterr().err
    with pytest.raises(PublicConfigError, match=re.escape(says)):
        AsyncGRPOConfig(**context, **{field: value})
    changed = AsyncGRPOConfig(output_dir=str(tmp_path / "api"), **context)
    setattr(changed, field, value)
    with pytest.raises(PublicConfigError, match=re.escape(says)):
        HarnessAsyncGRPOTrainer("/nonexistent/model", lambda sampling: None, changed, [object()])
    assert not (tmp_path / "api").exists() and not (tmp_path / "cli").exists()


def test_eval_refuses_an_unknown_policy_before_it_touches_its_folder(tmp_path, capsys):
    """EvalConfig checks --policy itself (the CLI and the Python API alike), before any output file is removed."""
    from harness_trainer import ConfigError as PublicConfigError
    from harness_trainer.commands.evaluate import EvalConfig

    out = tmp_path / "eval"
    out.mkdir()
    (out / "rollouts.jsonl").write_text("kept\n")
    assert main(["eval", "--policy", "teacher", "--output-dir", str(out)]) == 1
    assert "--policy 'teacher': choose model or oracle" in capsys.readouterr().err
    with pytest.raises(PublicConfigError, match="--policy 'teacher': choose model or oracle"):
        EvalConfig(policy="teacher", output_dir=str(out))
    white_box = ["--environment", "harness_trainer.examples.echo:EchoEnv", "--output-dir", str(out)]
    for flags, says in ((white_box, "--environment needs --reward-funcs"),
                        (white_box + ["--reward-funcs", "harness_trainer.examples.echo:reward_func", "--policy",
                                      "oracle"], "--policy oracle replays Harbor tasks' solutions")):
        assert main(["eval", *flags]) == 1 and says in capsys.readouterr().err
    with pytest.raises(PublicConfigError, match="--environment needs --reward-funcs"):
        EvalConfig(environment="harness_trainer.examples.echo:EchoEnv", output_dir=str(out))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    for flags, says in ((["--harness", "nosuch"], "--harness 'nosuch': choose"),
                        (["--sandbox", "nosuch"], "--sandbox 'nosuch': choose")):  # no engine is started for them
        assert main(["eval", *flags, "--output-dir", str(out)]) == 1 and says in capsys.readouterr().err
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    assert (out / "rollouts.jsonl").read_text() == "kept\n"


def test_the_trainer_refuses_an_environment_without_reward_functions(tmp_path):
    """The one white-box rule (rollouts/config.py: check_white_box), for the trainer's own arguments."""
    from harness_trainer import ConfigError as PublicConfigError
    from harness_trainer import HarnessAsyncGRPOTrainer
    from harness_trainer.examples.echo import EchoEnv
    from harness_trainer.training.config import AsyncGRPOConfig

    with pytest.raises(PublicConfigError, match="an environment_factory needs reward_funcs"):
        HarnessAsyncGRPOTrainer("/nonexistent/model", None, AsyncGRPOConfig(output_dir=str(tmp_path / "run")),
                                [{"prompt": "hi"}], environment_factory=EchoEnv)
    assert not (tmp_path / "run").exists()


def test_live_display_shows_stability_and_warnings():
    from rich.console import Console

    from harness_trainer.commands.cli import TrainProgress

    progress = TrainProgress(16)
    progress.on_step({"step": 9, "version": 10, "trained_tokens": 622, "reward_mean": 0.375, "entropy": 0.24,
                      "behaviour_kl_k3": 0.0123, "behaviour_clip_frac": 0.05, "completion_tokens_mean": 41.5,
                      "step_scale": 0.25,
                      "warnings": ["entropy jumped to 0.24 (median of the last 5 steps: 0.012)"],
                      "recovered": ["the engine restarted without the policy: version 9 synced again"],
                      **{f"engine{i}/{k}": v for i, (url, state, rate) in enumerate(
                          [("http://a:8000", "ready", 0.81), ("http://b:8000", "lost", None)])
                         for k, v in {"url": url, "state": state, "sessions": 5 + i, "calls": 40 + i,
                                      "prefix_cache_hit_rate": rate}.items()}})
    console = Console(width=200, record=True)
    console.print(progress)
    screen = console.export_text()
    assert "entropy 0.240" in screen and "KL to behaviour 0.0123" in screen and "behaviour clip 5.0%" in screen
    assert "step taken 25%" in screen
    assert "answer 42 tokens" in screen and "step 9: entropy jumped to 0.24" in screen
    assert "before step 9: the engine restarted without the policy" in screen
    assert "http://a:8000: ready, 5 sessions, 40 calls, prefix cache 81%" in screen  # several engines: one line each
    assert "http://b:8000: lost, 6 sessions, 41 calls, prefix cache -" in screen


@pytest.mark.parametrize("lora", [[], ["--use-peft", "--lora-rank", "8", "--lora-alpha", "64"], ["--packing", "tree"]],
                         ids=["full", "lora", "tree"])
def test_sft_trains_on_the_exact_captured_ids(tiny_model_dir, tmp_path, lora):
    from openenv.core.harness.training import TrainingTrace
    from transformers import AutoModelForCausalLM

    from harness_trainer.commands.sft import sft_rows
    from harness_trainer.traces.files import write_traces

    prompt, completion = [1, 50, 60, 70, 2, 3], [300, 301, 302, 2]
    trace = TrainingTrace.model_validate({"turns": [{
        "node_id": "a", "prompt_token_ids": prompt, "completion_token_ids": completion,
        "per_token_logps": [-5.0] * 4, "loss_mask": [0] * 6 + [1] * 4}]})
    (tmp_path / "traces").mkdir()
    write_traces(tmp_path / "traces" / "traces.jsonl", [trace] * 4)
    rows = sft_rows(tmp_path / "traces")
    assert rows[0] == {"input_ids": prompt + completion, "completion_mask": [0] * 6 + [1] * 4}
    assert main(["sft", "--traces", str(tmp_path / "traces"), "--output-dir", str(tmp_path / "sft"),
                 "--num-train-epochs", "30", "--learning-rate", "1e-2", "--per-device-train-batch-size", "4",
                 *lora]) == 0
    ids = torch.tensor([prompt + completion])

    def completion_logp(folder):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        logp = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        return logp[len(prompt) - 1:].detach()

    logp = completion_logp(tmp_path / "sft" / "final")
    if lora:  # rank 8 on the attention and MLP of a 2-layer model learns slower than every weight: it must move
        assert float(logp.mean() - completion_logp(tiny_model_dir).mean()) > 1.0
    else:
        assert float(logp.exp().min()) > 0.9  # the completion is learned ...
    assert (tmp_path / "sft" / "final" / "tokenizer.json").exists()  # ... into a folder vLLM can serve
    assert (tmp_path / "sft" / "final" / "adapter" / "adapter_config.json").exists() == ("--use-peft" in lora)
    assert main(["sft", "--traces", str(tmp_path / "none")]) == 1


def test_tree_sft_has_the_rows_loss_on_fewer_tokens(tiny_model_dir):
    """The prefix-tree SFT's loss is TRL's completion-only token mean over the batch's rows, while the shared
    prompt runs once: checked at the first step (learning rate 0, so the model does not move)."""
    from transformers import AutoModelForCausalLM

    from harness_trainer.training.packing import Chain
    from harness_trainer.training.sft_tree import train_on_tree

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompt = list(range(10, 210))  # a shared "system prompt" of 200 tokens
    chains = []
    for i, completion in enumerate([[300, 301, 2], [302, 2], [303, 304, 305, 2]]):
        ids = prompt + [60 + i] + completion
        trained = [False] * (len(ids) - len(completion)) + [True] * len(completion)
        chains.append(Chain(i, ids, [None if not t else (i, "a", k) for k, t in enumerate(trained)], trained,
                            [0.0] * len(ids), [-1] * len(ids)))
    result = train_on_tree(model, chains, epochs=1, learning_rate=0.0, batch_size=3)
    with torch.no_grad():
        nll, n = 0.0, 0
        for c in chains:
            ids = torch.tensor([c.ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(c.trained[1:])
            nll, n = nll - float(logp[mask].sum()), n + int(mask.sum())
    assert result["losses"][0] == pytest.approx(nll / n, rel=1e-5)
    assert result["tokens_fed"] == 200 + 3 + 3 + 2 + 4 and result["row_tokens"] == sum(len(c.ids) for c in chains)


def test_sft_without_traces_is_a_clear_error(tmp_path, capsys):
    assert main(["sft", "--traces", str(tmp_path)]) == 1
    assert "no traces at" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("harness", [["opencode"], ["claude-code", "--agent-config", "bare"], ["codex"],
                                     ["gemini-cli", "--agent-config", "compact"],
                                     ["qwen-code", "--agent-config", "compact"], ["cline"], ["aider"],
                                     ["terminus-2"]],
                         ids=lambda h: h[0])
def test_installed_agents_train_two_steps_on_the_toy_set(tmp_path, harness):
    out = tmp_path / "run"
    result = subprocess.run(HARNESS_TRAIN + ["--harness", *harness] + [
        "--dataset", "builtin:toy-train", "--max-steps", "2", "--num-generations", "2",
        "--max-concurrent-rollouts", "2", "--max-completion-tokens", "32", "--agent-timeout", "120",
        "--learning-rate", "1e-3", "--report-to", "none", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and len(records) == 4
    assert len((out / "traces.jsonl").read_text().splitlines()) >= 1  # the agent's turns were captured, trainable
    assert _leftovers(str(tmp_path)) == []


def test_the_schedules_train_accepts_are_transformers_own():
    """train checks --lr-scheduler-type against a list written out (importing transformers' enum costs seconds of
    torch import in `jobs launch`); the list must be the enum's values."""
    from transformers import SchedulerType

    from harness_trainer.training.config import LR_SCHEDULES

    assert LR_SCHEDULES == tuple(t.value for t in SchedulerType)
