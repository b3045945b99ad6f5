"""Traces are OpenEnv's `TrainingTrace` (schema v1), stored one per line as JSON lines.

There is deliberately no schema of our own: what the proxy exports and the trainer reads is validated by
OpenEnv's pydantic model, so a trace from this project is a trace for any OpenEnv consumer and vice versa.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from harness_trainer import fastjson
from harness_trainer._exceptions import TraceFileError

if TYPE_CHECKING:
    from openenv.core.harness.training import TrainingTrace, TrainingTurn

__all__ = ["TrainingTrace", "TrainingTurn", "TraceFileError", "iter_traces", "read_traces", "write_traces",
           "append_trace", "append_wire", "turn_counts"]


def __getattr__(name: str):
    """OpenEnv's schema, loaded on first use: importing `openenv.core` imports its web interface and gradio
    (≈ 6 s of CPU), which commands that never validate a trace (`view`, `jobs`) should not pay at start-up."""
    if name in ("TrainingTrace", "TrainingTurn"):
        from openenv.core.harness import training

        return getattr(training, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _schema():
    from openenv.core.harness.training import TrainingTrace

    return TrainingTrace


def turn_counts(turns: list[dict]) -> dict:
    """A trace's size in a rollout record (wire-form turns): turns, tokens sampled, trained, the longest context."""
    return {"turns": len(turns), "sampled_tokens": sum(len(t["completion_token_ids"]) for t in turns),
            "trained_tokens": sum(sum(t["loss_mask"]) for t in turns),
            "context_tokens": max((len(t["prompt_token_ids"]) + len(t["completion_token_ids"]) for t in turns),
                                  default=0)}


def iter_traces(path: str | Path) -> Iterator[TrainingTrace]:
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield _schema().model_validate_json(line)
            except ValidationError as exc:
                raise TraceFileError(
                    f"{path}:{lineno} is not a valid OpenEnv TrainingTrace (schema v1): "
                    f"{exc.errors()[0]['msg']} at {'.'.join(map(str, exc.errors()[0]['loc'])) or 'top level'}. "
                    "Re-export it from the capture proxy or fix that line.") from None


def read_traces(path: str | Path) -> list[TrainingTrace]:
    return list(iter_traces(path))


def _line(trace: TrainingTrace) -> str:
    # Validate on the way out too: a model built with model_construct() could carry anything.
    return json.dumps(_schema().model_validate(trace.model_dump()).model_dump(mode="json"),
                      separators=(",", ":")) + "\n"


def write_traces(path: str | Path, traces: Iterable[TrainingTrace]) -> None:
    """Write all traces atomically (a temp file renamed into place): a crash leaves the old file intact."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for trace in traces:
            f.write(_line(trace))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def append_trace(path: str | Path, trace: TrainingTrace) -> None:
    """Append one trace and fsync, so a finished trace survives a crash that follows."""
    _append(path, _line(trace).encode())


def append_wire(path: str | Path, wire: dict) -> None:
    """Append a trace already in OpenEnv's wire form as dumped from a validated TrainingTrace (run_rollout's):
    written as it is. Validating and dumping it again cost the rollout pool more CPU than the rest of a rollout's
    bookkeeping together (bench/rollouts_at_scale.py)."""
    _append(path, fastjson.dumps(wire) + b"\n")


def _append(path: str | Path, line: bytes) -> None:
    with Path(path).open("ab") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
