"""A timed simulation of the training pipeline: how close the asynchronous loop comes to its ideal overlap.

    .venv/bin/python bench/pipeline.py [--ratios 0.25,0.5,1,2,4] [--steps 6] [--calls 3] [--generation-s 1]

Everything is the real code but the model: the trainer's loop (training/trainer.py: the pool, staleness, groups,
cancellation, the metrics of each step), the rollout pool, the capture proxy stamping each call with the policy
version, scripted agents (bench/scripted_agent.py, CALLS model calls with a shell command between them) in
bubblewrap jails, each task's verifier. Stand-ins, for what a CPU cannot do on demand: the engine is
bench/stub_engine.py (each answer takes GENERATION_S: 32 tokens at GENERATION_S / 32 a token); the policy's
optimizer step is a sleep of TRAIN_S (`TimedPolicy`); a weight sync moves the proxy's policy version (the real
route) after a sleep of SYNC_S (`TimedSync`).

The stub engine generates at most one step's calls at once (its capacity: GROUP x GROUPS_PER_STEP answers), so
more rollouts in flight wait for it rather than generate faster. First a calibration step measures generation:
one step's rollouts, end to end (agent start, calls, verifier). Then for each generation:training ratio R
(training = generation / R), the synchronous loop (--max-staleness 0) and the asynchronous one (--max-staleness 1)
with K step's rollouts in flight for each K of --slots (1: only the step being collected; 2: the trainer's default
ratio, 8 in flight for groups of 4, one a step, so the next step's groups generate while this one trains), STEPS
steps each. Reported per ratio and loop: steps/min and rollouts/min (after the first step: the ramp is not the
pipeline), the mean trainer/idle_ratio and rollouter/idle_ratio, the sampled tokens discarded; then async ÷ sync
beside the ideal (gen + train) / max(gen, train) and their quotient (the aim: >= 0.9).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rollouts_at_scale import make_tasks, start_stub

from harness_trainer.agents.command import CommandHarness
from harness_trainer.proxy.client import ProxyServer
from harness_trainer.rollouts.session import LocalSessionFactory
from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

HERE = Path(__file__).resolve().parent


class TimedPolicy:
    """A TrainablePolicy (training/protocols.py) whose optimizer step is a sleep: the loop around it is real."""
    model, peft, model_dir, rank, world_size = None, None, None, 0, 1

    def __init__(self, train_s: float):
        import torch

        self.train_s, self.dtype = train_s, torch.float32

    def step(self, groups: list, step: int) -> dict:
        time.sleep(self.train_s)
        return {"trained_tokens": sum(len(t["completion_token_ids"]) for records in groups for r in records
                                      for t in (r.training_trace or {}).get("turns", []))}

    def save_model(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)
        return Path(path)

    save_policy = save_model

    def optimizer_state(self) -> dict:
        return {}

    def full_weights(self):
        return None

    @contextlib.contextmanager
    def lead(self):
        yield


class TimedSync:
    """An EngineSync whose load is a sleep; the policy version it sets is the real proxy's, so every call after it
    is stamped with the new version and staleness is measured as in a run."""

    def __init__(self, proxy, sync_s: float):
        self.proxy, self.sync_s, self.version, self.last_probe_gap = proxy, sync_s, 0, 0.0

    def sync_weights(self, step: int) -> float:
        started = time.perf_counter()
        time.sleep(self.sync_s)
        self.version += 1
        self.proxy.set_policy_version(self.version)
        return time.perf_counter() - started

    def ensure_services(self, step: int) -> bool:
        return False

    def engine_metrics(self) -> dict:
        return {}

    def engine_time(self) -> dict:
        return {e["url"]: (e["busy_s"], e["call_s"]) for e in self.proxy.engines(cache=False)}

    def take_recovered(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


def one_loop(args, factory, tasks, out: Path, train_s: float, max_staleness: int, steps: int, slots: int = 1
             ) -> dict:
    config = AsyncGRPOConfig(output_dir=str(out), vllm_server_base_url="http://stub", num_generations=args.group,
                             groups_per_step=args.groups_per_step, max_staleness=max_staleness,
                             max_concurrent_rollouts=slots * args.group * args.groups_per_step, max_steps=steps,
                             save_steps=10 ** 6, shuffle_dataset=False)
    sync = TimedSync(factory.keywords["proxy"], args.sync_s)
    trainer = HarnessAsyncGRPOTrainer(None, factory, config, tasks, policy=TimedPolicy(train_s), sync=sync)
    history = trainer.train()
    later = history[1:] or history
    step_s = statistics.mean(h["step_time_s"] for h in later)
    rollouts = len((out / "rollouts.jsonl").read_text().splitlines())
    mean = lambda key: statistics.mean(h.get(key, 0.0) for h in later)  # noqa: E731
    return {"steps_per_min": 60 / step_s, "step_s": step_s, "rollouts_per_min": rollouts / sum(
                h["step_time_s"] for h in history) * 60,
            "trainer_idle": mean("trainer/idle_ratio"), "rollouter_idle": mean("rollouter/idle_ratio"),
            "generation_s": mean("generation_s"), "train_s": mean("train_time_s") + mean("weight_sync_time_s"),
            "discarded_tokens": sum(h["discarded_tokens/stale"] + h["discarded_tokens/flat"] for h in history),
            "sampled_tokens": sum(h["sampled_tokens"] for h in history)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", default="0.25,0.5,1,2,4", help="generation:training ratios")
    parser.add_argument("--steps", type=int, default=6, help="steps per loop and ratio")
    parser.add_argument("--calls", type=int, default=3, help="model calls per rollout")
    parser.add_argument("--generation-s", type=float, default=1.0, help="the stub engine's time per answer")
    parser.add_argument("--group", type=int, default=4, help="rollouts per group (G)")
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--sync-s", type=float, default=0.1, help="a weight sync's time")
    parser.add_argument("--slots", default="1,2", help="the async loop's rollouts in flight, in steps' rollouts")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    tasks = make_tasks(out / "tasks", 8)
    python = Path(sys.base_prefix) / "bin" / "python3"
    harness = CommandHarness(f"{python} -S -I /app/scripted_agent.py {args.calls} 20 /app/answer.txt "
                             "{instruction}")
    capacity = args.group * args.groups_per_step  # the engine serves one step's rollouts at once
    stub = start_stub(args.generation_s, out / "stub.log", capacity)
    results = {"calls": args.calls, "generation_s_per_answer": args.generation_s, "group": args.group,
               "groups_per_step": args.groups_per_step, "sync_s": args.sync_s, "engine_capacity": capacity,
               "ratios": {}}
    try:
        with ProxyServer(stub.url, model="tiny", journal=out / "journal", log_path=out / "proxy.log",
                         startup_timeout_s=60) as proxy:
            factory = functools.partial(LocalSessionFactory, proxy=proxy.client, harness=harness,
                                        output_dir=out / "trials", step_limit=args.calls,
                                        max_model_calls=args.calls + 4)
            calibration = one_loop(args, factory, tasks, out / "calibration", 0.0, 0, 2)
            generation = calibration["generation_s"]
            results["generation_s"] = generation
            for ratio in (float(r) for r in args.ratios.split(",")):
                train_s = generation / ratio
                row = {"sync": one_loop(args, factory, tasks, out / f"r{ratio}-sync", train_s, 0, args.steps)}
                gen, train = generation, train_s + args.sync_s
                row["ideal"] = (gen + train) / max(gen, train)
                for k in (int(k) for k in args.slots.split(",")):
                    run = row[f"async{k}"] = one_loop(args, factory, tasks, out / f"r{ratio}-async{k}", train_s, 1,
                                                      args.steps, k)
                    run["speedup"] = run["steps_per_min"] / row["sync"]["steps_per_min"]
                    run["of_ideal"] = run["speedup"] / row["ideal"]
                    print(f"ratio {ratio}, {k} step(s) in flight: async/sync {run['speedup']:.2f}, ideal "
                          f"{row['ideal']:.2f}, {run['of_ideal']:.0%} of it", file=sys.stderr)
                results["ratios"][ratio] = row
    finally:
        stub.stop()
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
