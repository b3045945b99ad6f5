"""Sessions, their captured calls, the rollout graph and the TrainingTrace export.

One session = one rollout = one agent run. Its id is the API key the agent is given. Each finished model
call becomes a `Call`; the graph over calls is rebuilt from token ids alone, so arrival order never matters:

  parent(c)   = the call whose prompt+sampled ids is the longest exact prefix of c's prompt
  discarded   = a call whose exact prompt was sent again (a retry) and that nothing continued
  auxiliary   = a call without tools in a rollout where other calls had tools (title generators, summaries)
  roots       = calls with no parent: the first call, and every rewritten history (compaction, sub-agents)

The export is OpenEnv's TrainingTrace wire form (schema v1), built as plain dicts: the proxy's environment has
no openenv; the trainer validates with OpenEnv's own model.
"""

from __future__ import annotations

import re
import struct
import time
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from harness_trainer._exceptions import NotTrainable
from harness_trainer.proxy.capture import SamplingPolicy
from harness_trainer.traces.compact import COMPACT, expand
from harness_trainer.traces.prefixes import PrefixIndex, longest_prefix_parents, root_break
from harness_trainer.traces.sharing import share_messages

SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
TOOLS = ("tools",)  # Session.shared's key for the last tool list (every other key is a text)


@dataclass(eq=False)  # one object a call: compared by identity (its ids would be compared token by token)
class Call:
    index: int  # arrival order within the session
    dialect: str
    stream: bool
    policy_version: int
    n_tools: int
    request: dict  # {"messages": [...], "tools": [...] | None} as sent upstream (chat form)
    sampling_params: dict
    requested_sampling_params: dict
    prompt_suffix: Sequence[int]  # the prompt's ids after `base`'s prompt+completion (or `repeats`' prompt); else all
    completion_token_ids: Sequence[int]
    per_token_logps: Sequence[float]
    message: dict
    finish_reason: str | None
    problem: str | None = None  # why it cannot be trained on
    model: str = ""  # the model name it was sampled from (a LoRA adapter's name, with the lora sync)
    harness_session_id: str | None = None
    started: float = 0.0
    finished: float = 0.0
    # Set when the session records it (Session.attach): its prefix parent, and what names its whole prompt.
    base: Call | None = field(default=None, repr=False)
    # With no base: the earlier call whose whole prompt this one's starts with (an agent's retry, a prompt sent
    # again). Not a parent (its answer is not in this prompt): only where this call's ids are kept.
    repeats: Call | None = field(default=None, repr=False)
    prompt_key: tuple | None = field(default=None, repr=False)
    prompt_tokens: int = -1  # the whole prompt's length

    def __post_init__(self):
        # C arrays, not lists: a list of ids costs ~36 bytes a token (a pointer and an int object), an array 4
        # (8 a logprob), and the cyclic GC has nothing to walk. And each call keeps only what it adds to its
        # prefix parent: every call resends the whole conversation, so whole prompts grow with the square of a
        # rollout's length (60 turns to 122k tokens: 52x its unique tokens); suffixes hold each token once.
        self.prompt_suffix = compact(self.prompt_suffix, "i")  # 'i': 32 bits, past every vocabulary
        self.completion_token_ids = compact(self.completion_token_ids, "i")
        self.per_token_logps = compact(self.per_token_logps, "d")  # doubles: every logprob exactly as sent
        if self.prompt_tokens < 0:
            before = self.base.full_tokens if self.base else self.repeats.prompt_tokens if self.repeats else 0
            self.prompt_tokens = len(self.prompt_suffix) + before

    @property
    def full_tokens(self) -> int:
        return self.prompt_tokens + len(self.completion_token_ids)

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        """The whole prompt, joined from the chain of prefix parents (a new array each time: read, don't keep)."""
        pieces, at = [self.prompt_suffix], self
        while at.base is not None or at.repeats is not None:
            if at.base is not None:
                pieces.append(at.base.completion_token_ids)
            at = at.base or at.repeats
            pieces.append(at.prompt_suffix)
        return joined(reversed(pieces))

    @property
    def full(self) -> Sequence[int]:
        return joined((self.prompt_token_ids, self.completion_token_ids))


# A Call's fields that say how it is stored, not what was captured: never exported as they are.
STORAGE = ("base", "repeats", "prompt_key", "prompt_suffix", "prompt_tokens")


def captured(call: Call) -> dict:
    """The call's captured fields (a shallow copy), without how it is stored."""
    return {k: v for k, v in vars(call).items() if k not in STORAGE}


def joined(pieces) -> Sequence[int]:
    pieces = list(pieces)
    if not all(isinstance(p, array) for p in pieces):  # an engine's odd ids, kept as they came (Call.problem)
        return [x for p in pieces for x in p]
    out = array(pieces[0].typecode if pieces else "i")
    for piece in pieces:
        out.extend(piece)  # same type: a memcpy
    return out


def plain(values) -> list:
    return values.tolist() if isinstance(values, array) else values


def compact(values, typecode: str):
    """An array of `values`, or the values as they are when they do not fit one (an engine that sent None
    or a float where an id belongs: the call's `problem` says so, the proxy must not fail on it)."""
    if isinstance(values, array):
        return values
    try:  # packed first, then read as the array's bytes: 1.7x faster than array(typecode, list) at 100k ids
        return array(typecode, struct.pack(f"{len(values)}{typecode}", *values))
    except (TypeError, OverflowError, struct.error):
        return list(values)


@dataclass
class Session:
    id: str
    upstream: str
    model: str
    policy: SamplingPolicy = field(default_factory=SamplingPolicy)
    max_model_calls: int | None = None
    policy_version: int = 0
    sampling_model: str | None = None  # where new calls go (the current LoRA adapter); None: `model`
    metadata: dict = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    calls: list[Call] = field(default_factory=list)
    started_calls: int = 0  # calls admitted (in flight or finished), for the budget
    stops: list[str] = field(default_factory=list)  # clean stops the proxy answered (budget, context), why
    engine_failure: str | None = None  # why its latest call got no answer from the engine; None once one did
    shared: dict = field(default_factory=dict, repr=False)  # texts and tool lists its calls hold once (share)
    last_messages: list = field(default_factory=list, repr=False)  # the last call's, as share() kept them
    last_request: dict | None = field(default=None, repr=False)  # the last request read, as share_request left it
    graph_of: tuple | None = field(default=None, repr=False)  # (calls, parents, roles): graph()'s last answer
    prefixes: PrefixIndex = field(default_factory=PrefixIndex, repr=False)  # every call's prompt+completion
    prompts: PrefixIndex = field(default_factory=PrefixIndex, repr=False)  # every call's prompt
    ids_text: object = field(default=None, repr=False)  # its latest prompt's id text (fastjson.IdsText), or None

    def __post_init__(self):
        given, self.calls = self.calls, []
        for call in given:
            self.attach(call)

    def attach(self, call: Call) -> None:
        """`call` becomes the session's latest. Its prefix parent is the earlier call whose prompt+completion is the
        longest exact prefix of its prompt (a call can only continue an answer its agent already had, and a call
        is recorded before its agent gets its last byte), and the call keeps only what it adds to it. With none, a
        call whose whole prompt it repeats (a retry) holds what they share (`repeats`)."""
        fresh = call.base is None and call.repeats is None
        prompt = call.prompt_suffix if fresh else call.prompt_token_ids  # a new call: no copy
        call.base, call.repeats, call.prompt_suffix, call.prompt_key = None, None, prompt, None
        call.prompt_tokens = len(prompt)
        if len(prompt) and isinstance(prompt, array) and isinstance(call.completion_token_ids, array):
            hashes = PrefixIndex.hashes(prompt)
            call.prompt_key = PrefixIndex.key(prompt, hashes, len(prompt))
            base = self.prefixes.longest(prompt, hashes, lambda c, n: c.full == prompt[:n])
            if base is not None:
                call.base, call.prompt_suffix = base, prompt[base.full_tokens:]
            elif (same := self.prompts.longest(prompt, hashes, lambda c, n: c.prompt_token_ids == prompt[:n])):
                call.repeats, call.prompt_suffix = same, prompt[same.prompt_tokens:]
            self.prompts.add(prompt, hashes, call)
            full = joined((prompt, call.completion_token_ids))
            self.prefixes.add(full, PrefixIndex.hashes(full, hashes), call)
        self.calls.append(call)

    def share(self, request: dict) -> dict:
        """Each call's request repeats the conversation so far and the same tools: a long text or a tool list
        seen before in this session is kept as the object already held, so the session's requests cost its
        conversation once, not once per call (30 calls of a conversation growing to 400 KB: 6 MB -> 0.4 MB)."""
        seen = self.shared
        self.last_messages = messages = share_messages(request.get("messages") or [], self.last_messages, seen)
        tools = request.get("tools")
        if tools:
            tools = seen[TOOLS] = seen[TOOLS] if tools == seen.get(TOOLS) else tools
        return {"messages": messages, "tools": tools}

    def summary(self) -> dict:
        return {"id": self.id, "upstream": self.upstream, "model": self.model, "policy": asdict(self.policy),
                "max_model_calls": self.max_model_calls, "policy_version": self.policy_version,
                "sampling_model": self.sampling_model or self.model, "metadata": self.metadata,
                "created": self.created, "calls": len(self.calls),
                "first_version": self.calls[0].policy_version if self.calls else None,  # its oldest turn's
                "stops": list(self.stops), "engine_failure": self.engine_failure}

    def graph(self) -> tuple[dict[int, int | None], dict[int, str]]:
        """Each call's parent (its base) and roles(), computed once per number of calls."""
        if self.graph_of is None or self.graph_of[0] != len(self.calls):
            parent = {c.index: None if c.base is None else c.base.index for c in self.calls}
            self.graph_of = (len(self.calls), parent, roles(self.calls, parent))
        return self.graph_of[1], self.graph_of[2]

    def node_id(self, call: Call) -> str:
        return f"{self.id}:{call.index}"


def parents(calls: list[Call]) -> dict[int, int | None]:
    """index -> parent index, by longest exact prefix of prompt+completion, from the ids alone in any order (a
    session's own graph is its calls' bases: the same links wherever a parent came first, as it does in a run)."""
    found = longest_prefix_parents([c.prompt_token_ids for c in calls], [c.full for c in calls],
                                   eligible=[bool(c.prompt_token_ids) for c in calls])
    return {call.index: None if j is None else calls[j].index for call, j in zip(calls, found)}


def roles(calls: list[Call], parent: dict[int, int | None] | None = None) -> dict[int, str]:
    """index -> 'agent' | 'auxiliary' | 'discarded' (`parent`: parents(calls), when already known)."""
    parent = parent if parent is not None else parents(calls)
    continued = {p for p in parent.values() if p is not None}
    any_tools = any(c.n_tools for c in calls)
    same_prompt: dict[tuple, list[Call]] = {}
    for c in calls:  # grouped by the name of their prompt, then confirmed by its ids (a hash can collide)
        group = same_prompt.setdefault(c.prompt_key or ("ids", tuple(c.prompt_token_ids)), [])
        if group and list(group[0].prompt_token_ids) != list(c.prompt_token_ids):
            group = same_prompt.setdefault(("ids", tuple(c.prompt_token_ids)), [])
        group.append(c)
    prompt_of = {id(c): group for group in same_prompt.values() for c in group}
    result = {}
    for c in calls:
        if any_tools and not c.n_tools:
            result[c.index] = "auxiliary"
            continue
        siblings = prompt_of[id(c)]
        if len(siblings) > 1 and c.index not in continued:
            # A retry: keep the one that was continued, or else the last one sent.
            keep = [s for s in siblings if s.index in continued] or [max(siblings, key=lambda s: s.index)]
            if c not in keep:
                result[c.index] = "discarded"
                continue
        result[c.index] = "agent"
    return result


def rollout_document(session: Session, ids: bool = True) -> dict:
    """The full capture: every call with its graph links and role, trainable or not. With ids=False the graph
    alone (GET /sessions/{id}/graph): each call's links, role and token counts, without its token ids, request
    and answer, so reading it is linear in the calls, not in every prompt's tokens."""
    parent, role = session.graph()
    calls, before = [], None  # before: the last agent call so far, for why a later root broke from it
    for c in sorted(session.calls, key=lambda c: c.index):
        entry = captured(c) if ids else {k: v for k, v in captured(c).items() if k not in GRAPH_LEAVES_OUT}
        if ids:  # the wire form: plain lists
            entry.update(prompt_token_ids=plain(c.prompt_token_ids), completion_token_ids=plain(c.completion_token_ids),
                         per_token_logps=plain(c.per_token_logps))
        else:
            entry.update(prompt_tokens=c.prompt_tokens, completion_tokens=len(c.completion_token_ids))
        entry.update(node_id=session.node_id(c), role=role[c.index],
                     parent=None if parent[c.index] is None else f"{session.id}:{parent[c.index]}")
        if role[c.index] == "agent":
            if parent[c.index] is None and before is not None:
                entry["root_break"] = why_root(c, before)
            before = c
        calls.append(entry)
    roots = [c["node_id"] for c in calls if c["parent"] is None and c["role"] == "agent"]
    return {"session": session.summary(), "calls": calls, "roots": roots}


def why_root(call: Call, before: Call) -> dict:
    return root_break(call.prompt_token_ids, before.prompt_token_ids, before.full,
                      bool((before.message or {}).get("reasoning")))


# The model never acted in the rollout: its score says nothing of the policy (rollouts/session.py: unscorable).
NO_AGENT_TURNS = "no agent turns were captured"
GRAPH_LEAVES_OUT = ("prompt_token_ids", "completion_token_ids", "per_token_logps", "request", "message")


def training_trace(session: Session) -> dict:
    """OpenEnv TrainingTrace (schema v1) wire form: agent turns only, each whole, prompt masked 0, completion 1."""
    return expand(compact_trace(session))


def compact_trace(session: Session) -> dict:
    """The TrainingTrace's turns with each token once (traces/compact.py): a turn is what it adds to its nearest
    ancestor among the trace's turns (its `base`), its prompt's new ids and its request's new messages."""
    parent, role = session.graph()
    agent = [c for c in sorted(session.calls, key=lambda c: c.index) if role[c.index] == "agent"]
    if not agent:
        raise NotTrainable(f"{NO_AGENT_TURNS}: wrong base URL, unresolved model, or auth rejected")
    broken = [c for c in agent if c.problem]
    if broken:
        raise NotTrainable(f"call {broken[0].index} has no exact capture: {broken[0].problem}")
    shipped, turns, before = {c.index for c in agent}, [], None
    for c in agent:
        pieces, base = [c.prompt_suffix], c.base
        while base is not None and base.index not in shipped:  # a parent left out (a retry, an auxiliary call)
            pieces += (base.completion_token_ids, base.prompt_suffix)
            base = base.base
        if base is None:  # no shipped ancestor: the whole prompt (a root's may repeat another call's)
            pieces = [c.prompt_token_ids]
        metadata = {"node_id": session.node_id(c), "index": c.index, "model": c.model or session.model,
                    "n_tools": c.n_tools, "sampling_params": c.sampling_params,
                    "requested_sampling_params": c.requested_sampling_params, "policy_version": c.policy_version,
                    "harness_session_id": c.harness_session_id,
                    "parent": None if parent[c.index] is None else f"{session.id}:{parent[c.index]}",
                    "dialect": c.dialect, "stream": c.stream}
        if parent[c.index] is None and before is not None:
            metadata["root_break"] = why_root(c, before)
        before = c
        turns.append({
            "node_id": session.node_id(c), "base": None if base is None else session.node_id(base),
            "prompt_suffix": plain(joined(reversed(pieces))), "completion_token_ids": plain(c.completion_token_ids),
            "per_token_logps": plain(c.per_token_logps), "request": request_delta(c.request, base and base.request),
            "response": {"choices": [{"message": c.message, "finish_reason": c.finish_reason}]},
            "metadata": metadata})
    return {"form": COMPACT, "schema_version": 1, "turns": turns}


def request_delta(request: dict, before: dict | None) -> dict:
    """`request` as what it adds to `before` (a parent's): its messages after the parent's, and its tools unless
    they are the parent's. The inverse is traces/compact.py's `whole_request`."""
    messages, tools = request.get("messages") or [], request.get("tools")
    if before is None:
        return {"messages": messages, "tools": tools}
    delta: dict = {}
    shared = before.get("messages") or []
    if len(messages) >= len(shared) and messages[:len(shared)] == shared:  # the same objects: compared by identity
        delta.update(extends=len(shared), messages=messages[len(shared):])
    else:
        delta["messages"] = messages
    if tools is before.get("tools") or tools == before.get("tools"):
        delta["same_tools"] = True
    else:
        delta["tools"] = tools
    return delta
