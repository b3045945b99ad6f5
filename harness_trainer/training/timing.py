"""Where a step's time went, on both sides of the loop, and what sampled work it threw away. verl logs the two idle
ratios under these names; the rest is ours.

    step_time_s            wall time since the previous step ended
    wait_for_groups_s      the trainer waiting for finished groups (collecting and scoring them included)
    trainer/idle_ratio     wait_for_groups_s / step_time_s
    rollouter/idle_ratio   the share of the step the engines had no call in flight (their mean); a sync's pause,
                           an agent running its tools between calls, rollouts not yet launched all count here
    calls_in_flight_mean   calls in flight on all engines, averaged over the step (vLLM's batch, as the proxy sees it)
    generation_s           what the rollout side needs for one step's groups at full concurrency: the seconds of the
                           step's collected rollouts, summed, over the rollouts kept in flight
    ideal_speedup          (generation_s + train) / max(generation_s, train), train = train_time_s + the sync: what
                           overlapping generation with training can give at most over the synchronous loop
    sampled_tokens         completion tokens the engine sampled for the groups this step trains on (their retries
                           and auxiliary calls included)
    discarded_tokens/WHY   those sampled for groups it collected and did not train on: stale (too old, or cancelled
                           because they could no longer finish in time) or flat (dynamic sampling: equal rewards)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable


def overlap_warnings(args, groups_in_flight: int) -> list[str]:
    """Where the slots given cannot all overlap generation with training (bench/pipeline.py measures both cases):
    one step's groups leave nothing to generate while a step trains; more than max_staleness allows ahead are
    not launched (they would sample only to be dropped)."""
    step = args.groups_per_step * args.num_generations
    if args.max_staleness > 0 and groups_in_flight == args.groups_per_step:
        return [f"max_concurrent_rollouts {args.max_concurrent_rollouts} holds only one step's groups: no rollout "
                f"generates while a step trains. Give it at least {2 * step} (two steps' rollouts) to overlap."]
    if groups_in_flight > (args.max_staleness + 1) * args.groups_per_step:
        return [f"max_concurrent_rollouts {args.max_concurrent_rollouts}: at most {(args.max_staleness + 1) * step} "
                f"rollouts run at once, since a group launched further ahead would be more than max_staleness "
                f"{args.max_staleness} versions old when it trains. Raise max_staleness to "
                f"{groups_in_flight // args.groups_per_step - 1} to use them all."]
    return []


def sampled_tokens(records) -> int:
    """Completion tokens of every call the proxy captured for these rollouts (a cancelled one's too)."""
    return sum(call.get("completion_tokens") or 0 for record in records for call in record.calls)


class StepClock:
    """The timing figures of consecutive steps. `engine_time()`: each engine's cumulative (busy_s, call_s), as
    EngineSync.engine_time gives them; `clock`: seconds, monotonic (a test's own clock)."""

    def __init__(self, engine_time: Callable[[], dict], clock: Callable[[], float] = time.perf_counter):
        self.engine_time, self.clock = engine_time, clock
        self.started, self.engines = clock(), engine_time()
        self.waited = 0.0

    @contextlib.contextmanager
    def waiting(self):
        """`with clock.waiting():` around the trainer's wait for groups."""
        began = self.clock()
        try:
            yield
        finally:
            self.waited += self.clock() - began

    def figures(self, metrics: dict, rollout_seconds: list[float], slots: int) -> dict:
        """The step's timing figures, from its metrics (train_time_s, weight_sync_time_s), its collected rollouts'
        seconds and the rollouts kept in flight; then the clock starts the next step."""
        now, engines = self.clock(), self.engine_time()
        step_s = max(now - self.started, 1e-9)
        figures = {"step_time_s": round(step_s, 3), "wait_for_groups_s": round(self.waited, 3),
                   "trainer/idle_ratio": round(min(1.0, self.waited / step_s), 4)}
        common = [url for url in engines if url in self.engines]
        if common:
            busy = [(engines[u][0] - self.engines[u][0]) / step_s for u in common]
            figures["rollouter/idle_ratio"] = round(max(0.0, 1 - sum(busy) / len(busy)), 4)
            figures["calls_in_flight_mean"] = round(sum(engines[u][1] - self.engines[u][1] for u in common) / step_s,
                                                    3)
        train = metrics.get("train_time_s", 0.0) + metrics.get("weight_sync_time_s", 0.0)
        generation = sum(rollout_seconds) / max(1, slots)
        figures["generation_s"] = round(generation, 3)
        if max(generation, train) > 0:
            figures["ideal_speedup"] = round((generation + train) / max(generation, train), 3)
        self.started, self.engines, self.waited = now, engines, 0.0
        return figures

