"""A finished rollout's trace, fetched from the proxy, checked by OpenEnv's own validator and kept as its wire form
with its repeats shared (traces/sharing.py), on one thread for the whole pool.

OpenEnv's validator walks every token id in Python (two generator passes over prompt and completion: ~45 ms of
a 2.7 MB trace's ~75), so more threads would not help; another process would (docs/benchmarks.md, 1,024 in
flight)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from openenv.core.harness.training import TrainingTrace

from harness_trainer import fastjson
from harness_trainer._exceptions import CaptureContractError
from harness_trainer.traces.sharing import share_trace

# Every trace is fetched, validated and converted on this one thread: read on each rollout's own, its ~10 MB of
# objects came from that thread's glibc arena, which kept its high water (8 arenas a core; a pool of 32 held ~1 GB).
# This thread caps the rollouts a pool finishes (a 2.7 MB trace of 8 calls: its export, ~75 ms to validate, ~35 to
# read and share); fetched on each rollout's own thread instead, 768 rollouts waiting held their bodies (pool
# 1.6 -> 4.7 GB at 1,024 in flight, docs/benchmarks.md).
TRACE_READER = ThreadPoolExecutor(1, thread_name_prefix="trace-reader")


def validated_trace(body: bytes, what: str) -> TrainingTrace:
    try:
        return TrainingTrace.model_validate_json(body)
    except ValueError as exc:
        raise CaptureContractError(f"{what}: the captured trace breaks the TrainingTrace contract: {exc}") from None


def read_trace(body: bytes, what: str) -> dict:
    """The wire form of a trace that validates (OpenEnv's own validator), its repeats shared. The proxy writes every
    field, so the wire form is the body as parsed: a model dumped back to a dict cost as much again."""
    validated_trace(body, what)
    return share_trace(fastjson.loads(body))
