"""`harness-train eval` end to end: real agents in bubblewrap sandboxes, through the capture proxy, scored by
the tasks' own verifiers. The oracle policy must solve every task; the random tiny model must yield valid
traces and verifier rewards."""

from __future__ import annotations

import json

import pytest

from harness_trainer.commands.evaluate import EvalConfig, evaluate
from harness_trainer.traces.files import read_traces


def test_oracle_solves_the_bugfix_set(engine, tmp_path):
    """Every bugfix task, each its own verifier (two toy tasks: the slips test below; every toy task, both splits,
    in the slow tier)."""
    summary, records = evaluate(EvalConfig(dataset="builtin:bugfix", vllm_url=engine.url, policy="oracle",
                                           max_concurrent_rollouts=4, output_dir=str(tmp_path)))
    assert summary.wins == summary.rollouts == summary.tasks == 5, [(r.task, r.status, r.reason) for r in records]
    assert summary.invalid_tool_calls == 0 and summary.unscorable == 0
    traces = read_traces(tmp_path / "traces.jsonl")  # validated by OpenEnv's model on read
    assert len(traces) == summary.rollouts and all(len(t.turns) == 2 for t in traces)


def test_oracle_slips_on_every_task_at_the_same_rate(engine, tmp_path):
    """Mistake rate 0.5, two attempts per task: every task is solved exactly once; the other attempt is the
    plausible slip (redirection forgotten: `echo W F`), well formed and scored 0 by the task's own verifier."""
    summary, records = evaluate(EvalConfig(dataset="builtin:toy-heldout", limit=2, num_generations=2,
                                           vllm_url=engine.url,
                                           policy="oracle", oracle_mistake_rate=0.5, max_concurrent_rollouts=4,
                                           output_dir=str(tmp_path)))
    assert summary.rollouts == 4 and summary.wins == 2 and summary.invalid_tool_calls == 0
    assert summary.unscorable == 0 and summary.tasks == 2
    traces = read_traces(tmp_path / "traces.jsonl")  # a win and a slip alike: the call, then the agent's end
    assert len(traces) == 4 and all(len(t.turns) == 2 for t in traces)
    by_task: dict[str, list] = {}
    for record in records:
        by_task.setdefault(record.task, []).append(record)
    for task, attempts in by_task.items():
        assert sorted(r.outcome.env_reward for r in attempts) == [0.0, 1.0], task
        failed = next(r for r in attempts if r.outcome.env_reward == 0.0)
        first_call = next(m for m in failed.outcome.completion if m.get("tool_calls"))["tool_calls"][0]
        command = json.loads(first_call["function"]["arguments"])["command"]
        assert command.startswith("echo ") and ">" not in command, command


@pytest.mark.slow
def test_oracle_solves_every_toy_task(engine, tmp_path):
    for dataset, tasks in (("builtin:toy-train", 48), ("builtin:toy-heldout", None)):
        summary, _ = evaluate(EvalConfig(dataset=dataset, vllm_url=engine.url, policy="oracle",
                                         max_concurrent_rollouts=4, output_dir=str(tmp_path / dataset[8:])))
        assert summary.wins == summary.rollouts == summary.tasks == (tasks or summary.tasks) > 0


# (harness, --agent-config, its shell tool, the dialect it speaks)
SHELL = "run_shell_command"
NPM_AGENTS = [("claude-code", "bare", "Bash", "anthropic"), ("claude-code", "full", "Bash", "anthropic"),
              ("codex", None, "exec_command", "responses"), ("gemini-cli", "compact", SHELL, "google"),
              ("gemini-cli", "full", SHELL, "google"), ("qwen-code", "compact", SHELL, "chat"),
              ("qwen-code", "full", SHELL, "chat"), ("cline", None, "run_commands", "chat")]
NAMES = ("claude-code-bare", "claude-code-full", "codex", "gemini-cli-compact", "gemini-cli-full", "qwen-code-compact",
         "qwen-code-full", "cline")
SETS = dict.fromkeys(NAMES, (2, 5))

# one per agent in the default tier (claude-code on 3 tasks, codex, gemini-cli, qwen-code and cline, slower to
# start, on 2 or 1; qwen-code on a bugfix task, where it reads the file before its shell's `sed -i`); every variant
# on 7 tasks in the slow tier
CHAIN_CASES = [pytest.param(*agent, limits, id=f"{name}") for agent, name, limits in
               ((NPM_AGENTS[0], NAMES[0], (1, 2)), (NPM_AGENTS[2], NAMES[2], (1, 1)),
                (NPM_AGENTS[3], NAMES[3], (1, 1)), (NPM_AGENTS[5], NAMES[5], (0, 1)),
                (NPM_AGENTS[7], NAMES[7], (1, 1)))] + \
              [pytest.param(*agent, SETS[name], id=f"{name}-7-tasks", marks=pytest.mark.slow) for agent, name in
               zip(NPM_AGENTS, NAMES)]


@pytest.mark.parametrize("harness,mode,shell,dialect,limits", CHAIN_CASES)
def test_npm_agents_with_the_oracle_solve_toy_and_bugfix_tasks_as_one_chain(
        engine, tmp_path, harness, mode, shell, dialect, limits):
    """The real programs, in the sandbox, through the proxy's Anthropic / Responses / Google / chat dialects: the
    oracle's answers are calls to the agent's own shell tool, the verifier scores them, and each multi-turn
    rollout is ONE chain (for claude-code: no per-call attribution hash breaking the prefix)."""
    from harness_trainer.training.packing import chains_from_trace

    for dataset, limit in zip(("builtin:toy-train", "builtin:bugfix"), limits):
        if not limit:
            continue
        out = tmp_path / dataset[8:]
        summary, records = evaluate(EvalConfig(harness=harness, agent_config=mode, dataset=dataset, limit=limit,
                                               vllm_url=engine.url, policy="oracle", max_concurrent_rollouts=2,
                                               max_completion_tokens=256, output_dir=str(out)))
        assert summary.wins == summary.rollouts == limit, [(r.task, r.status, r.reason) for r in records]
        # qwen-code refuses a `sed -i` on a file its read_file has not read: the oracle runs `pwd`, then reads it
        calls = {shell: 3, "read_file": 1} if harness == "qwen-code" and dataset == "builtin:bugfix" else {shell: 2}
        for record in records:
            assert record.outcome.tool_calls_by_name == calls and record.outcome.tool_failure_count == 0
        traces = read_traces(out / "traces.jsonl")
        assert len(traces) == limit
        for trace in traces:
            assert len(trace.turns) >= 3 and len(chains_from_trace(trace, 0)) == 1
            assert all(t.metadata["dialect"] == dialect for t in trace.turns)


@pytest.mark.parametrize("harness,mode", [("mini-swe-agent", None), ("opencode", None), ("opencode", "compact")],
                         ids=["mini-swe-agent", "opencode", "opencode-compact"])
def test_tiny_model_rollouts_yield_valid_traces_and_verifier_rewards(engine, tokenizer, tmp_path, harness, mode):
    summary, records = evaluate(EvalConfig(harness=harness, agent_config=mode, dataset="builtin:toy-heldout", limit=2,
                                           vllm_url=engine.url, max_concurrent_rollouts=2, agent_step_limit=2,
                                           max_completion_tokens=32,
                                           output_dir=str(tmp_path)))
    assert summary.rollouts == 2 and summary.unscorable == 0, [(r.status, r.reason) for r in records]
    assert all(r.outcome.env_reward is not None and r.verifier_detail == "reward.txt" for r in records)
    traces = read_traces(tmp_path / "traces.jsonl")
    assert len(traces) == 2 and all(t.turns for t in traces)
    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert {r["task"] for r in rows} == {r.task for r in records}
    if harness == "opencode":  # its own ~3.4k-token prompt and ten tools, or the compact one (bash only)
        agent_prompts = [len(t.prompt_token_ids) for trace in traces for t in trace.turns]  # agent turns only
        assert agent_prompts and all(n < 600 if mode == "compact" else n > 3000 for n in agent_prompts), agent_prompts
        # the tools the prompt offers, as the model read them (a permission once turned compact's off ones back on)
        prompt = tokenizer.decode(traces[0].turns[0].prompt_token_ids)  # the template lists each as NAME(ARGS): ...
        offered = {name for name in ("bash", "edit", "write", "webfetch", "read") if f"\n{name}(" in prompt}
        assert offered == ({"bash"} if mode == "compact" else {"bash", "edit", "write", "webfetch", "read"}), offered


def _toy_and_bugfix_tasks(folder, image: str | None):
    """One toy and one bugfix task, in an image built from `image` when given (aider finds a task's files through
    git, terminus-2 drives tmux): the task's files copied into it, as a Harbor task's Dockerfile does."""
    import shutil

    from harness_trainer.rollouts.builtin import builtin_dataset

    for name, source in (("toy", next(builtin_dataset("toy-train").iterdir())),
                         ("bugfix", builtin_dataset("bugfix") / "bugfix-greet")):
        shutil.copytree(source, folder / name)
        if image:
            (folder / name / "environment" / "Dockerfile").write_text(f"FROM {image}\nWORKDIR /app\nCOPY app/ /app/\n")
    return folder


@pytest.mark.parametrize("sandbox", ["local", pytest.param("docker", marks=pytest.mark.slow)])
def test_aider_with_the_oracle_solves_toy_and_bugfix_tasks_by_writing_files(engine, tmp_path, sandbox):
    """aider has no tools: the oracle's solution is the files it writes, in aider's whole-file format. The bugfix
    task takes two calls (the file named, which aider adds; then written whole), each its own chain: aider rebuilds
    its prompt at every call (the added file moves into a message of its own, its format reminder to the last).
    In containers: an image with git wins both; one without (python:3.11-slim) is refused, saying why."""
    from harness_trainer.training.packing import chains_from_trace

    dataset = _toy_and_bugfix_tasks(tmp_path / "tasks", "harness-test/git:12" if sandbox == "docker" else None)
    summary, records = evaluate(EvalConfig(harness="aider", dataset=str(dataset), vllm_url=engine.url, policy="oracle",
                                           sandbox=sandbox, max_concurrent_rollouts=2, output_dir=str(tmp_path / "e")))
    assert summary.wins == summary.rollouts == 2, [(r.task, r.status, r.reason) for r in records]
    assert all(r.outcome.tool_calls_by_name == {"edit": 1} and r.outcome.tool_failure_count == 0 for r in records)
    turns = {t.turns[0].metadata["episode_id"].split("-")[0]: t.turns for t in read_traces(tmp_path / "e/traces.jsonl")}
    assert {name: len(t) for name, t in turns.items()} == {"toy": 1, "bugfix": 2}
    trace = next(t for t in read_traces(tmp_path / "e/traces.jsonl") if len(t.turns) == 2)
    assert len(chains_from_trace(trace, 0)) == 2 and all(t.metadata["dialect"] == "chat" for t in trace.turns)
    if sandbox == "docker":
        plain = _toy_and_bugfix_tasks(tmp_path / "plain", None)
        summary, records = evaluate(EvalConfig(harness="aider", dataset=str(plain), limit=1, vllm_url=engine.url,
                                               policy="oracle", sandbox="docker", output_dir=str(tmp_path / "p")))
        assert summary.unscorable == 1 and "aider needs git in the image" in records[0].reason, records[0].reason


@pytest.mark.parametrize("sandbox", ["local", pytest.param("docker", marks=pytest.mark.slow)])
def test_terminus_with_the_oracle_types_the_solution_into_its_terminal(engine, tmp_path, sandbox):
    """Harbor's terminus-2, its own class in the sandbox: no tools, the oracle's answers are its JSON of keystrokes
    (history expansion off, the solution, then the task marked complete and confirmed), typed into a tmux session,
    scored by each task's verifier; each rollout is one chain (one growing user/assistant conversation). In
    containers: an image with tmux wins both; one without (python:3.11-slim) is refused, saying why."""
    from harness_trainer.training.packing import chains_from_trace

    dataset = _toy_and_bugfix_tasks(tmp_path / "tasks", "harness-test/tmux:12" if sandbox == "docker" else None)
    summary, records = evaluate(EvalConfig(harness="terminus-2", dataset=str(dataset), vllm_url=engine.url,
                                           policy="oracle", sandbox=sandbox, max_concurrent_rollouts=2,
                                           output_dir=str(tmp_path / "e")))
    assert summary.wins == summary.rollouts == 2, [(r.task, r.status, r.reason) for r in records]
    assert all(r.outcome.tool_calls_by_name == {"bash_command": 2, "mark_task_complete": 2} for r in records)
    traces = read_traces(tmp_path / "e/traces.jsonl")
    assert len(traces) == 2 and all(len(t.turns) == 4 and len(chains_from_trace(t, 0)) == 1 for t in traces)
    assert all(t.metadata["dialect"] == "chat" for trace in traces for t in trace.turns)
    if sandbox == "docker":
        plain = _toy_and_bugfix_tasks(tmp_path / "plain", "python:3.11-slim")
        summary, records = evaluate(EvalConfig(harness="terminus-2", dataset=str(plain), limit=1, vllm_url=engine.url,
                                               policy="oracle", sandbox="docker", output_dir=str(tmp_path / "p")))
        assert summary.unscorable == 1 and "terminus-2 needs tmux in the image" in records[0].reason, records[0].reason
