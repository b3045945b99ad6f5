"""Traces are OpenEnv TrainingTraces in JSON lines: round trip, validation on read and write, crash-safe writes."""

from __future__ import annotations

import pytest

from harness_trainer._exceptions import TraceFileError
from harness_trainer.traces.files import TrainingTrace, append_trace, read_traces, write_traces

WIRE = {"schema_version": 1, "turns": [{
    "node_id": "a", "prompt_token_ids": [1, 2], "completion_token_ids": [3, 4, 5],
    "per_token_logps": [-0.1, -0.2, -0.3], "loss_mask": [0, 0, 1, 0, 1],
    "request": {"messages": [{"role": "user", "content": "hi"}], "tools": None},
    "response": {}, "metadata": {"index": 0, "policy_version": 3}}]}


def test_round_trip_is_exact(tmp_path):
    trace = TrainingTrace.model_validate(WIRE)
    path = tmp_path / "traces.jsonl"
    write_traces(path, [trace, TrainingTrace(turns=[])])
    append_trace(path, trace)
    back = read_traces(path)
    assert [t.model_dump() for t in back] == [trace.model_dump(), {"schema_version": 1, "turns": []},
                                             trace.model_dump()]


def test_invalid_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    bad = dict(WIRE, turns=[dict(WIRE["turns"][0], loss_mask=[1, 0, 1, 0, 1])])  # a trainable prompt token
    path.write_text(TrainingTrace.model_validate(WIRE).model_dump_json() + "\n\n"
                    + __import__("json").dumps(bad) + "\n")
    with pytest.raises(TraceFileError, match=r"bad\.jsonl:3 is not a valid OpenEnv TrainingTrace"):
        read_traces(path)


def test_write_refuses_invalid_and_keeps_old_file(tmp_path):
    path = tmp_path / "t.jsonl"
    write_traces(path, [TrainingTrace.model_validate(WIRE)])
    broken = TrainingTrace.model_construct(schema_version=1, turns=[
        dict(WIRE["turns"][0], per_token_logps=[0.5, -0.2, -0.3])])
    with pytest.raises(ValueError):
        write_traces(path, [broken])
    assert len(read_traces(path)) == 1

