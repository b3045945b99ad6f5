"""The rollout pool: groups of rollouts in flight on threads, for `harness-train` and `eval` alike.

    pool.launch(task, n, version)  n rollouts of one task (a group), each an agent or environment episode
    pool.next()                    the oldest group, once all its rollouts ended: scored, every record written
    pool.as_completed()            the groups in the order they end (eval: each written as soon as it can be)
    pool.cancel_stale(version, k)  stop the rollouts whose oldest turn is more than k policy versions old
    pool.close()                   stop what runs; a finished rollout nobody collected is still written

Staleness is measured by the trainer from the versions the proxy stamped on the turns; the pool only keeps the
version each group was launched at. A rollout that raises is logged and left out of its group, except a
CaptureContractError (a capture that breaks the trace contract), which stops the caller.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from harness_trainer._exceptions import CaptureContractError
from harness_trainer.openfiles import raise_open_files_limit
from harness_trainer.rollouts.records import write_record
from harness_trainer.rollouts.session import RolloutRecord, cancelled_record, run_rollout

log = logging.getLogger("harness_trainer")


class GroupSessions(list):
    """The live sessions of one group. Once cancelled, a session registering late is cancelled on arrival."""
    stopped = False

    def add(self, session) -> None:
        self.append(session)
        if self.stopped:
            session.cancel()

    def cancel_all(self) -> int:
        self.stopped = True
        count = 0
        for session in list(self):
            if not session.cancelled:
                session.cancel()
                count += 1
        return count


@dataclass
class Group:
    """One task's rollouts: launched together, scored together (their advantages are relative to each other)."""
    task: object  # a Task, or a white-box dataset row
    futures: list[Future]
    launched: int  # the policy version when it was launched
    episodes: list[str] = field(default_factory=list)  # each rollout's episode id, in the futures' order
    sessions: GroupSessions = field(default_factory=GroupSessions)
    records: list[RolloutRecord] = field(default_factory=list)  # filled when collected

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def cancel(self) -> int:
        """Rollouts not started never start; running ones are stopped (they end "cancelled")."""
        return sum(f.cancel() for f in self.futures) + self.sessions.cancel_all()


class RolloutPool:
    def __init__(self, factory, out: Path, workers: int, score: Callable[[list, object], None] | None = None,
                 on_launch: Callable[[int], None] | None = None, on_rollout: Callable[[object], None] | None = None):
        """factory: the session factory (rollouts/session.py); out: where rollouts.jsonl and traces.jsonl go;
        score(records, task): a group's rewards, in place, before anything is written (None: the verifier's as
        they are); on_launch(n) and on_rollout(record, exception or a cancelled marker): progress hooks."""
        raise_open_files_limit()  # each rollout in flight holds descriptors here: 1,024 is ~200 rollouts
        self.factory, self.out, self.score = factory, Path(out), score
        self.on_launch, self.on_rollout = on_launch, on_rollout
        self.executor = ThreadPoolExecutor(workers)
        self.pending: deque[Group] = deque()

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def launch(self, task, n: int, episode: str, version: int = 0) -> Group:
        """n rollouts of `task`, named `{episode}-{i}`."""
        group = Group(task, [], version, episodes=[f"{episode}-{i}" for i in range(n)])
        group.futures = [self.executor.submit(run_rollout, self.factory, task, name, group.sessions.add)
                         for name in group.episodes]
        if self.on_launch:
            self.on_launch(n)
        if self.on_rollout:
            for future in group.futures:
                future.add_done_callback(self._rollout_done)
        self.pending.append(group)
        return group

    def _rollout_done(self, future: Future) -> None:
        if future.cancelled():  # never started: stale before its turn
            self.on_rollout(SimpleNamespace(status="cancelled"))
        else:
            self.on_rollout(future.exception() or future.result())

    def next(self) -> Group:
        """The oldest group, collected (an interrupt while it waits leaves it pending, so close() stops it)."""
        group = self.pending[0]
        self._collect(group)
        self.pending.popleft()
        return group

    def as_completed(self) -> Iterator[Group]:
        """Every pending group, collected, in the order they end."""
        while self.pending:
            ready = next((g for g in self.pending if g.done()), None)
            if ready is None:
                wait([f for g in self.pending for f in g.futures if not f.done()], return_when=FIRST_COMPLETED)
                continue
            self._collect(ready)
            self.pending.remove(ready)
            yield ready

    def _collect(self, group: Group) -> None:
        records = []
        for future, episode in zip(group.futures, group.episodes):
            if future.cancelled():  # stopped before it started: counted as cancelled like a running one
                records.append(cancelled_record(group.task.name, episode))
                continue
            try:
                records.append(future.result())
            except CaptureContractError:
                raise
            except Exception as exc:  # a failed rollout never stops the caller
                log.warning("rollout failed: %s", exc)
        group.records = records
        try:
            if self.score is not None:
                self.score(records, group.task)
        finally:  # every rollout and its trace, trained on or not, even when a reward function failed
            self._write(records)

    def _write(self, records: list[RolloutRecord]) -> None:
        """Only the caller's thread writes (collect and close run there): no lock."""
        for record in records:
            record.environment = None  # a white-box rollout's environment is released once scored
            write_record(self.out, record)

    def cancel_stale(self, version: int, max_staleness: int) -> int:
        """Stop the rollouts whose oldest turn is more than max_staleness versions old (they would be dropped when
        collected), instead of finishing them; the others go on across the sync, their next calls on the new
        weights. A rollout's turns are no older than its group's launch, so only older groups are asked."""
        stopped = 0
        for group in self.pending:
            if version - group.launched <= max_staleness or group.done():
                continue
            for session in list(group.sessions):
                first = None if session.cancelled else session.first_version()
                if first is not None and version - first > max_staleness:
                    session.cancel()
                    stopped += 1
        return stopped

    def cancel_all(self) -> int:
        return sum(g.cancel() for g in self.pending)

    def discard(self) -> None:
        """Stop every pending group and forget it (its rollouts sampled weights that are not the policy's)."""
        self.cancel_all()
        self.pending.clear()

    def close(self) -> None:
        """Stop what runs and wait for it; a rollout that had finished but was never collected is written,
        unscored, so an interrupted run or eval loses no finished capture."""
        finished = [f for g in self.pending for f in g.futures if f.done()]  # before anything is stopped
        self.cancel_all()
        self.executor.shutdown(wait=True, cancel_futures=True)
        self._write([f.result() for f in finished if not f.cancelled() and f.exception() is None])
        self.pending.clear()
