"""`harness-train eval`: run an agent harness on a dataset's tasks, concurrently, and tabulate.

    engine (launched, or attached by URL) <- [oracle upstream] <- capture proxy <- agents in sandboxes

Writes to the output folder: traces.jsonl (OpenEnv TrainingTraces, one per scorable rollout) and
rollouts.jsonl (one record per rollout: task, status and why, reward, tool use, timings).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from harness_trainer.adapters.session import CaptureContractError, LocalSessionFactory, RolloutRecord, run_rollout
from harness_trainer.adapters.tasks import Task, load_dataset
from harness_trainer.engine import EngineConfig, VLLMServer, check_model_dir
from harness_trainer.proxy.client import ProxyServer
from harness_trainer.rewards import score_group
from harness_trainer.traces import TrainingTrace, append_trace, turn_counts


@dataclass
class EvalConfig:
    harness: str = "mini-swe-agent"
    dataset: str = "builtin:toy-heldout"
    model: str | None = None  # model folder to serve (default: the embedded tiny model)
    vllm_url: str | None = None  # attach instead of launching
    policy: str = "model"  # or "oracle"
    n: int = 1  # rollouts per task
    limit: int | None = None  # first N tasks only
    concurrency: int = 4
    sandbox: str = "local"
    step_limit: int = 12
    agent_timeout_s: float | None = None
    temperature: float = 1.0
    max_tokens: int = 512
    reward_key: str = "reward"
    output_dir: str = "runs/eval"
    agent_command: str | None = None
    agent_config: str | None = None  # mini-swe-agent: YAML layered over its default, or "compact"
    oracle_mistake_rate: float = 0.0  # --policy oracle: share of each task's attempts made with a slip
    environment: str | None = None  # white-box: module:Class (environments.py); --dataset is then rows
    reward_funcs: str | None = None  # white-box: module:f,module:g, scored over each task's n rollouts
    max_tool_calling_iterations: int | None = None
    max_completion_length: int = 1024


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

    def table(self, title: str) -> str:
        tpw = f"{self.tries_per_win:.2f}" if self.tries_per_win else "-"
        mean = f"{self.mean_reward:.3f}" if self.mean_reward is not None else "-"
        rows = [("tasks", self.tasks), ("rollouts", self.rollouts), ("wins", self.wins), ("tries per win", tpw),
                ("invalid tool calls", self.invalid_tool_calls), ("timeouts", self.timeouts),
                ("unscorable", self.unscorable), ("mean reward", mean)]
        width = max(len(k) for k, _ in rows)
        return "\n".join([title] + [f"  {k:<{width}}  {v}" for k, v in rows])


def summarise(records: list[RolloutRecord], tasks: int) -> EvalSummary:
    scored = [r.outcome.env_reward for r in records if r.outcome.env_reward is not None]
    wins = sum(1 for r in scored if r >= 1.0)
    return EvalSummary(tasks=tasks, rollouts=len(records), wins=wins,
                       tries_per_win=len(records) / wins if wins else None,
                       invalid_tool_calls=sum(r.invalid_tool_calls for r in records),
                       timeouts=sum(1 for r in records if r.outcome.timed_out),
                       unscorable=sum(1 for r in records if r.status == "unscorable"),
                       mean_reward=sum(scored) / len(scored) if scored else None)


def record_line(record: RolloutRecord) -> dict:
    """A rollout record as rollouts.jsonl keeps it: the turns' token ids live once, in traces.jsonl (joined by
    episode_id); here only their counts, so the record file stays small enough to index quickly."""
    kept = dataclasses.replace(record, environment=None, training_trace=None)  # an instance is not data
    line = {k: v for k, v in asdict(kept).items() if k not in ("training_trace", "environment")}
    line["outcome"] = {k: v for k, v in line["outcome"].items() if k != "trace"}
    line.update(turn_counts((record.training_trace or {}).get("turns", [])))
    return line


def write_record(out: Path, record: RolloutRecord) -> None:
    with (out / "rollouts.jsonl").open("a") as f:
        f.write(json.dumps(record_line(record)) + "\n")
    if record.training_trace:
        trace = TrainingTrace.model_validate(record.training_trace)
        for turn in trace.turns:  # so a trace can be joined to its rollout record (e.g. sft --only-rewarded)
            turn.metadata["episode_id"] = record.episode_id
        append_trace(out / "traces.jsonl", trace)


@contextlib.contextmanager
def model_upstream(cfg: EvalConfig, tasks: list[Task], out: Path):
    """Yields the URL the proxy forwards to: the engine, or the oracle in front of it."""
    from harness_trainer.tiny_model import ensure_tiny_model

    with contextlib.ExitStack() as stack:
        if cfg.vllm_url:
            engine = VLLMServer.attach(cfg.vllm_url)
        else:
            model = str(check_model_dir(cfg.model)) if cfg.model else str(ensure_tiny_model())
            engine = stack.enter_context(VLLMServer(EngineConfig(model=model, log_path=out / "vllm.log")))
        if cfg.policy == "oracle":
            from harness_trainer.adapters.oracle import OracleUpstream

            oracle = stack.enter_context(OracleUpstream(engine.url, tasks, model=engine.model_name,
                                                        mistake_rate=cfg.oracle_mistake_rate))
            yield oracle.url, engine
        elif cfg.policy == "model":
            yield engine.url, engine
        else:
            raise ValueError(f"unknown --policy '{cfg.policy}': choose model or oracle")


def evaluate(cfg: EvalConfig, progress=None) -> tuple[EvalSummary, list[RolloutRecord]]:
    environment, reward_funcs = None, []
    if cfg.environment:  # white-box: the rows are the tasks, the reward functions the verifier
        from harness_trainer.environments import (EnvironmentContractError, EnvironmentSessionFactory, load_object,
                                                  load_rows)
        from harness_trainer.rewards import resolve_reward_funcs

        if cfg.policy != "model":
            raise EnvironmentContractError("--policy oracle replays Harbor tasks' solutions; an --environment has none")
        environment, reward_funcs = load_object(cfg.environment, "--environment"), resolve_reward_funcs(cfg.reward_funcs)
        if not reward_funcs:
            raise EnvironmentContractError("--environment needs --reward-funcs module:f[,module:g] to score its episodes")
        tasks = load_rows(cfg.dataset)[: cfg.limit]
    else:
        tasks = load_dataset(cfg.dataset)[: cfg.limit]
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("rollouts.jsonl", "traces.jsonl"):
        (out / name).unlink(missing_ok=True)
    records: list[RolloutRecord] = []
    with model_upstream(cfg, tasks, out) as (upstream, engine), \
            ProxyServer(upstream, model=engine.model_name, journal=out / "journal", log_path=out / "proxy.log") as proxy:
        sampling = {"temperature": cfg.temperature, "max_tokens_cap": cfg.max_tokens}
        if environment is not None:
            factory = EnvironmentSessionFactory(
                sampling, proxy=proxy.client, environment_factory=environment, agent_timeout_s=cfg.agent_timeout_s,
                max_tool_calling_iterations=cfg.max_tool_calling_iterations,
                max_completion_length=cfg.max_completion_length)
        else:
            factory = LocalSessionFactory(
                sampling, proxy=proxy.client, harness=cfg.harness, sandbox=cfg.sandbox, output_dir=out,
                step_limit=cfg.step_limit, agent_timeout_s=cfg.agent_timeout_s, reward_key=cfg.reward_key,
                agent_command=cfg.agent_command, agent_config=cfg.agent_config)
        jobs = [(task, f"{task.name}-{i}") for task in tasks for i in range(cfg.n)]
        by_name, groups = {task.name: task for task in tasks}, {}
        with ThreadPoolExecutor(cfg.concurrency) as pool:
            futures = [pool.submit(run_rollout, factory, task, episode) for task, episode in jobs]
            for future in as_completed(futures):
                try:
                    record = future.result()
                except CaptureContractError:
                    for other in futures:
                        other.cancel()
                    raise
                done = [record]
                if environment is not None:  # scored once a task's n rollouts are in, as a training group is
                    done = groups.setdefault(record.task, [])
                    done.append(record)
                    if len(done) < cfg.n:
                        continue
                    score_group(done, reward_funcs, None, by_name[record.task].row)
                for finished in done:
                    finished.environment = None
                    records.append(finished)
                    write_record(out, finished)
                    if progress:
                        progress(finished, len(records), len(jobs))
    summary = summarise(records, len(tasks))
    # the model folder it sampled from, when this run launched the engine (the viewer decodes with its tokenizer)
    from harness_trainer.tiny_model import ensure_tiny_model

    model = cfg.model or (None if cfg.vllm_url else str(ensure_tiny_model()))
    (out / "summary.json").write_text(json.dumps(asdict(summary) | {"model": model}, indent=2) + "\n")
    return summary, records
