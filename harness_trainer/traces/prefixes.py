"""Parent of each model call: the call whose prompt+completion is the longest exact prefix of its prompt.

Comparing every pair of calls token by token is quadratic in turns times tokens: 200 turns of a 100k-token
history is billions of comparisons. Instead every sequence (an array of ids) gets chained hashes of its whole
64-token chunks (each chunk hashed as bytes: one C call per 64 ids), so any prefix of length l is named by

    (l, hash of its first l // 64 chunks and of its last l % 64 tokens)

and "is sequence c a prefix of prompt p" is one dict look-up (`PrefixIndex`). Each call tries the distinct
candidate lengths that fit its prompt, longest first; a hit is confirmed token by token once (hashes can collide).
Cost: linear in the tokens, plus (turns x distinct lengths) look-ups. Torch- and numpy-free: the proxy uses it
too, recording each call into an index as it comes (proxy/session.py: `Session.attach`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

CHUNK = 64


class PrefixIndex:
    """Sequences added one at a time, each with a value; `longest(seq)` is the value of the longest added
    sequence that is an exact prefix of `seq` (among equal ones, the first added that `confirm` accepts). Only a
    key per sequence is kept, never its ids."""

    def __init__(self):
        self._by_key: dict[tuple[int, int], list] = {}
        self._lengths: list[int] = []  # distinct lengths added, longest first

    @staticmethod
    def hashes(seq: array, known: list[int] | None = None) -> list[int]:
        """hashes[j] names seq[:j * CHUNK]; `known`: the hashes of a prefix of seq, continued from."""
        hashes = list(known) if known else [0]
        h = hashes[-1]
        for start in range((len(hashes) - 1) * CHUNK, len(seq) - CHUNK + 1, CHUNK):
            h = hash((h, seq[start:start + CHUNK].tobytes()))
            hashes.append(h)
        return hashes

    @staticmethod
    def key(seq: array, hashes: list[int], length: int) -> tuple[int, int]:
        whole = length // CHUNK
        return length, hash((hashes[whole], seq[whole * CHUNK:length].tobytes()))

    def add(self, seq: array, hashes: list[int], value) -> None:
        self._by_key.setdefault(self.key(seq, hashes, len(seq)), []).append(value)
        if len(seq) not in self._lengths:
            self._lengths.append(len(seq))
            self._lengths.sort(reverse=True)

    def longest(self, seq: array, hashes: list[int], confirm: Callable[[object, int], bool]):
        """The first value, longest first, for which `confirm(value, length)` holds (it compares the ids), or
        None."""
        for length in self._lengths:
            if length <= len(seq):
                for value in self._by_key.get(self.key(seq, hashes, length), ()):
                    if confirm(value, length):
                        return value
        return None


def _ids(seq: Sequence[int]) -> array | None:
    """The ids as an array, or None where they are not ids (an engine's None or float: such a call is not
    trained, and it neither has nor is a parent)."""
    if isinstance(seq, array):
        return seq
    try:
        return array("i", seq)
    except (TypeError, OverflowError):
        return None


def longest_prefix_parents(prompts: list[Sequence[int]], fulls: list[Sequence[int]],
                           eligible: list[bool] | None = None) -> list[int | None]:
    """For each i, the index j != i whose fulls[j] is the longest exact prefix of prompts[i] (None if none);
    among identical fulls the earliest. `eligible[j]` False keeps j from being anyone's parent."""
    index, full_ids = PrefixIndex(), [_ids(full) for full in fulls]
    for j, full in enumerate(full_ids):
        if full is not None and (eligible is None or eligible[j]):
            index.add(full, index.hashes(full), j)
    parents: list[int | None] = []
    for i, prompt in enumerate(map(_ids, prompts)):
        if prompt is None:
            parents.append(None)
            continue
        parents.append(index.longest(prompt, index.hashes(prompt),
                                     lambda j, n, i=i, prompt=prompt: j != i and full_ids[j] == prompt[:n]))
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

