"""A finished rollout on disk: its record in rollouts.jsonl and its TrainingTrace in traces.jsonl, written by
training and eval alike (the viewer and `sft --only-rewarded` read them back, joined by episode_id)."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from pathlib import Path

from harness_trainer import fastjson
from harness_trainer.rollouts.session import RolloutRecord
from harness_trainer.traces.files import append_wire, turn_counts


def record_line(record: RolloutRecord) -> dict:
    """A rollout record as rollouts.jsonl keeps it: the turns' token ids live once, in traces.jsonl (joined by
    episode_id); here only their counts, so the record file stays small enough to index quickly."""
    # The trace is left out before asdict, which deep-copies what it is given: copying every token id of the
    # trace only to drop it was a third of the rollout pool's CPU at 64 rollouts in flight.
    kept = dataclasses.replace(record, environment=None, training_trace=None,  # an instance is not data
                               outcome=dataclasses.replace(record.outcome, trace=[]))
    line = {k: v for k, v in asdict(kept).items() if k not in ("training_trace", "environment")}
    line["outcome"] = {k: v for k, v in line["outcome"].items() if k != "trace"}
    line.update(turn_counts((record.training_trace or {}).get("turns", [])))
    return line


def write_record(out: Path, record: RolloutRecord) -> None:
    with (out / "rollouts.jsonl").open("ab") as f:
        f.write(fastjson.dumps(record_line(record)) + b"\n")
    if record.training_trace:  # so a trace can be joined to its rollout record (e.g. sft --only-rewarded)
        turns = [{**turn, "metadata": {**turn["metadata"], "episode_id": record.episode_id}}
                 for turn in record.training_trace["turns"]]
        append_wire(out / "traces.jsonl", {**record.training_trace, "turns": turns})
