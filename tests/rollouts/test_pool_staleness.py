"""Which rollouts a weight sync stops (rollouts/pool.py: cancel_stale): only those whose oldest turn is more than
max_staleness versions old; a rollout that has not called the model yet, or whose first call came after the
syncs, goes on across it. Sessions are stubs (no agent, no proxy): what each says is its first call's version."""

from __future__ import annotations

from concurrent.futures import Future

from harness_trainer.rollouts.pool import Group, RolloutPool


class Session:
    def __init__(self, first: int | None):
        self.first, self.cancelled = first, False

    def first_version(self) -> int | None:
        return self.first

    def cancel(self) -> None:
        self.cancelled = True


def group(launched: int, firsts: list[int | None]) -> Group:
    g = Group(task=None, futures=[Future() for _ in firsts], launched=launched)  # still running
    for first in firsts:
        g.sessions.add(Session(first))
    return g


def test_a_sync_stops_only_the_rollouts_whose_oldest_turn_is_too_old(tmp_path):
    pool = RolloutPool(None, tmp_path, workers=1)
    old, recent = group(1, [1, 3, None]), group(3, [3, 3])
    pool.pending.extend([old, recent])
    # version 4, max_staleness 1: first call at 1 is 3 behind (stopped); at 3, 1 behind (goes on); none yet (goes on)
    assert pool.cancel_stale(4, 1) == 1
    assert [s.cancelled for s in old.sessions] == [True, False, False]
    assert not any(s.cancelled for s in recent.sessions) and not old.sessions.stopped  # the group goes on
    assert pool.cancel_stale(4, 1) == 0  # a stopped rollout is not counted twice
    pool.executor.shutdown()
