"""Containers started ahead, so a trial takes one ready instead of paying `docker run` on its own path.

A container trial's own cost is mostly its start (docker run, the forwarder in its network namespace: ~0.4 s on
2 cores, against a jail's ~0.01 s). Once the trials of a kind (image, [environment], proxy, run folder) have
started after others of that kind ended, more will come: each trial that starts then asks for one more spare, up
to as many as run at once. A spare is a container no trial has touched, used by one trial only; its /logs and
/home folders are moved into that trial's folder (a bind mount follows its folder), so the trial's record is
where it always was. A spare left waiting longer than IDLE_S is removed, and all of them when the process ends
(`close`, also at exit); after a SIGKILL their forwarders remove them, as a trial's container is.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

IDLE_S = 120.0  # a kind not started again within this long (a task's group in an epoch) gives its spares back
STARTERS = 2  # docker runs at once for spares: the daemon serialises much of a start anyway


class Spares:
    """The spares of every kind, and the trials of each kind now running (what decides how many to keep)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.waiting: dict[Hashable, list[tuple[float, object]]] = {}
        self.pending, self.running = Counter(), Counter()
        self.reused: set[Hashable] = set()  # kinds with an ended trial: another of the kind is no surprise
        self.starters: ThreadPoolExecutor | None = None

    def take(self, kind: Hashable):
        """A trial of `kind` starts: a spare for it (the longest waiting), or None; and a spare to replace it."""
        with self.lock:
            self.running[kind] += 1
            waiting = self.waiting.get(kind) or []
            spare = waiting.pop(0)[1] if waiting else None
        self._expire()
        return spare

    def ended(self, kind: Hashable) -> None:
        with self.lock:
            self.running[kind] -= 1
            self.reused.add(kind)

    def refill(self, kind: Hashable, start: Callable[[], object]) -> None:
        """Start spares of `kind` in the background, up to as many as its trials running now."""
        with self.lock:
            if kind not in self.reused:
                return
            wanted = self.running[kind] - len(self.waiting.get(kind, ())) - self.pending[kind]
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

    def close(self) -> None:
        """Remove every spare, once those being started are up (the run ends: none will be taken)."""
        with self.lock:
            starters, self.starters = self.starters, None
        if starters is not None:
            starters.shutdown(wait=True, cancel_futures=True)
        with self.lock:
            spares = [spare for waiting in self.waiting.values() for _, spare in waiting]
            self.waiting.clear()
            self.reused.clear()
            self.pending.clear()  # those cancelled before they started
        for spare in spares:
            spare.stop()


SPARES = Spares()
atexit.register(SPARES.close)
