"""Keeping a run's services up, from both ends.

  Supervisor (the CLI)   restarts a server the run launched (vLLM, the capture proxy) when it exits: killed,
                         crashed, out of memory. Same command, same port, so every URL stays valid; the proxy
                         reloads its sessions from its journal. At most `max_restarts` times each.
  wait_for (the trainer) before a step is trained, each service must answer; one that does not is waited for
                         (it may be restarting) up to a bound, then the run stops with a clear error.

What a restart loses is put back by the trainer (training/policy_sync.py `ensure_services`): a restarted engine serves
the
weights it was launched with, so the trainer's are synced again and every rollout that may have sampled the
launched weights is discarded; a restarted proxy stamps version 0 until told the trainer's.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from harness_trainer._exceptions import ServiceDown
from harness_trainer.serving.process import ManagedProcess

log = logging.getLogger("harness_trainer")


def wait_for(name: str, probe, timeout_s: float, poll_s: float = 1.0) -> float:
    """Call `probe()` until it returns without raising; returns the seconds waited (0.0: it answered at once).
    Raises ServiceDown after `timeout_s`."""
    started = time.monotonic()
    while True:
        try:
            probe()
            return time.monotonic() - started
        except Exception as exc:  # any failure to answer: connection refused, reset, 5xx, timeout
            waited = time.monotonic() - started
            if waited >= timeout_s:
                # the bound, not the seconds measured: those depend on how busy the machine was
                raise ServiceDown(f"{name} has not answered for {timeout_s:g} s ({type(exc).__name__}: {exc})") \
                    from None
            if waited == 0 or int(waited) % 30 == 0:
                log.warning("%s is not answering (%s); waiting up to %.0f s for it to come back", name, exc,
                            timeout_s)
            time.sleep(poll_s)


@dataclass
class Restart:
    service: str
    exit_code: int | None
    seconds: float  # until healthy again
    at: float = field(default_factory=time.time)


class Supervisor:
    """Watches ManagedProcess children; restarts any that exits. Use as a context manager, entered after the
    servers it watches (so it stops watching before they are stopped)."""

    def __init__(self, services: dict[str, tuple[ManagedProcess, float]], max_restarts: int = 3,
                 poll_s: float = 1.0):
        self.services = services  # name -> (process, start-up timeout)
        self.max_restarts, self.poll_s = max_restarts, poll_s
        self.restarts: list[Restart] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            for name, (managed, startup_timeout_s) in self.services.items():
                process = managed.process
                if process is None or process.poll() is None:
                    continue  # stopped on purpose, or running
                done = sum(r.service == name for r in self.restarts)
                if done >= self.max_restarts:
                    continue  # the trainer's wait_for will stop the run, naming the service
                code = process.returncode
                log.warning("%s exited (code %s); restarting it (%d of at most %d)", name, code, done + 1,
                            self.max_restarts)
                started = time.monotonic()
                managed.stop()
                try:
                    managed.start(startup_timeout_s)
                except Exception as exc:  # its own error type (EngineError, ProxyError): it did not come up
                    log.error("%s could not be restarted: %s", name, exc)
                    self.restarts.append(Restart(name, code, float("nan")))
                    continue
                self.restarts.append(Restart(name, code, time.monotonic() - started))
                log.warning("%s is back after %.0f s", name, time.monotonic() - started)

    def __enter__(self) -> Supervisor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=600)
