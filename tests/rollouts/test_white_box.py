"""White-box environments (TRL's environment_factory) on the real tiny model, vLLM and capture proxy.

The random tiny model never writes a tool call, so the episodes that must call tools are answered by a scripted
upstream (the oracle's machinery: answers rendered in the model's tool-call format, tokenised by the real
engine and scored by it, so the captured turns are engine tokens): a stub for scripted answers only. What the
real model does by itself (no tool call: the episode ends) runs through the real engine."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from harness_trainer._exceptions import EnvironmentContractError, RewardError
from harness_trainer.examples import echo, multi_env, wordle
from harness_trainer.proxy.client import ProxyServer
from harness_trainer.rollouts.environments import EnvironmentSessionFactory, check_environment, load_rows
from harness_trainer.rollouts.oracle import OracleUpstream
from harness_trainer.rollouts.rewards import score_group
from harness_trainer.rollouts.session import run_rollout
from harness_trainer.traces.files import TrainingTrace
from harness_trainer.training.packing import chains_from_trace

EXAMPLES = Path(wordle.__file__).parent


class Scripted(OracleUpstream):
    """Answers each model call with `script(messages, tool names)`: ("tool", name, arguments) or ("say", text)."""

    def __init__(self, engine_url: str, script):
        super().__init__(engine_url, [], model="tiny")
        self.script = script

    def answer(self, body: dict) -> dict:
        kind, *rest = self.script(body["messages"], {t["function"]["name"] for t in body.get("tools") or []})
        if kind == "say":
            return {"role": "assistant", "content": rest[0]}
        name, arguments = rest
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{len(body['messages'])}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def play(messages: list[dict], tools: set[str]):
    """Wordle: [slate], [crane], then a word. Echo: a call that fails (a wrong argument name; in the router, the
    other game's tool), the right call, then a word. 'loop' in the prompt: the echo tool for ever."""
    k, first = sum(m["role"] == "assistant" for m in messages), messages[0]["content"]
    if "Wordle" in first:
        return [("tool", "guess", {"guess": "[slate]"}), ("tool", "guess", {"guess": "[crane]"}),
                ("say", "Solved.")][min(k, 2)]
    if "loop" in first:
        return ("tool", "step", {"message": "hi"})
    wrong = ("tool", "step", {"msg": "Hello"}) if "step" in tools else ("tool", "guess", {"guess": "[hello]"})
    right = ("tool", "step" if "step" in tools else "echo", {"message": "Hello World!"})
    return [wrong, right, ("say", "Done.")][min(k, 2)]


@pytest.fixture(scope="module")
def scripted_proxy(engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
    with Scripted(engine.url, play) as upstream, \
            ProxyServer(upstream.url, model="tiny", journal=root / "journal", log_path=root / "proxy.log") as proxy:
        yield proxy


def factory(proxy, environment, **kwargs) -> EnvironmentSessionFactory:
    return EnvironmentSessionFactory({"training": True, "temperature": 1.0, "max_tokens_cap": 64},
                                     proxy=proxy.client, environment_factory=environment, **kwargs)


def rollout(proxy, environment, row: dict, **kwargs):
    task = load_rows([row])[0]
    record = run_rollout(factory(proxy, environment, **kwargs), task)
    return record, task


# ---- the contract, no engine ------------------------------------------------------------------------------


def test_tools_come_from_signatures_and_docstrings():
    (schema,) = check_environment(wordle.Wordle)
    assert schema["function"]["name"] == "guess"
    assert schema["function"]["parameters"]["properties"]["guess"]["type"] == "string"
    assert "[abcde]" in schema["function"]["parameters"]["properties"]["guess"]["description"]
    assert [s["function"]["name"] for s in check_environment(echo.EchoEnv)] == ["step"]  # get_reward is no tool
    assert {s["function"]["name"] for s in check_environment(multi_env.MultiEnv)} == {"echo", "guess"}


def test_a_broken_environment_class_is_refused_with_what_to_change():
    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: how much
            """
            return x

    class Undocumented:
        def reset(self, **kwargs):
            return None

        def act(self, x):
            return x

    class NeedsArgs:
        def __init__(self, url):
            pass

    with pytest.raises(EnvironmentContractError, match="no reset method"):
        check_environment(NoReset)
    with pytest.raises(EnvironmentContractError, match=r"Undocumented.act: .*type hint"):
        check_environment(Undocumented)
    with pytest.raises(EnvironmentContractError, match="__init__ must take no arguments"):
        check_environment(NeedsArgs)
    with pytest.raises(EnvironmentContractError, match="the class itself"):
        check_environment(wordle.Wordle())


def test_rows_are_checked_and_named(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "Echo hi", "level": 2}\n{"prompt": [{"role": "user", "content": "x"}]}\n')
    tasks = load_rows(rows)
    assert [t.name for t in tasks] == ["row-0", "row-1"]
    assert tasks[0].row == {"prompt": [{"role": "user", "content": "Echo hi"}], "level": 2}
    with pytest.raises(EnvironmentContractError, match="row 0: every row must be an object with a 'prompt'"):
        load_rows([{"question": "?"}])
    with pytest.raises(EnvironmentContractError, match="'environments' is a reward function argument"):
        load_rows([{"prompt": "x", "environments": 1}])
    with pytest.raises(EnvironmentContractError, match="no such file"):
        load_rows(tmp_path / "missing.jsonl")


# ---- episodes through the real proxy ------------------------------------------------------------------------


def test_wordle_episode_runs_to_the_end_with_exact_captured_turns(scripted_proxy, tokenizer):
    row = {"prompt": [{"role": "user", "content": wordle.PROMPT}], "secret": "crane"}
    record, task = rollout(scripted_proxy, wordle.Wordle, row)
    assert record.status == "ok" and record.truncated == "", (record.reason, record.truncated)  # ended on its own
    assert record.outcome.tool_calls_by_name == {"guess": 2} and record.outcome.tool_failure_count == 0
    assert [m["role"] for m in record.outcome.completion] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert record.outcome.completion[1]["content"].startswith("You submitted [slate].\nFeedback:\nS L A T E\n")
    assert record.outcome.completion[3]["content"] == "Congratulations! You guessed the word correctly!"
    trace = TrainingTrace.model_validate(record.training_trace)
    assert len(trace.turns) == 3
    (chain,) = chains_from_trace(trace, 0)  # each prompt is exactly the previous prompt + answer + tool answer
    assert sum(chain.trained) == sum(len(t.completion_token_ids) for t in trace.turns)
    last_prompt = tokenizer.decode(trace.turns[-1].prompt_token_ids)
    assert "S L A T E\nX X G X G" in last_prompt and "Congratulations!" in last_prompt
    score_group([record], [wordle.reward_win, wordle.reward_partial, wordle.reward_invalid], None, task.row)
    assert record.reward_terms == {"reward_win": 1.0, "reward_partial": 1.0, "reward_invalid": 0.0}
    assert record.reward == 2.0 and record.outcome.env_reward == 2.0


def test_a_tool_exception_reaches_the_model_as_text_and_counts_as_a_failure(scripted_proxy, tokenizer):
    record, _ = rollout(scripted_proxy, echo.EchoEnv, {"prompt": "Make the environment echo 'Hello World!'"})
    assert record.status == "ok", record.reason
    assert record.outcome.tool_failure_count == 1 and record.outcome.tool_calls_by_name == {"step": 2}
    error = record.outcome.completion[1]["content"]
    assert error.startswith("{'error': ") and "unexpected keyword argument 'msg'" in error
    trace = TrainingTrace.model_validate(record.training_trace)
    assert "unexpected keyword argument 'msg'" in tokenizer.decode(trace.turns[1].prompt_token_ids)
    assert record.environment.get_reward() == pytest.approx(1.2)  # 'Hello World!' echoed


def test_reset_gets_the_row_and_the_real_model_ends_its_episode(engine, proxy, tokenizer):
    seen = {}

    class Recording(echo.EchoEnv):
        def reset(self, **kwargs):
            seen.update(kwargs)
            return " Observation: ready."

    row = {"prompt": [{"role": "user", "content": "Echo hi."}], "level": 3, "tags": ["a", "b"]}
    record, _ = rollout(proxy, Recording, row)
    assert seen == row  # every column, the prompt too
    assert record.status == "ok", record.reason  # the random model writes no tool call: its episode ends there
    trace = TrainingTrace.model_validate(record.training_trace)
    assert len(trace.turns) == 1 and trace.turns[0].completion_token_ids
    assert "Echo hi. Observation: ready." in tokenizer.decode(trace.turns[0].prompt_token_ids)
    assert "step(message)" in tokenizer.decode(trace.turns[0].prompt_token_ids)  # the tool, in the template


def test_the_limits_end_an_episode_cleanly(scripted_proxy):
    row = {"prompt": "Echo in a loop."}  # the script calls step for ever
    record, _ = rollout(scripted_proxy, echo.EchoEnv, row, max_tool_calling_iterations=2)
    assert record.status == "ok" and "max_tool_calling_iterations (2)" in record.reason
    assert "max_tool_calling_iterations (2)" in record.truncated  # mask_truncated_completions leaves it out
    assert record.outcome.tool_calls_by_name == {"step": 2}  # the third answer's call is not run
    assert len(record.training_trace["turns"]) == 3
    record, _ = rollout(scripted_proxy, echo.EchoEnv, row, max_completion_length=60)
    assert record.status == "ok" and "max_completion_length (60 tokens)" in record.reason
    turns = record.training_trace["turns"]
    after_prompt = len(turns[-1]["prompt_token_ids"]) + len(turns[-1]["completion_token_ids"]) \
        - len(turns[0]["prompt_token_ids"])
    assert 60 <= after_prompt < 60 + 40 and len(turns) < 6  # the budget ended it, past by at most one turn


def test_multi_env_rows_go_to_their_game_and_each_reward_says_none_to_the_other(scripted_proxy):
    tasks = load_rows(EXAMPLES / "multi_env.jsonl")
    funcs = [multi_env.wordle_reward, multi_env.echo_reward]
    for task in tasks[:2]:  # a Wordle row, then an Echo row
        records = [run_rollout(factory(scripted_proxy, multi_env.MultiEnv), task) for _ in range(2)]
        assert all(r.status == "ok" for r in records), [r.reason for r in records]
        assert {r.environment.active for r in records} == {task.row["env"]}
        score_group(records, funcs, None, task.row)
        mine, other = ("wordle_reward", "echo_reward") if task.row["env"] == "wordle" else \
            ("echo_reward", "wordle_reward")
        assert all(r.reward_terms[other] is None and r.reward_terms[mine] is not None for r in records)
        if task.row["env"] == "echo":  # the other game's tool fails, as the seed's router says
            assert all(r.outcome.tool_failure_count == 1 for r in records)
            assert "guess is only available in Wordle" in records[0].outcome.completion[1]["content"]


def test_reward_functions_are_checked_and_unclaimed_rollouts_score_zero(scripted_proxy, caplog):
    task = load_rows(EXAMPLES / "wordle.jsonl")[0]
    records = [run_rollout(factory(scripted_proxy, wordle.Wordle), task) for _ in range(2)]
    with caplog.at_level(logging.WARNING, "harness_trainer"):
        score_group(records, [lambda environments, **kw: [None] * len(environments)], None, task.row)
    assert [r.reward for r in records] == [0.0, 0.0] and "every reward function returned None" in caplog.text

    def short(environments, **kwargs):
        return [1.0]

    with pytest.raises(RewardError, match="short returned .*one value per environment"):
        score_group(records, [short], None, task.row)

    def strict(environments):  # takes no **kwargs
        return [0.0] * len(environments)

    with pytest.raises(RewardError, match=r"strict raised TypeError: .*unexpected keyword.*should take \*\*kwargs"):
        score_group(records, [strict], None, task.row)


# ---- training and eval ----------------------------------------------------------------------------------


def test_two_training_steps_log_each_reward_term(fresh_engine, tiny_model_dir, tmp_path):
    """TRL's call shape: environment_factory, reward_funcs, rows; the trainer runs its own capture proxy."""
    from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

    rows = [json.loads(line) for line in (EXAMPLES / "wordle.jsonl").read_text().splitlines()][:2]
    trainer = HarnessAsyncGRPOTrainer(
        model=str(tiny_model_dir),
        args=AsyncGRPOConfig(output_dir=str(tmp_path / "run"), vllm_server_base_url=fresh_engine.url,
                             num_generations=2, max_concurrent_rollouts=2, max_steps=2, max_completion_tokens=16,
                             max_completion_length=64, save_steps=2),
        train_dataset=rows, environment_factory=wordle.Wordle,
        reward_funcs=[wordle.reward_win, wordle.reward_partial, wordle.reward_invalid])
    history = trainer.train()
    assert [h["step"] for h in history] == [1, 2]
    for name in ("reward_win", "reward_partial", "reward_invalid"):
        assert all(f"rewards/{name}/mean" in h for h in history)
    records = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) >= 4 and all(set(r["reward_terms"]) == {"reward_win", "reward_partial", "reward_invalid"}
                                     for r in records if r["status"] == "ok")
    assert (tmp_path / "run" / "traces.jsonl").exists() and trainer.own_proxy.managed.process is None  # stopped


def reward_spread(environments, flat, **kwargs):
    """All equal on a `flat` row (no gradient), else 0, 1, 0, ... (a gradient whatever the model did)."""
    return [0.5] * len(environments) if flat[0] else [float(i % 2) for i in range(len(environments))]


def test_dynamic_sampling_refills_each_step_with_groups_that_train(fresh_engine, tiny_model_dir, tmp_path):
    """Every step trains on groups_per_step groups with a gradient, the flat ones collected, written and counted
    instead; when the cap runs out the step trains on what it has and says why."""
    from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

    rows = [json.loads(line) for line in (EXAMPLES / "wordle.jsonl").read_text().splitlines()][:4]

    def train(rows, out, **settings):
        return HarnessAsyncGRPOTrainer(model=str(tiny_model_dir), train_dataset=rows, environment_factory=wordle.Wordle,
                                       reward_funcs=[reward_spread], args=AsyncGRPOConfig(
            output_dir=str(out), vllm_server_base_url=fresh_engine.url, num_generations=2, max_concurrent_rollouts=2,
            max_completion_tokens=8, max_completion_length=16, max_tool_calling_iterations=1, save_steps=10,
            dynamic_sampling=True, **settings)).train()

    mixed = [row | {"flat": i < 3} for i, row in enumerate(rows)]  # three of four tasks give no gradient
    history = train(mixed, tmp_path / "mixed", max_steps=3, groups_per_step=2, dynamic_sampling_max_tries=8)
    assert all(h["groups"] == 2 and h["zero_variance_groups"] == 0 and "warnings" not in h for h in history), history
    skipped = sum(h.get("dynamic_skipped", 0) for h in history)
    assert skipped >= 3 and sum(h["groups_collected"] for h in history) == 6 + skipped + sum(
        h["dropped_stale"] for h in history)
    written = (tmp_path / "mixed" / "rollouts.jsonl").read_text().splitlines()
    assert len(written) >= 2 * sum(h["groups_collected"] for h in history)  # skipped groups are written too

    flat = [row | {"flat": True} for row in rows]
    (capped,) = train(flat, tmp_path / "flat", max_steps=1, dynamic_sampling_max_tries=2)
    assert capped["groups_collected"] == 2 and capped["dynamic_skipped"] + capped["dropped_stale"] == 2
    assert "dynamic sampling: 0 of 1 groups could train after 2 collected" in capped["warnings"][0]
    assert capped.get("trained_tokens", 0) == 0  # nothing to train on: no step taken, the step still logged


@pytest.mark.parametrize("use_peft", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_distillation_scores_every_trained_token_by_its_exact_ids(fresh_engine, tiny_model_dir, tmp_path, use_peft):
    """The teacher is the engine serving the student's own starting weights (with LoRA: the base model, the
    student its zero-initialised adapter): every trained token must get the logprob the engine sampled it with,
    and the step's reverse KL is ~0. A token scored out of place (a shifted position, another context) would be
    far off."""
    from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

    rows = [json.loads(line) for line in (EXAMPLES / "wordle.jsonl").read_text().splitlines()][:2]
    (step,) = HarnessAsyncGRPOTrainer(
        model=str(tiny_model_dir), train_dataset=rows, environment_factory=wordle.Wordle,
        reward_funcs=[wordle.reward_win], args=AsyncGRPOConfig(
            output_dir=str(tmp_path / "run"), vllm_server_base_url=fresh_engine.url, teacher_url=fresh_engine.url,
            num_generations=2, max_concurrent_rollouts=2, max_steps=1, max_completion_tokens=16,
            max_completion_length=32, save_steps=10, use_peft=use_peft, lora_rank=8)).train()
    assert step["distill_scored_frac"] == 1.0 and abs(step["distill_kl"]) < 5e-3, step
    assert step["teacher_tokens"] > 0 and step["trained_tokens"] > 0
    gaps = []
    for line in (tmp_path / "run" / "traces.jsonl").read_text().splitlines():
        for turn in json.loads(line)["turns"]:
            scored = turn["metadata"]["teacher_logps"]
            assert len(scored) == len(turn["completion_token_ids"]) and None not in scored
            gaps += [abs(t - b) for t, b in zip(scored, turn["per_token_logps"])]
    assert gaps and max(gaps) < 1e-2, max(gaps)


def test_a_teacher_of_another_tokenizer_is_refused(tiny_model_dir):
    from harness_trainer._exceptions import ModelError
    from harness_trainer.models.tiny import TinyModelSpec, ensure_tiny_model
    from harness_trainer.serving.teacher import check_same_tokenizer

    llama = ensure_tiny_model(TinyModelSpec(arch="llama"))
    with pytest.raises(ModelError, match="does not share the student's tokenizer.*same tokenizer"):
        check_same_tokenizer(str(tiny_model_dir), str(llama))
    check_same_tokenizer(str(tiny_model_dir), str(tiny_model_dir))  # itself: no error


def test_cli_trains_and_evaluates_an_environment(fresh_engine, tmp_path, capsys):
    """train, view and eval of a white-box environment, driven through the CLI's main in this process (the console
    script itself is exercised in tests/commands/test_cli.py and test_train_cli.py)."""
    from harness_trainer.commands.cli import main

    prefix = "harness_trainer.examples.multi_env:"
    common = ["--environment", prefix + "MultiEnv", "--reward-funcs", f"{prefix}wordle_reward,{prefix}echo_reward",
              "--dataset", str(EXAMPLES / "multi_env.jsonl"), "--vllm-url", fresh_engine.url]
    assert main([*common, "--max-steps", "2", "--num-generations", "2", "--max-concurrent-rollouts", "2",
                 "--max-completion-tokens", "16", "--report-to", "none", "--output-dir",
                 str(tmp_path / "train")]) == 0, \
        capsys.readouterr().err[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(any(k.startswith("rewards/") for k in m) for m in metrics)
    from harness_trainer.commands.viewer.runs import Decoder, RunFolder  # the viewer reads a white-box run as any other

    folder = RunFolder(tmp_path / "train", Decoder(None))
    shown = folder.rollout(0)
    assert shown["record"]["reward_terms"].keys() == {"wordle_reward", "echo_reward"} and shown["turns"]
    assert shown["calls"] and all(c["turn"] is not None for c in shown["calls"] if c["role"] == "agent")
    assert main(["view", str(tmp_path / "train"), "--html", str(tmp_path / "page")]) == 0, capsys.readouterr().err
    assert (tmp_path / "page" / "index.html").exists()
    assert main(["eval", *common, "--num-generations", "2", "--limit", "2", "--max-completion-tokens", "16",
                 "--output-dir", str(tmp_path / "eval")]) == 0, capsys.readouterr().err[-3000:]
    records = [json.loads(line) for line in (tmp_path / "eval" / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {r["task"] for r in records} == {"row-0", "row-1"}
    capsys.readouterr()
    assert main(["--environment", prefix + "Nope", "--reward-funcs", prefix + "echo_reward",
                 "--dataset", str(EXAMPLES / "multi_env.jsonl")]) == 1
    assert "cannot import Nope from harness_trainer.examples.multi_env" in capsys.readouterr().err


# ---- learning ---------------------------------------------------------------------------------------------


class Dial:
    """The learning test's environment: its reward is the digit the model passes to its tool."""

    def __init__(self):
        self.dialled = []

    def reset(self, **kwargs) -> None:
        self.dialled = []

    def dial(self, digit: str) -> str:
        """Dial one digit.

        Args:
            digit: the digit to dial, 0 to 9
        """
        self.dialled.append(digit)
        return "ok"


def reward_high_digit(environments, **kwargs) -> list[float]:
    """1 when the first digit dialled is 5 to 9; 0 for 0 to 4, and for a call that dials nothing or not a digit."""
    return [1.0 if env.dialled[:1] and env.dialled[0] in list("56789") else 0.0 for env in environments]


@pytest.mark.slow
def test_reward_from_a_tool_argument_rises(tmp_path):
    """Learning with no capable model, as the trainer's own proof does: a 320-token tiny model is first shown the
    tool-call format (SFT on scripted episodes that dial every digit equally often), then GRPO through the
    white-box loop, with the trainer's default trust region, is rewarded only when the digit it passes to the
    tool is 5 or more."""
    from harness_trainer.commands.sft import SFTRunConfig, run_sft
    from harness_trainer.models.tiny import TinyModelSpec, ensure_tiny_model
    from harness_trainer.rollouts.records import write_record
    from harness_trainer.serving.engine import EngineConfig, VLLMServer
    from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

    model, rows = ensure_tiny_model(TinyModelSpec(vocab=320)), [{"prompt": "Dial a digit."}]
    digits = iter(str(i % 10) for i in range(10_000))

    def demonstrate(messages, tools):  # a solver that dials any digit, then stops
        return ("tool", "dial", {"digit": next(digits)}) if messages[-1]["role"] == "user" else ("say", "Done.")

    with VLLMServer(EngineConfig(model=str(model), max_model_len=4096)) as engine:
        demos = tmp_path / "demos"
        demos.mkdir()
        with Scripted(engine.url, demonstrate) as upstream, ProxyServer(upstream.url, model="tiny") as proxy:
            sessions = factory(proxy, Dial, max_tool_calling_iterations=1)
            for task in load_rows(rows * 40):
                write_record(demos, run_rollout(sessions, task))
        sft = run_sft(SFTRunConfig(traces=str(demos), model=str(model), output_dir=str(tmp_path / "sft"),
                                   num_train_epochs=30, learning_rate=3e-3))
        history = HarnessAsyncGRPOTrainer(str(sft), args=AsyncGRPOConfig(
            output_dir=str(tmp_path / "grpo"), vllm_server_base_url=engine.url, num_generations=16,
            max_concurrent_rollouts=16, max_steps=16, learning_rate=5e-4, temperature=0.7, max_completion_tokens=48,
            max_tool_calling_iterations=1, save_steps=100),
            train_dataset=rows, environment_factory=Dial, reward_funcs=[reward_high_digit]).train()
    rewards = [h.get("rewards/reward_high_digit/mean") or 0.0 for h in history]
    # The SFT model dials every digit equally often: half its digits are high (the first step's 16 samples, drawn
    # before any update, say ≈ 0.5). Learning by a margin: the last 8 steps (128 samples, σ ≈ 0.04) well above
    # half. Not a window the trainer could beat by learning early (a run measured 0.38 → 0.73 failed one).
    # Measured over 6 runs (2026-12-05): late 0.805 to 0.891 (mean 0.85), first 0.31 to 0.56. One fresh-clone CI
    # run ended at 0.43 without learning at all; not reproduced: its failure now shows what each step saw.
    late = sum(rewards[-8:]) / 8
    seen = [{k: h.get(k) for k in ("staleness", "dropped_stale", "cancelled", "probe_gap", "trained_tokens",
                                   "loss", "step_scale", "entropy")} for h in history]
    # a string, not the tuple: pytest cuts a long object's repr, and each step's figures are what finds this flake
    assert rewards[0] < 0.75 and late > 0.5 + 0.15, f"rewards {rewards}\nper step {seen}"
