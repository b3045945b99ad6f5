"""A rollout's TrainingTrace with each token once: how the proxy ships a trace to the trainer.

Every model call resends the conversation so far, so a TrainingTrace (each turn's whole prompt, loss mask and
request) grows with the square of a rollout's length: 60 turns to a 122k-token context are ~3.7M prompt ids for
~1M unique tokens. The compact form is the same turns, in the same order, each as what it adds to an earlier turn:

    {"form": "compact", "schema_version": 1, "turns": [
        {"node_id": "s:3",
         "base": "s:1",                    # an earlier turn whose prompt+completion starts this turn's prompt; null
                                           # for a root (a first call, a rewritten history)
         "prompt_suffix": [...],           # the prompt's ids after the base's prompt+completion (all, for a root)
         "completion_token_ids": [...], "per_token_logps": [...],
         "request": {"extends": 12,        # the base's first 12 messages, then these (absent: the whole list)
                     "messages": [...],
                     "same_tools": true},  # or "tools": [...] (the request's own)
         "response": {...}, "metadata": {...}},                   # as in the TrainingTrace
    ...]}

    prompt(t)   = prompt(base) + completion(base) + prompt_suffix(t)
    loss_mask   = 0 for each prompt id, 1 for each completion id (the capture trains every sampled token)

`expand` gives OpenEnv's TrainingTrace wire form, exactly what the proxy's GET /sessions/{id}/trace answers.
Stdlib only: the proxy's environment imports it too.
"""

from __future__ import annotations

COMPACT = "compact"


def is_compact(wire) -> bool:
    return isinstance(wire, dict) and wire.get("form") == COMPACT


def expand(wire: dict) -> dict:
    """OpenEnv's TrainingTrace wire form of a compact trace (a trace already whole is returned as it is). Raises
    ValueError when a turn's base is not an earlier turn, or a request extends more messages than its base had."""
    if not is_compact(wire):
        return wire
    done: dict[str, dict] = {}  # node id -> its whole turn
    turns = []
    for number, turn in enumerate(wire.get("turns") or []):
        try:
            whole = _whole_turn(turn, done)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"compact trace turn {number}: missing or malformed {exc}") from None
        done[whole["node_id"]] = whole
        turns.append(whole)
    return {"schema_version": wire.get("schema_version", 1), "turns": turns}


def _whole_turn(turn: dict, done: dict[str, dict]) -> dict:
    base_id = turn.get("base")
    if base_id is None:
        base, prompt = None, list(turn["prompt_suffix"])
    elif base_id in done:
        base = done[base_id]
        prompt = base["prompt_token_ids"] + base["completion_token_ids"] + turn["prompt_suffix"]
    else:
        raise ValueError(f"compact trace turn {turn.get('node_id')!r}: its base {base_id!r} is not an earlier turn")
    completion = turn["completion_token_ids"]
    return {"node_id": turn["node_id"], "prompt_token_ids": prompt, "completion_token_ids": completion,
            "per_token_logps": turn["per_token_logps"], "loss_mask": [0] * len(prompt) + [1] * len(completion),
            "request": whole_request(turn["request"], base and base["request"]),
            "response": turn["response"], "metadata": turn["metadata"]}


def whole_request(delta: dict, before: dict | None) -> dict:
    """The request a turn sent, from what it adds to `before` (its base's whole request)."""
    messages = delta.get("messages") or []
    if "extends" in delta:
        shared = (before or {}).get("messages") or []
        if not isinstance(delta["extends"], int) or not 0 <= delta["extends"] <= len(shared):
            raise ValueError(f"a request extends {delta['extends']!r} messages of a base that has {len(shared)}")
        messages = shared[:delta["extends"]] + messages  # the base's message objects, shared
    tools = (before or {}).get("tools") if delta.get("same_tools") else delta.get("tools")
    return {"messages": messages, "tools": tools}
