"""`harness-train eval`: run an agent harness on a dataset's tasks, concurrently, and tabulate.

    engine (launched, or attached by URL) <- [oracle upstream] <- capture proxy <- agents in sandboxes

Writes to the output folder: traces.jsonl (OpenEnv TrainingTraces, one per scorable rollout) and
rollouts.jsonl (one record per rollout: task, status and why, reward, tool use, timings).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from harness_trainer._exceptions import ConfigError
from harness_trainer.rollouts.config import RolloutConfig, option
from harness_trainer.training.config import same_as

if TYPE_CHECKING:
    from harness_trainer.rollouts.session import RolloutRecord



@dataclass
class EvalConfig(RolloutConfig):
    """`harness-train eval`: the rollout settings every command shares (rollouts/services.py), with the trainer's
    names and help for the sampling ones, and eval's own."""
    dataset: str = option("builtin:toy-heldout", "folder of Harbor tasks, builtin:NAME or hf:OWNER/NAME; with "
                                                 "--environment, a .jsonl (or .json) of rows with a 'prompt' column")
    policy: str = option("model", "who answers model calls: model, or oracle (each task's known solution)",
                         choices=("model", "oracle"))
    num_generations: int = same_as("num_generations", 1)
    max_concurrent_rollouts: int = same_as("max_concurrent_rollouts")
    temperature: float = same_as("temperature")
    max_completion_tokens: int = same_as("max_completion_tokens")
    max_tool_calling_iterations: int | None = same_as("max_tool_calling_iterations")
    max_completion_length: int = same_as("max_completion_length")
    limit: int | None = option(None, "only the first N tasks")
    oracle_mistake_rate: float = option(0.0, "with --policy oracle: share of each task's attempts made with a "
                                             "plausible slip (redirection forgotten, else first argument "
                                             "capitalised), exact per task")
    output_dir: str = option("runs/eval", "where traces and rollout records go")

    def check(self) -> None:
        super().check()
        if self.environment and self.policy != "model":
            raise ConfigError("--policy oracle replays Harbor tasks' solutions; an --environment has none")


@dataclass
class EvalSummary:
    tasks: int
    rollouts: int
    wins: int
    tries_per_win: float | None
    invalid_tool_calls: int
    timeouts: int
    unscorable: int
    mean_reward: float | None
    agent_calls: int = 0  # model calls the agent made for its turns (trained)
    auxiliary_calls: int = 0  # side calls without tools (opencode's title, summaries): captured, never trained
    skipped: list[str] = field(default_factory=list)  # tasks whose environment could not be had (--skip-invalid-tasks)
    solution_failed: int | None = None  # --policy oracle: rollouts whose solve.sh exited non-zero (None: none ran)

    def table(self, title: str) -> str:
        tpw = f"{self.tries_per_win:.2f}" if self.tries_per_win else "-"
        mean = f"{self.mean_reward:.3f}" if self.mean_reward is not None else "-"
        rows = [("tasks", self.tasks), ("rollouts", self.rollouts), ("wins", self.wins), ("tries per win", tpw),
                ("invalid tool calls", self.invalid_tool_calls), ("timeouts", self.timeouts),
                ("unscorable", self.unscorable), ("mean reward", mean)]
        if self.solution_failed is not None:  # a failed solution, apart from a verifier that scored 0
            rows.append(("solution failed", self.solution_failed))
        if self.skipped:
            rows.append(("skipped (no environment)", f"{len(self.skipped)}: {', '.join(self.skipped)}"))
        width = max(len(k) for k, _ in rows)
        return "\n".join([title] + [f"  {k:<{width}}  {v}" for k, v in rows])


def summarise(records: list[RolloutRecord], tasks: int) -> EvalSummary:
    scored = [r.outcome.env_reward for r in records if r.outcome.env_reward is not None]
    wins = sum(1 for r in scored if r >= 1.0)
    from harness_trainer.rollouts.verifier import solution_failed as failed

    solutions = [r.solution for r in records if r.solution]
    return EvalSummary(tasks=tasks, rollouts=len(records), wins=wins,
                       tries_per_win=len(records) / wins if wins else None,
                       invalid_tool_calls=sum(r.invalid_tool_calls for r in records),
                       timeouts=sum(1 for r in records if r.outcome.timed_out),
                       unscorable=sum(1 for r in records if r.status == "unscorable"),
                       mean_reward=sum(scored) / len(scored) if scored else None,
                       agent_calls=sum(c.get("role") == "agent" for r in records for c in r.calls),
                       auxiliary_calls=sum(c.get("role") == "auxiliary" for r in records for c in r.calls),
                       solution_failed=sum(map(failed, solutions)) if solutions else None)


def evaluate(cfg: EvalConfig, progress=None) -> tuple[EvalSummary, list[RolloutRecord]]:
    from harness_trainer.models.hub import model_or_default
    from harness_trainer.proxy.capture import SamplingPolicy
    from harness_trainer.rollouts.pool import RolloutPool
    from harness_trainer.rollouts.rewards import score_group
    from harness_trainer.rollouts.services import run_services
    from harness_trainer.rollouts.tasks import load_dataset

    cfg.check()  # a config changed after it was made is checked again, as the trainer checks its args
    environment, reward_funcs, skipped = None, [], []
    if cfg.environment:  # white-box: the rows are the tasks, the reward functions the verifier
        from harness_trainer.rollouts.environments import load_object, load_rows
        from harness_trainer.rollouts.rewards import resolve_reward_funcs

        environment = load_object(cfg.environment, "--environment")
        reward_funcs = resolve_reward_funcs(cfg.reward_funcs)
        tasks = load_rows(cfg.dataset)[: cfg.limit]
    else:
        tasks = load_dataset(cfg.dataset, cfg.skip_invalid_tasks)[: cfg.limit]
    out = Path(cfg.output_dir)
    if environment is None:  # the agent, refused tasks and images, before anything starts or any file is removed
        from harness_trainer.agents.registry import make_harness
        from harness_trainer.sandboxes.registry import check_task_sandboxes

        make_harness(cfg.harness, cfg.agent_command, cfg.agent_config).check_installed()
        runnable = check_task_sandboxes(cfg.sandbox, tasks, out / "builds", public_url=cfg.public_url,
                                        force_build=cfg.force_build, skip_invalid=cfg.skip_invalid_tasks)
        kept = {t.name for t in runnable}
        skipped, tasks = [t.name for t in tasks if t.name not in kept], runnable
    out.mkdir(parents=True, exist_ok=True)
    for name in ("rollouts.jsonl", "traces.jsonl"):
        (out / name).unlink(missing_ok=True)
    model = None if cfg.vllm_url else model_or_default(cfg.model, cfg.model_revision)
    records: list[RolloutRecord] = []
    with run_services(cfg, out, model=model, environment=environment, rollouts_dir=out,
                      oracle_tasks=tasks if cfg.policy == "oracle" else None,
                      oracle_mistake_rate=cfg.oracle_mistake_rate) as services:
        factory = services.session_factory(SamplingPolicy(temperature=cfg.temperature,
                                                          max_tokens_cap=cfg.max_completion_tokens))
        # white-box: a task's rollouts are scored together, as a training group is; black-box: the verifier's
        score = (lambda group, task: score_group(group, reward_funcs, None, task.row)) if environment else None
        total = len(tasks) * cfg.num_generations
        # Ctrl-C, SIGTERM or a broken capture contract: the pool's exit starts nothing more, stops what runs and
        # writes what had finished
        with RolloutPool(factory, out, cfg.max_concurrent_rollouts, score) as pool:
            for task in tasks:
                pool.launch(task, cfg.num_generations, task.name)
            for group in pool.as_completed():
                for record in group.records:
                    records.append(record)
                    if progress:
                        progress(record, len(records), total)
    summary = replace(summarise(records, len(tasks)), skipped=skipped)
    # the model folder it sampled from, when this run launched the engine (the viewer decodes with its tokenizer)
    named = cfg.model or (str(model.path) if model else None)
    (out / "summary.json").write_text(json.dumps(asdict(summary) | {"model": named}, indent=2) + "\n")
    return summary, records
