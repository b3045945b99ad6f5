"""What a rollout's conversation repeats, held once (traces/sharing.py): same values, same lists, less memory."""

from __future__ import annotations

import json
import random
import tracemalloc

from harness_trainer.traces.sharing import share_ids, share_messages, share_trace


def test_token_ids_share_one_int_object_per_value():
    """A finished trace waits in the pool for its group: a token then costs its list slot (8 B), not 36 B. Ids no
    vocabulary has (negative, past 2^20) are left as they are."""
    rng = random.Random(0)
    prompt = [rng.randrange(300, 150_000) for _ in range(20_000)]
    turns = [{"prompt_token_ids": prompt[:5_000 * k], "completion_token_ids": [rng.randrange(300, 150_000)]}
             for k in (1, 2, 3, 4)]
    odd = {"prompt_token_ids": [5, -1, 7], "completion_token_ids": [2 ** 40]}
    text = json.dumps({"turns": turns + [odd]})
    share_ids([150_000])  # the shared table, made once per process
    tracemalloc.start()
    try:
        wire = json.loads(text)  # as decoded from the proxy: an int object per token
        decoded = tracemalloc.get_traced_memory()[0]
        assert share_trace(wire) is wire
        shared = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert wire["turns"][:4] == turns and wire["turns"][4] == odd  # same values, same lists
    first, last = wire["turns"][0]["prompt_token_ids"], wire["turns"][3]["prompt_token_ids"]
    assert all(a is b for a, b in zip(first, last))  # one object per value, across turns
    tokens = sum(len(t["prompt_token_ids"]) + 1 for t in turns)
    assert decoded > 30 * tokens and shared < 10 * tokens, (decoded, shared, tokens)  # 36 B a token, then 8


def test_a_conversations_texts_are_held_once_across_its_calls():
    """Each call's request repeats the conversation: its long texts become one object, the messages it repeats
    are the last call's own; a call that does not start with the last one's (a compaction) is shared text by
    text. Short texts stay as they are."""
    log = "x" * 10_000
    calls = [[{"role": "user", "content": "fix it"}, {"role": "tool", "content": log + str(k)}] for k in range(3)]
    conversation = [m for call in calls for m in call]
    turns = [{"request": {"messages": json.loads(json.dumps(conversation[:2 * (k + 1)]))}} for k in range(3)]
    turns.append({"request": {"messages": json.loads(json.dumps(conversation[2:]))}})  # compacted: drops a turn
    wire = share_trace({"turns": turns})
    messages = [t["request"]["messages"] for t in wire["turns"]]
    assert messages == [conversation[:2], conversation[:4], conversation[:6], conversation[2:]]  # same values
    assert messages[2][0] is messages[1][0] is messages[0][0]  # repeated messages: the last call's own
    assert messages[3][1]["content"] is messages[2][3]["content"]  # a compacted call's texts: the same objects
    assert messages[3][0]["content"] is not messages[2][2]["content"]  # a short text: as decoded
    seen: dict = {}
    once = share_messages(json.loads(json.dumps(conversation)), [], seen)
    assert len(seen) == 3 and once == conversation



def test_a_request_read_holds_the_texts_its_session_already_holds_and_no_copy():
    """share_request, as the proxy reads each request: every long text anywhere in it (a message, a content part,
    a tool's description, a top-level system text) becomes the object already held, and a conversation that
    resends the last one's takes its elements as they are; short texts and every value stay as they were; an
    agent's deeply nested JSON is walked without recursion."""
    from harness_trainer.traces.sharing import share_request

    def request(turns: int):
        return {"system": "rules " * 60, "n": 1, "tools": [{"description": "bash " * 80}],
                "messages": [{"role": "user", "content": "log " * 100}] + [
                    {"role": "tool", "content": [{"type": "text", "text": f"out {k} " * 100}, "ok"]}
                    for k in range(turns)]}

    seen: dict = {}
    first = share_request(request(1), None, seen)
    second = share_request(request(2), first, seen)
    other = share_request(request(2), {"messages": "not a list"}, seen)  # no usable last request: walked whole
    assert first == request(1) and second == other == request(2)
    assert second["messages"][0] is first["messages"][0] and second["messages"][1] is first["messages"][1]
    assert other["messages"][2]["content"][0]["text"] is second["messages"][2]["content"][0]["text"]
    assert other["messages"][0]["content"] is first["messages"][0]["content"]
    assert other["system"] is first["system"] and other["tools"][0]["description"] is first["tools"][0]["description"]
    deep: list = ["x" * 300]
    for _ in range(5000):
        deep = [deep]
    share_request({"messages": deep}, None, seen)
    assert len(seen) == 6
