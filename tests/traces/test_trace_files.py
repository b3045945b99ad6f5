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


def test_token_ids_held_in_memory_share_one_int_object_per_value():
    """A finished trace waits in the pool for its group: its ids keep their values and lists, but each value is one
    int object for the whole process, so a token costs its list slot (8 B), not 36 B. Ids no vocabulary has
    (negative, past 2^20) are left as they are."""
    import json
    import random
    import tracemalloc

    from harness_trainer.traces.files import share_token_ids

    rng = random.Random(0)
    prompt = [rng.randrange(300, 150_000) for _ in range(20_000)]
    turns = [{"prompt_token_ids": prompt[:5_000 * k], "completion_token_ids": [rng.randrange(300, 150_000)]}
             for k in (1, 2, 3, 4)]
    odd = {"prompt_token_ids": [5, -1, 7], "completion_token_ids": [2 ** 40]}
    text = json.dumps({"turns": turns + [odd]})
    share_token_ids({"turns": [{"prompt_token_ids": [150_000]}]})  # the shared table, made once per process
    tracemalloc.start()
    try:
        wire = json.loads(text)  # as decoded from the proxy: an int object per token
        decoded = tracemalloc.get_traced_memory()[0]
        assert share_token_ids(wire) is wire
        shared = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert wire["turns"][:4] == turns and wire["turns"][4] == odd  # same values, same lists
    first, last = wire["turns"][0]["prompt_token_ids"], wire["turns"][3]["prompt_token_ids"]
    assert all(a is b for a, b in zip(first, last))  # one object per value, across turns
    tokens = sum(len(t["prompt_token_ids"]) + 1 for t in turns)
    assert decoded > 30 * tokens and shared < 10 * tokens, (decoded, shared, tokens)  # 36 B a token, then 8
