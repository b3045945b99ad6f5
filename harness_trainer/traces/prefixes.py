"""Parent of each model call: the call whose prompt+completion is the longest exact prefix of its prompt.

Comparing every pair of calls token by token is quadratic in turns times tokens: 200 turns of a 100k-token
history is billions of comparisons. Instead every sequence gets chained hashes of its whole 64-token chunks
(C-speed tuple hashing, one Python step per chunk), so any prefix of length l is named by

    (l, hash of its first l // 64 chunks, the tuple of its last l % 64 tokens)

and "is sequence c a prefix of prompt p" is one dict look-up. Each call tries the distinct candidate lengths
that fit its prompt, longest first; a hit is confirmed token by token once (hashes can collide). Cost: linear
in the tokens, plus (turns x distinct lengths) look-ups. Torch- and numpy-free: the proxy uses it too.
"""

from __future__ import annotations

from collections.abc import Sequence

CHUNK = 64


def _chunk_hashes(seq: Sequence[int]) -> list[int]:
    """hashes[j] names seq[:j * CHUNK]."""
    hashes, h = [0], 0
    for start in range(0, len(seq) - CHUNK + 1, CHUNK):
        h = hash((h, tuple(seq[start:start + CHUNK])))
        hashes.append(h)
    return hashes


def _key(seq: Sequence[int], hashes: list[int], length: int) -> tuple:
    whole = length // CHUNK
    return length, hashes[whole], tuple(seq[whole * CHUNK:length])


def longest_prefix_parents(prompts: list[Sequence[int]], fulls: list[Sequence[int]],
                           eligible: list[bool] | None = None) -> list[int | None]:
    """For each i, the index j != i whose fulls[j] is the longest exact prefix of prompts[i] (None if none);
    among identical fulls the earliest. `eligible[j]` False keeps j from being anyone's parent."""
    by_key: dict[tuple, int] = {}
    for j, full in enumerate(fulls):
        if eligible is None or eligible[j]:
            by_key.setdefault(_key(full, _chunk_hashes(full), len(full)), j)
    lengths = sorted({key[0] for key in by_key}, reverse=True)
    parents: list[int | None] = []
    for i, prompt in enumerate(prompts):
        hashes, found = _chunk_hashes(prompt), None
        for length in lengths:
            if length > len(prompt):
                continue
            key = _key(prompt, hashes, length)
            j = by_key.get(key)
            if j is not None and j == i:  # a call is never its own parent: look for an identical other
                j = next((k for k, f in enumerate(fulls) if k != i and (eligible is None or eligible[k])
                          and len(f) == length and list(f) == list(prompt[:length])), None)
            if j is not None and list(fulls[j]) == list(prompt[:length]):
                found = j
                break
        parents.append(found)
    return parents


def common_prefix(a: Sequence[int], b: Sequence[int], block: int = 512) -> int:
    """The length of the longest common prefix: compared a block at a time at C speed, token by token only in
    the block that differs (a Python step per token cost a proxy 4 % of its time at 64 rollouts in flight)."""
    n, at = min(len(a), len(b)), 0
    while at < n:
        end = min(n, at + block)
        x, y = a[at:end], b[at:end]
        if (x != y) if type(x) is type(y) else (list(x) != list(y)):  # an array never equals a list
            return next(k for k in range(at, end) if a[k] != b[k])
        at = end
    return n


def root_break(prompt: Sequence[int], before_prompt: Sequence[int], before_full: Sequence[int],
               reasoned: bool) -> dict:
    """Why a call that is not the first has no parent: where its prompt leaves the call before it.

    Inside that call's sampled tokens, after it reasoned: the chat template dropped the reasoning from the
    history (Qwen3's does before the last user query), so the model never sees its own sampled tokens again
    and the two turns cannot share a prefix. Elsewhere inside them: the reply re-rendered otherwise than it
    was sampled. Before them: the agent rewrote the history (compaction, a sub-agent, a new conversation)."""
    at = common_prefix(prompt, before_full)
    if at >= len(before_prompt):
        reason = "reasoning dropped from the history" if reasoned else "the reply re-rendered otherwise than sampled"
    else:
        reason = "history rewritten"
    return {"at": at, "prompt_tokens": len(before_prompt), "reason": reason}


class PrefixIndex:
    """Sequences (arrays of ids) added one at a time; `longest(seq)` is the added one that is the longest exact
    prefix of `seq`, among equal ones the first added. The proxy keeps each call's prompt+completion here as it is
    recorded, so a new call finds its prefix parent at once and is stored as what it adds to it.

    A sequence is named as in `longest_prefix_parents` (its length, the chained hashes of its whole chunks, and its
    tail), each chunk hashed as bytes: one C call per 64 ids. Only one key per sequence is kept, never its ids."""

    def __init__(self):
        self._by_key: dict[tuple[int, int], object] = {}
        self._lengths: list[int] = []  # distinct lengths added, longest first

    @staticmethod
    def hashes(seq, known: list[int] | None = None) -> list[int]:
        """hashes[j] names seq[:j * CHUNK]; `known`: the hashes of a prefix of seq, continued from."""
        hashes = list(known) if known else [0]
        h = hashes[-1]
        for start in range((len(hashes) - 1) * CHUNK, len(seq) - CHUNK + 1, CHUNK):
            h = hash((h, seq[start:start + CHUNK].tobytes()))
            hashes.append(h)
        return hashes

    @staticmethod
    def key(seq, hashes: list[int], length: int) -> tuple[int, int]:
        whole = length // CHUNK
        return length, hash((hashes[whole], seq[whole * CHUNK:length].tobytes()))

    def add(self, seq, hashes: list[int], value) -> None:
        if self._by_key.setdefault(self.key(seq, hashes, len(seq)), value) is value and len(seq) not in self._lengths:
            self._lengths.append(len(seq))
            self._lengths.sort(reverse=True)

    def longest(self, seq, hashes: list[int], confirm) -> object | None:
        """The value of the longest added prefix of seq for which `confirm(value, length)` holds (a hash can
        collide: the caller compares the ids once)."""
        for length in self._lengths:
            if length <= len(seq):
                value = self._by_key.get(self.key(seq, hashes, length))
                if value is not None and confirm(value, length):
                    return value
        return None
