"""A finished rollout on disk: its record in rollouts.jsonl and its TrainingTrace in traces.jsonl, written by
training and eval alike (the viewer and `sft --only-rewarded` read them back, joined by episode_id)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict
from pathlib import Path

from harness_trainer.rollouts.session import RolloutRecord
from harness_trainer.traces.files import TrainingTrace, append_trace, turn_counts


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
