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
from harness_trainer.traces.prefixes import longest_prefix_parents, root_break
from harness_trainer.traces.sharing import share_messages

SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
TOOLS = ("tools",)  # Session.shared's key for the last tool list (every other key is a text)


@dataclass
class Call:
    index: int  # arrival order within the session
    dialect: str
    stream: bool
    policy_version: int
    n_tools: int
    request: dict  # {"messages": [...], "tools": [...] | None} as sent upstream (chat form)
    sampling_params: dict
    requested_sampling_params: dict
    prompt_token_ids: Sequence[int]  # arrays once stored (__post_init__)
    completion_token_ids: Sequence[int]
    per_token_logps: Sequence[float]
    message: dict
    finish_reason: str | None
    problem: str | None = None  # why it cannot be trained on
    model: str = ""  # the model name it was sampled from (a LoRA adapter's name, with the lora sync)
    harness_session_id: str | None = None
    started: float = 0.0
    finished: float = 0.0

    def __post_init__(self):
        # C arrays, not lists: a list of ids costs ~36 bytes a token (a pointer and an int object), an array 4
        # (8 a logprob), and the cyclic GC has nothing to walk. A proxy keeps every call of every rollout it
        # serves: 1,024 rollouts of 30 calls averaging 25k prompt tokens are 27 GB as lists, 3 GB as arrays.
        self.prompt_token_ids = compact(self.prompt_token_ids, "i")  # 'i': 32 bits, past every vocabulary
        self.completion_token_ids = compact(self.completion_token_ids, "i")
        self.per_token_logps = compact(self.per_token_logps, "d")  # doubles: every logprob exactly as sent

    @property
    def full(self) -> Sequence[int]:
        return self.prompt_token_ids + self.completion_token_ids


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
    graph_of: tuple | None = field(default=None, repr=False)  # (calls, parents, roles): graph()'s last answer

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
        """parents() and roles() of the calls so far, computed once per number of calls: a rollout's end asks for
        its trace and its graph, each of which walked every token of every call twice."""
        if self.graph_of is None or self.graph_of[0] != len(self.calls):
            parent = parents(self.calls)
            self.graph_of = (len(self.calls), parent, roles(self.calls, parent))
        return self.graph_of[1], self.graph_of[2]

    def node_id(self, call: Call) -> str:
        return f"{self.id}:{call.index}"


def parents(calls: list[Call]) -> dict[int, int | None]:
    """index -> parent index, by longest exact prefix of prompt+completion (independent of order)."""
    found = longest_prefix_parents([c.prompt_token_ids for c in calls], [c.full for c in calls],
                                   eligible=[bool(c.prompt_token_ids) for c in calls])
    return {call.index: None if j is None else calls[j].index for call, j in zip(calls, found)}


def roles(calls: list[Call], parent: dict[int, int | None] | None = None) -> dict[int, str]:
    """index -> 'agent' | 'auxiliary' | 'discarded' (`parent`: parents(calls), when already known)."""
    parent = parent if parent is not None else parents(calls)
    continued = {p for p in parent.values() if p is not None}
    any_tools = any(c.n_tools for c in calls)
    same_prompt: dict[tuple, list[Call]] = {}
    for c in calls:
        same_prompt.setdefault(tuple(c.prompt_token_ids), []).append(c)
    result = {}
    for c in calls:
        if any_tools and not c.n_tools:
            result[c.index] = "auxiliary"
            continue
        siblings = same_prompt[tuple(c.prompt_token_ids)]
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
        # a shallow copy: the lists are only serialised (asdict's deep copy of every prompt cost as much again)
        entry = dict(vars(c)) if ids else {k: v for k, v in vars(c).items() if k not in GRAPH_LEAVES_OUT}
        if ids:  # the wire form: plain lists
            entry.update({k: plain(entry[k]) for k in ("prompt_token_ids", "completion_token_ids", "per_token_logps")})
        else:
            entry.update(prompt_tokens=len(c.prompt_token_ids), completion_tokens=len(c.completion_token_ids))
        entry.update(node_id=session.node_id(c), role=role[c.index],
                     parent=None if parent[c.index] is None else f"{session.id}:{parent[c.index]}")
        if role[c.index] == "agent":
            if parent[c.index] is None and before is not None:
                entry["root_break"] = root_break(c.prompt_token_ids, before.prompt_token_ids, before.full,
                                                 bool((before.message or {}).get("reasoning")))
            before = c
        calls.append(entry)
    roots = [c["node_id"] for c in calls if c["parent"] is None and c["role"] == "agent"]
    return {"session": session.summary(), "calls": calls, "roots": roots}


# The model never acted in the rollout: its score says nothing of the policy (rollouts/session.py: unscorable).
NO_AGENT_TURNS = "no agent turns were captured"
GRAPH_LEAVES_OUT = ("prompt_token_ids", "completion_token_ids", "per_token_logps", "request", "message")


def training_trace(session: Session) -> dict:
    """OpenEnv TrainingTrace (schema v1) wire form: agent turns only, prompt masked 0, completion 1."""
    doc = rollout_document(session)
    agent = [c for c in doc["calls"] if c["role"] == "agent"]
    if not agent:
        raise NotTrainable(f"{NO_AGENT_TURNS}: wrong base URL, unresolved model, or auth rejected")
    broken = [c for c in agent if c["problem"]]
    if broken:
        raise NotTrainable(f"call {broken[0]['index']} has no exact capture: {broken[0]['problem']}")
    turns = []
    for c in agent:
        turns.append({
            "node_id": c["node_id"],
            "prompt_token_ids": c["prompt_token_ids"],
            "completion_token_ids": c["completion_token_ids"],
            "per_token_logps": c["per_token_logps"],
            "loss_mask": [0] * len(c["prompt_token_ids"]) + [1] * len(c["completion_token_ids"]),
            "request": c["request"],
            "response": {"choices": [{"message": c["message"], "finish_reason": c["finish_reason"]}]},
            "metadata": {"node_id": c["node_id"], "index": c["index"], "model": c["model"] or session.model,
                         "n_tools": c["n_tools"], "sampling_params": c["sampling_params"],
                         "requested_sampling_params": c["requested_sampling_params"],
                         "policy_version": c["policy_version"], "harness_session_id": c["harness_session_id"],
                         "parent": c["parent"], "dialect": c["dialect"], "stream": c["stream"],
                         **({"root_break": c["root_break"]} if "root_break" in c else {})},
        })
    return {"schema_version": 1, "turns": turns}
