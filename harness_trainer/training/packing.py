"""Traces -> training sequences, exactly, and packed so no context is fed twice.

1. Chains. In one rollout's TrainingTrace, a turn's parent is the turn whose prompt+completion is the longest
   exact prefix of its prompt (no re-tokenising, no re-alignment: any drift simply starts a new root). Each
   root-to-leaf path is one chain: the leaf's prompt+completion, in which every turn on the path supervises
   its own completion span (where its loss mask is 1) with its behaviour logprobs.
2. Exactly once. A turn shared by two branches (a fork) appears in both chains but is supervised only in
   the first; every sampled token is trained exactly once.
3. Prefix tree. All chains of a step go into one token trie: context tokens merge wherever their whole
   prefix is the same (across forks of a rollout and across the G rollouts of a group, which share system
   prompt and task); sampled tokens merge only with themselves (same rollout, turn, offset). The trie is fed
   to the model in depth-first order with tree attention (a token sees exactly its ancestors: j <= i < end[j],
   tree_attention.py) and position ids = depth, which gives every token the hidden state it has in its chain:

        logp(node) = log_softmax(logits[parent(node)])[token(node)]

   so the loss and its gradients equal the one-row-per-chain computation, at the cost of unique tokens.
   The forward and backward over it, in micro-batches of bounded memory: tree_forward.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from harness_trainer.traces.prefixes import longest_prefix_parents

if TYPE_CHECKING:  # only the type: rows needs torch alone (the GPU check runs where openenv is not installed)
    from openenv.core.harness.training import TrainingTrace


@dataclass
class Chain:
    rollout: int  # index of the rollout (its advantage) in the step
    ids: list[int]
    origin: list[tuple | None]  # per position: (rollout, node_id, offset) for sampled tokens, None for context
    trained: list[bool]  # per position: supervised in this chain
    behaviour: list[float]  # per position: behaviour logprob (0.0 where not trained)
    version: list[int]  # per position: policy version that sampled it (-1 for context)
    teacher: list[float] | None = None  # per position: the teacher's logprob (distill.py; NaN where none)


def _parents(turns) -> dict[str, str | None]:
    found = longest_prefix_parents([t.prompt_token_ids for t in turns],
                                   [t.prompt_token_ids + t.completion_token_ids for t in turns])
    return {t.node_id: None if j is None else turns[j].node_id for t, j in zip(turns, found)}


def chains_from_trace(trace: TrainingTrace, rollout: int, seen: set | None = None) -> list[Chain]:
    """One chain per root-to-leaf path; `seen` (shared across calls) makes each turn supervised once."""
    turns = {t.node_id: t for t in trace.turns}
    parents = _parents(trace.turns)
    has_child = {p for p in parents.values() if p}
    seen = set() if seen is None else seen
    chains = []
    for leaf in (t for t in trace.turns if t.node_id not in has_child):
        path, node = [], leaf.node_id
        while node:
            path.append(turns[node])
            node = parents[node]
        path.reverse()
        ids = leaf.prompt_token_ids + leaf.completion_token_ids
        origin: list[tuple | None] = [None] * len(ids)
        trained, behaviour, version = [False] * len(ids), [0.0] * len(ids), [-1] * len(ids)
        teacher = [math.nan] * len(ids)
        for turn in path:
            start = len(turn.prompt_token_ids)
            supervise = (rollout, turn.node_id) not in seen
            seen.add((rollout, turn.node_id))
            v = int(turn.metadata.get("policy_version", 0) or 0)
            scored = turn.metadata.get("teacher_logps") or []
            for k, (mask, logp) in enumerate(zip(turn.loss_mask[start:], turn.per_token_logps)):
                origin[start + k] = (rollout, turn.node_id, k)
                version[start + k] = v
                if supervise and mask == 1:
                    trained[start + k], behaviour[start + k] = True, float(logp)
                    if k < len(scored) and scored[k] is not None:
                        teacher[start + k] = float(scored[k])
        chains.append(Chain(rollout, ids, origin, trained, behaviour, version, teacher))
    return chains


@dataclass
class PackedTree:
    """A prefix tree of chains, flattened in depth-first order (every parent before its children)."""
    ids: torch.Tensor  # [N] token ids
    parent: torch.Tensor  # [N] index of the parent node, -1 for roots
    depth: torch.Tensor  # [N] position ids
    trained: torch.Tensor  # [N] bool
    behaviour: torch.Tensor  # [N] behaviour logprobs (0 where not trained)
    rollout: torch.Tensor  # [N] rollout index of trained tokens (-1 otherwise)
    version: torch.Tensor  # [N] policy version that sampled the token (-1 for context)
    end: torch.Tensor  # [N] end of the node's subtree: j is an ancestor of i (or i) iff j <= i < end[j]
    chain_tokens: int = 0  # tokens the same chains would feed as separate rows
    teacher: torch.Tensor | None = None  # [N] the teacher's logprobs of trained tokens (NaN: none; distill.py)

    def __len__(self) -> int:
        return int(self.ids.numel())


@dataclass
class _Node:
    token: int
    children: dict = field(default_factory=dict)
    index: int = -1
    trained: bool = False
    behaviour: float = 0.0
    rollout: int = -1
    version: int = -1
    teacher: float = math.nan


def pack(chains: list[Chain]) -> PackedTree:
    root = _Node(-1)
    for chain in chains:
        node = root
        for pos, token in enumerate(chain.ids):
            key = (token, chain.origin[pos])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(token, version=chain.version[pos])
            if chain.trained[pos]:
                child.trained, child.behaviour, child.rollout = True, chain.behaviour[pos], chain.rollout
                child.teacher = chain.teacher[pos] if chain.teacher else math.nan
            node = child
    ids, parent, depth, trained, behaviour, rollout, version, teacher = [], [], [], [], [], [], [], []
    stack = [(child, -1, 0) for child in reversed(list(root.children.values()))]
    while stack:
        node, par, d = stack.pop()
        node.index = len(ids)
        ids.append(node.token), parent.append(par), depth.append(d), trained.append(node.trained)
        behaviour.append(node.behaviour), rollout.append(node.rollout), version.append(node.version)
        teacher.append(node.teacher)
        stack.extend((child, node.index, d + 1) for child in reversed(list(node.children.values())))
    end = list(range(1, len(ids) + 1))
    for i in range(len(ids) - 1, 0, -1):  # children after parents: one backward sweep closes every subtree
        if parent[i] >= 0 and end[i] > end[parent[i]]:
            end[parent[i]] = end[i]
    return PackedTree(torch.tensor(ids), torch.tensor(parent), torch.tensor(depth), torch.tensor(trained),
                      torch.tensor(behaviour, dtype=torch.float32), torch.tensor(rollout), torch.tensor(version),
                      torch.tensor(end), chain_tokens=sum(len(c.ids) for c in chains),
                      teacher=torch.tensor(teacher, dtype=torch.float32))


def chain_logprobs(model, chain: Chain, temperature: float = 1.0) -> torch.Tensor:
    """The naive path: one causal row per chain (for tests and benchmarks)."""
    device = next(model.parameters()).device
    ids = torch.tensor(chain.ids, device=device)[None]
    logits = model(input_ids=ids).logits[0]
    targets = torch.tensor([i for i, t in enumerate(chain.trained) if t], dtype=torch.long, device=device)
    logp = torch.log_softmax(logits[targets - 1].float() / temperature, dim=-1)
    return logp.gather(-1, ids[0, targets][:, None]).squeeze(-1)
