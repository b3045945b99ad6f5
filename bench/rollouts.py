"""Rollout benchmark: oracle-policy rollouts per minute for each agent program, at concurrency 1 and 4 (local
bubblewrap sandbox, real verifier, through the capture proxy), measured side by side in one run, and the
sandbox's own start cost. The oracle answers each call with the task's solution as the agent's own shell tool
call, so the figures are the harness's own overhead (start-up, prompt size, tool execution), not the model's.
The `command` harness is left out: a template runs no tools.

    .venv/bin/python bench/rollouts.py [--tasks 8] [--harness mini-swe-agent,codex]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from harness_trainer.models.tiny import ensure_tiny_model
from harness_trainer.proxy.client import ProxyServer
from harness_trainer.rollouts.oracle import OracleUpstream
from harness_trainer.rollouts.session import LocalSessionFactory, run_rollout
from harness_trainer.rollouts.tasks import load_dataset
from harness_trainer.sandboxes.bubblewrap import LocalSandbox
from harness_trainer.serving.engine import EngineConfig, VLLMServer

HARNESSES = ("mini-swe-agent", "opencode", "claude-code:bare", "claude-code:full", "codex")
CONCURRENCY = (1, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--harness", default=",".join(HARNESSES), help="comma-separated, from: " + ", ".join(HARNESSES))
    parser.add_argument("--vllm-url", default=None)
    args = parser.parse_args()
    tasks = load_dataset("builtin:toy")[: args.tasks]

    box = LocalSandbox(tempfile.mkdtemp())
    box.start()
    starts = []
    for _ in range(20):
        t0 = time.perf_counter()
        box.exec("true", 10)
        starts.append(time.perf_counter() - t0)

    engine = VLLMServer.attach(args.vllm_url) if args.vllm_url else \
        VLLMServer(EngineConfig(model=str(ensure_tiny_model()), max_model_len=32768)).start()
    rates: dict[tuple[str, int], float] = {}
    try:
        with OracleUpstream(engine.url, tasks) as oracle, ProxyServer(oracle.url, model="tiny") as proxy:
            for label in args.harness.split(","):
                harness, _, config = label.partition(":")
                factory = LocalSessionFactory({"max_tokens_cap": 256}, proxy=proxy.client, harness=harness,
                                              agent_config=config or None, output_dir=Path(tempfile.mkdtemp()),
                                              step_limit=5)
                for concurrency in CONCURRENCY:
                    started = time.perf_counter()
                    with ThreadPoolExecutor(concurrency) as pool:
                        records = list(pool.map(partial(run_rollout, factory), tasks))
                    minutes = (time.perf_counter() - started) / 60
                    assert all(r.outcome.env_reward == 1.0 for r in records), \
                        [(label, r.task, r.status, r.reason) for r in records]
                    rates[label, concurrency] = len(records) / minutes
    finally:
        if not args.vllm_url:
            engine.stop()
    print(f"sandbox start (bubblewrap exec of `true`), median of 20: {statistics.median(starts) * 1000:.1f} ms")
    print(f"oracle rollouts/min, {len(tasks)} toy tasks each (ratio: to mini-swe-agent at the same concurrency)")
    print(f"{'harness':<20}" + "".join(f"{f'concurrency {c}':>28}" for c in CONCURRENCY))
    base = {c: rates.get(("mini-swe-agent", c)) for c in CONCURRENCY}
    for label in args.harness.split(","):
        cells = [f"{rates[label, c]:8.1f}" + (f" ({rates[label, c] / base[c]:.2f}x)" if base[c] else "")
                 for c in CONCURRENCY]
        print(f"{label:<20}" + "".join(f"{cell:>28}" for cell in cells))


if __name__ == "__main__":
    main()
