"""A finished rollout's trace: fetched from the proxy and read on one thread for the whole pool, checked by OpenEnv's
own validator in a process of its own (trace_check.py), kept as its wire form with its repeats shared
(traces/sharing.py). The proxy ships it compact (each token once, traces/compact.py): it is made whole here and, for
the check, in the checker's process."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from openenv.core.harness.training import TrainingTrace

from harness_trainer import fastjson
from harness_trainer._exceptions import CaptureContractError
from harness_trainer.rollouts.trace_check import Checker
from harness_trainer.traces.compact import expand
from harness_trainer.traces.sharing import share_trace

# Every trace is fetched and read on this one thread: read on each rollout's own, its ~10 MB of objects came from
# that thread's glibc arena, which kept its high water (8 arenas a core; a pool of 32 held ~1 GB); and 768 rollouts
# fetching at once held their bodies (pool 1.6 -> 4.7 GB at 1,024 in flight, docs/benchmarks.md).
TRACE_READER = ThreadPoolExecutor(1, thread_name_prefix="trace-reader")


def contract_broken(what: str, finding) -> CaptureContractError:
    return CaptureContractError(f"{what}: the captured trace breaks the TrainingTrace contract: {finding}")


def validated_trace(body: bytes, what: str) -> TrainingTrace:
    try:
        wire = fastjson.loads(body)
        return TrainingTrace.model_validate(expand(wire)) if isinstance(wire, dict) and "form" in wire \
            else TrainingTrace.model_validate_json(body)
    except ValueError as exc:
        raise contract_broken(what, exc) from None


CHECKER = Checker(TrainingTrace)


def collect_trace(fetch: Callable[[], bytes], what: str) -> dict:
    """One finished rollout's trace, on the rollout's own thread: `fetch()` and reading it on the reader thread,
    then OpenEnv's check in the checker process while the reader reads the next. A trace that breaks the contract
    raises CaptureContractError."""
    def read() -> tuple[bytes, dict | None]:
        body = fetch()
        try:
            return body, share_trace(expand(fastjson.loads(body)))
        except ValueError:  # not JSON: the check says what is wrong
            return body, None

    body, wire = TRACE_READER.submit(read).result()
    breach = CHECKER.breach(body)
    if breach is not None or wire is None:
        raise contract_broken(what, breach or "it is not JSON")
    return wire
