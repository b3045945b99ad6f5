"""What a rollout's conversation repeats, held once in memory.

Every model call sends the whole conversation so far, and a trace keeps each call whole (the contract): its
prompt ids and its request's messages. Held as decoded, a 30-call rollout of a conversation growing to 400 KB is
~6 MB of repeated text and 1.5M ids. Two things make it cost about the conversation once:
- a long text (a tool's output, a file) seen before is kept as the object already held (`share_messages`); the
  usual call repeats the last one's messages and adds a few, so those are compared as one list, in C, and reused;
- an id above 256 is an int object of its own (28 B) besides its 8 B slot in a list; with one object per value,
  shared by every list in the process (`share_ids`: at most the vocabulary, ~5 MB once), a token costs its slot.
The values and the lists' types stay what they were: nothing that reads them changes. Stdlib only (the proxy's
environment imports it too).
"""

from __future__ import annotations

import threading

LONG = 256  # a text shorter than this costs less than looking it up
_IDS: list[int] = []
_IDS_LOCK = threading.Lock()
_IDS_CEILING = 1 << 20  # above every vocabulary; an id past it is left as it is


def share_messages(messages: list, before: list, seen: dict) -> list:
    """`messages` with each long text the object in `seen` (added there when new), reusing `before`'s messages
    (a call's, as this returned them) when `messages` starts with them."""
    if before and messages[:len(before)] == before:
        return before + [_share(m, seen) for m in messages[len(before):]]
    return [_share(m, seen) for m in messages]


def share_request(request: dict, before: dict | None, seen: dict) -> dict:
    """`request` (a parsed model call) with each long text in it made the object in `seen` (added there when new),
    in place; returns it. Done as a request is read, the texts it repeats are freed at once, not held beside the
    session's own while the call waits for its answer (8 calls of a 1 MB conversation in flight held 8 MB of
    them, and the heap kept that high water). A list that starts with `before`'s (the session's last request, as
    this returned it: a conversation resent) takes those elements as they are, compared in C; the rest is
    walked."""
    for key, value in request.items():
        old = before.get(key) if isinstance(before, dict) else None
        if isinstance(value, list) and isinstance(old, list) and old and value[:len(old)] == old:
            value[:len(old)] = old
            share_texts(value, seen, start=len(old))
        elif isinstance(value, str) and len(value) > LONG:
            request[key] = seen.setdefault(value, value)
        elif isinstance(value, (dict, list)):
            share_texts(value, seen)
    return request


def share_texts(value, seen: dict, start: int = 0):
    """`value`'s long texts (at any depth; a top list's from `start`) made the objects in `seen`, in place. A loop,
    not recursion: an agent's JSON may nest deep."""
    stack, first = [value], True
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            items = node.items()
        else:
            items = enumerate(node[start:] if first else node, start if first else 0)
        first = False
        for key, item in items:
            if isinstance(item, str):
                if len(item) > LONG:
                    node[key] = seen.setdefault(item, item)
            elif isinstance(item, (dict, list)):
                stack.append(item)
    return value


def _share(message, seen: dict):
    if not isinstance(message, dict):
        return message
    return {k: seen.setdefault(v, v) if isinstance(v, str) and len(v) > LONG else v for k, v in message.items()}


def share_ids(ids: list) -> list:
    """The same ids, made of the process's shared int objects (ids no vocabulary has are left as they are)."""
    if not ids or min(ids) < 0 or (top := max(ids)) >= _IDS_CEILING:
        return ids
    if top >= len(_IDS):
        with _IDS_LOCK:
            _IDS.extend(range(len(_IDS), top + 1))
    return list(map(_IDS.__getitem__, ids))


def share_trace(wire: dict) -> dict:
    """A wire-form trace's ids and repeated texts held once (in place; returns `wire`)."""
    seen: dict = {}
    before: list = []
    for turn in wire.get("turns", ()):
        for key in ("prompt_token_ids", "completion_token_ids"):
            if isinstance(turn.get(key), list):
                turn[key] = share_ids(turn[key])
        request = turn.get("request")
        if isinstance(request, dict) and isinstance(request.get("messages"), list):
            request["messages"] = before = share_messages(request["messages"], before, seen)
    return wire
