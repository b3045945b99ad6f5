"""Rollout graph rules on synthetic calls: parents by exact token prefix (order-independent), retries
discarded, tool-less calls auxiliary, rewritten histories as new roots; and the TrainingTrace export."""

from __future__ import annotations

import random

import pytest
from openenv.core.harness.training import TrainingTrace

from harness_trainer._exceptions import NotTrainable
from harness_trainer.proxy.session import Call, Session, parents, roles, training_trace


def call(index, prompt, completion, tools=1, problem=None):
    return Call(index=index, dialect="chat", stream=False, policy_version=index // 2, n_tools=tools,
                request={"messages": [], "tools": None}, sampling_params={"temperature": 1.0},
                requested_sampling_params={}, prompt_suffix=prompt, completion_token_ids=completion,
                per_token_logps=[-0.5] * len(completion), message={"role": "assistant", "content": "x"},
                finish_reason="stop", problem=problem)


SYSTEM = [1, 10, 11, 12, 2]
CALLS = [
    call(0, SYSTEM + [20], [30, 31]),                   # root
    call(1, SYSTEM + [20, 30, 31, 40], [32]),           # continues 0
    call(2, SYSTEM + [20, 30, 31, 40, 32, 41], [33]),   # continues 1, then retried by 5: discarded
    call(3, SYSTEM + [20, 30, 31, 40], [34]),           # fork of 1 (same prompt as 1: a retry)...
    call(4, SYSTEM + [20, 30, 31, 40, 34, 42], [35]),   # ...that was continued: so 3 is kept, a fork
    call(5, SYSTEM + [20, 30, 31, 40, 32, 41], [36]),   # the retry of 2: the last sent is kept
    call(6, [1, 99, 2], [50], tools=0),                 # title generator: auxiliary
    call(7, [1, 77, 2, 20], [60]),                      # compaction: rewritten history, a new root
]


def test_parents_by_longest_exact_prefix_in_any_order():
    expected = {0: None, 1: 0, 2: 1, 3: 0, 4: 3, 5: 1, 6: None, 7: None}
    assert parents(CALLS) == expected
    shuffled = CALLS[:]
    for seed in range(5):
        random.Random(seed).shuffle(shuffled)
        assert parents(shuffled) == expected


def test_a_sessions_graph_recorded_call_by_call_is_the_same_as_from_the_ids_alone():
    """A session finds each call's parent as it is recorded (its base, kept as a suffix of it); in arrival order
    that is what the order-independent search finds."""
    session = Session(id="s", upstream="http://u", model="tiny", calls=CALLS)
    assert session.graph()[0] == parents(CALLS)
    assert [len(c.prompt_suffix) for c in session.calls] == [6, 1, 1, 1, 1, 1, 3, 4]


def test_roles_retry_auxiliary_and_rewritten_history():
    assert roles(CALLS) == {0: "agent", 1: "agent", 2: "discarded", 3: "agent", 4: "agent", 5: "agent",
                            6: "auxiliary", 7: "agent"}


def test_uncontinued_retries_keep_the_last():
    calls = [call(0, [1, 2], [3]), call(1, [1, 2], [4]), call(2, [1, 2], [5])]
    assert roles(calls) == {0: "discarded", 1: "discarded", 2: "agent"}


def test_no_tools_anywhere_means_all_agent():
    calls = [call(0, [1, 2], [3], tools=0), call(1, [1, 2, 3, 9], [4], tools=0)]
    assert roles(calls) == {0: "agent", 1: "agent"}


def test_export_validates_with_openenv_and_masks_prompt():
    session = Session(id="s", upstream="http://u", model="tiny", calls=CALLS)
    wire = training_trace(session)
    trace = TrainingTrace.model_validate(wire)
    assert [t.node_id for t in trace.turns] == ["s:0", "s:1", "s:3", "s:4", "s:5", "s:7"]
    for turn in trace.turns:
        n = len(turn.prompt_token_ids)
        assert turn.loss_mask == [0] * n + [1] * len(turn.completion_token_ids)
    assert trace.turns[4].metadata["parent"] == "s:1" and trace.turns[0].metadata["parent"] is None
    assert trace.turns[3].metadata["policy_version"] == 2


def test_untrainable_capture_is_reported_not_exported():
    session = Session(id="s", upstream="http://u", model="tiny", calls=[call(0, [], [3], problem="no ids")])
    with pytest.raises(NotTrainable, match="no ids"):
        training_trace(session)
    with pytest.raises(NotTrainable, match="no agent turns"):
        training_trace(Session(id="e", upstream="http://u", model="tiny"))


def test_a_session_holds_its_ids_as_arrays_and_its_repeated_texts_once_and_exports_plain_lists():
    from array import array

    from harness_trainer import fastjson
    from harness_trainer.proxy.session import rollout_document

    session = Session(id="s", upstream="http://engine", model="tiny")
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    result = "pytest output " * 100  # a tool result the next calls repeat
    for k in range(3):
        messages = [{"role": "system", "content": "agent"}, {"role": "user", "content": (result + "!")[:-1]}] + \
            [{"role": "user", "content": f"turn {j}"} for j in range(k)]
        request = session.share({"messages": messages, "tools": [dict(t) for t in tools]})
        session.attach(Call(**{**vars(call(k, list(range(70_000 + k)), [7, 8])), "request": request}))
    first, last = session.calls[0], session.calls[-1]
    assert isinstance(first.prompt_suffix, array) and isinstance(first.per_token_logps, array)
    assert last.request["messages"][1]["content"] is first.request["messages"][1]["content"]
    assert last.request["tools"] is first.request["tools"] == tools
    exported = rollout_document(session)["calls"][-1]
    assert exported["prompt_token_ids"] == list(range(70_002)) and exported["per_token_logps"] == [-0.5, -0.5]
    assert type(exported["prompt_token_ids"]) is list
    assert fastjson.loads(fastjson.dumps(last.prompt_token_ids)) == list(range(70_002))
    # no call continues another's answer here: each repeats the prompt before it and holds what it adds
    assert last.base is None and last.repeats is session.calls[1] and list(last.prompt_suffix) == [70_001]
    TrainingTrace.model_validate(training_trace(session))
