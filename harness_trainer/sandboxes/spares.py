"""Containers started ahead and removed behind, so a trial pays neither `docker run` nor `docker rm` on its path.

A container trial's own cost is mostly its start (docker run, the forwarder in its network namespace: ~0.4 s on
2 cores, against a jail's ~0.01 s). A kind of trial (image, [environment], proxy, run folder) is hot when one
starts within IDLE_S of another's end: the same image over and over, an eval with more rollouts than run at once.
For a hot kind, spares are kept for the trials that could start now: as many as once ran at once, less those
running. A kind that comes back only each epoch (a task's own image, once per group) is not hot: a spare would
wait past IDLE_S for nothing. A spare is a container no trial has touched, used by one trial only; its /logs
and /home folders are moved into that trial's folder (a bind mount follows its folder), so the trial's record is
where it always was. A spare waiting longer than IDLE_S is removed, and all of them when the run ends (`close`:
the sandbox provider that owns them closes it, registry.py; else at exit); after a SIGKILL their forwarders remove
them, as a trial's container is. A trial's container, once stopped, is removed in the background too
(`discard`); `settle` waits for those removals, `close` as well.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor, wait

IDLE_S = 120.0  # a kind is hot when its trials come back within this long; a spare unused this long goes
STARTERS = 2  # docker runs at once for spares: the daemon serialises much of a start anyway


class Spares:
    """The spares of every kind, and what decides how many to keep: each kind's trials running now, the most
    that ever ran at once, and when one last ended."""

    def __init__(self):
        self.lock = threading.Lock()
        self.waiting: dict[Hashable, list[tuple[float, object]]] = {}
        self.pending, self.running, self.peak = Counter(), Counter(), Counter()
        self.ended_at: dict[Hashable, float] = {}
        self.hot: set[Hashable] = set()
        self.starters: ThreadPoolExecutor | None = None
        self.removers = ThreadPoolExecutor(STARTERS, thread_name_prefix="container-removal")
        self.removals: set[Future] = set()
        atexit.register(self.close)  # an interpreter that exits without its provider's close leaves none behind

    def take(self, kind: Hashable):
        """A trial of `kind` starts: a spare for it (the longest waiting), or None."""
        now = time.monotonic()
        with self.lock:
            self.running[kind] += 1
            self.peak[kind] = max(self.peak[kind], self.running[kind])
            if now - self.ended_at.get(kind, -IDLE_S) < IDLE_S:
                self.hot.add(kind)
            waiting = self.waiting.get(kind) or []
            spare = waiting.pop(0)[1] if waiting else None
        self._expire()
        return spare

    def ended(self, kind: Hashable, start: Callable[[], object]) -> None:
        with self.lock:
            self.running[kind] -= 1
            self.ended_at[kind] = time.monotonic()
        self.refill(kind, start)

    def refill(self, kind: Hashable, start: Callable[[], object]) -> None:
        """For a hot kind, start spares in the background up to the trials that could start now."""
        with self.lock:
            if kind not in self.hot:
                return
            wanted = (self.peak[kind] - self.running[kind] - len(self.waiting.get(kind, ()))
                      - self.pending[kind])
            if wanted <= 0:
                return
            self.pending[kind] += wanted
            self.starters = self.starters or ThreadPoolExecutor(STARTERS, thread_name_prefix="spare-container")
            starters = self.starters
        for _ in range(wanted):
            starters.submit(self._start, kind, start)

    def _start(self, kind: Hashable, start: Callable[[], object]) -> None:
        try:
            spare = start()
        except Exception as exc:  # a trial will start its own, and say what failed if it fails too
            logging.getLogger(__name__).warning("a spare container did not start: %s", exc)
            spare = None
        with self.lock:
            self.pending[kind] -= 1
            if spare is not None:
                self.waiting.setdefault(kind, []).append((time.monotonic(), spare))

    def _expire(self) -> None:
        cutoff, old = time.monotonic() - IDLE_S, []
        with self.lock:
            for waiting in self.waiting.values():
                old += [spare for since, spare in waiting if since < cutoff]
                waiting[:] = [(since, spare) for since, spare in waiting if since >= cutoff]
        for spare in old:
            spare.stop()

    def discard(self, remove: Callable[[], None]) -> None:
        """Run `remove` (a stopped trial's container) in the background; at once when the interpreter is exiting."""
        try:
            with self.lock:
                future = self.removers.submit(remove)
                self.removals.add(future)
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown": at exit
            return remove()
        future.add_done_callback(self._removed)

    def _removed(self, future: Future) -> None:
        with self.lock:
            self.removals.discard(future)
        if future.exception() is not None:
            logging.getLogger(__name__).warning("a container was not removed: %s", future.exception())

    def settle(self) -> None:
        """Wait until every container handed to `discard` is gone."""
        with self.lock:
            removals = list(self.removals)
        wait(removals)

    def close(self) -> None:
        """Remove every spare, once those being started are up (the run ends: none will be taken)."""
        atexit.unregister(self.close)
        with self.lock:
            starters, self.starters = self.starters, None
        if starters is not None:
            starters.shutdown(wait=True, cancel_futures=True)
        with self.lock:
            spares = [spare for waiting in self.waiting.values() for _, spare in waiting]
            self.waiting.clear()
            self.pending.clear()  # those cancelled before they started
            self.hot.clear()
        for spare in spares:
            spare.stop()
        self.settle()

