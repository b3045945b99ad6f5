"""Rollout benchmark: oracle-policy rollouts per minute at concurrency 1, 4 and 8 (mini-swe-agent, local
bubblewrap sandbox, real verifier, through the capture proxy), and the sandbox's own start cost.

    .venv/bin/python bench/rollouts.py [--tasks 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness_trainer.adapters.oracle import OracleUpstream
from harness_trainer.adapters.sandbox import LocalSandbox
from harness_trainer.adapters.session import LocalSessionFactory, run_rollout
from harness_trainer.adapters.tasks import load_dataset
from harness_trainer.engine import EngineConfig, VLLMServer
from harness_trainer.proxy.client import ProxyServer
from harness_trainer.tiny_model import ensure_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=16)
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
        VLLMServer(EngineConfig(model=str(ensure_tiny_model()), max_model_len=8192)).start()
    try:
        with OracleUpstream(engine.url, tasks) as oracle, ProxyServer(oracle.url, model="tiny") as proxy:
            factory = LocalSessionFactory({"max_tokens_cap": 256}, proxy=proxy.client, harness="mini-swe-agent",
                                          output_dir=Path(tempfile.mkdtemp()), step_limit=5)
            rates = {}
            for concurrency in (1, 4, 8):
                started = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    records = list(pool.map(lambda t: run_rollout(factory, t), tasks))
                minutes = (time.perf_counter() - started) / 60
                assert all(r.outcome.env_reward == 1.0 for r in records), [(r.task, r.reason) for r in records]
                rates[concurrency] = len(records) / minutes
    finally:
        if not args.vllm_url:
            engine.stop()
    print(f"sandbox start (bubblewrap exec of `true`), median of 20: {statistics.median(starts) * 1000:.1f} ms")
    for concurrency, rate in rates.items():
        print(f"oracle rollouts/min at concurrency {concurrency}: {rate:6.1f}   ({rate / rates[1]:.2f}x of 1)")


if __name__ == "__main__":
    main()
