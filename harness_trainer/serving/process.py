"""A supervised server subprocess: started in its own process group, waited on until healthy, stopped as a
whole group, and tethered to this process (tether.py): if we die without stopping it — SIGKILL, the OOM
killer — the group is stopped for us. The engine (vLLM) and the capture proxy both run this way."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from harness_trainer._exceptions import ProcessError

TETHER = Path(__file__).with_name("tether.py")
START_CAP = 4  # a start whose log keeps moving is given up after this many start-up timeouts in all
HEALTH_EVERY_S = 2.0  # how often a server's /health is asked while it runs (the proxy's engines, a GPU sync)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def interrupt_on_sigterm() -> None:
    """Every entry point calls this first: SIGTERM (a `timeout`, a scheduler, a job system stopping us) becomes
    KeyboardInterrupt in the main thread, so every `with` and `finally` runs — servers stopped as groups, what is
    finished kept on disk — as for Ctrl-C. SIGKILL skips all that: the tether covers it. No-op off the main thread."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def ignore_stop_signals() -> None:
    """After an entry point has caught its interrupt and everything it started is stopped: a further SIGTERM or
    Ctrl-C (a job system repeating its TERM, a `timeout` and a shell both signalling) would raise
    KeyboardInterrupt outside every handler, and Python exits from an unhandled KeyboardInterrupt by killing
    itself with SIGINT: return code -2 instead of the 130 the command decided (seen once in `make test`).

    It also forgets the interrupt the command has handled. CPython marks a KeyboardInterrupt that leaves code run
    by `exec`/`eval` of a string (dataclasses and namedtuples build their methods that way, so a SIGTERM during
    an import can land there) as unhandled, even when a caller catches it, and at exit kills itself with SIGINT
    on that mark; the next string run by `exec` clears it. Seen in CI as -2 after the command's own line."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    exec("")  # clears the interpreter's unhandled-interrupt mark (above); runs nothing


def engine_answers(url: str) -> bool:
    """The server at `url` answers /health (within 5 s): the one liveness probe the trainer and the proxy use."""
    try:
        return httpx.get(f"{url.rstrip('/')}/health", timeout=5).is_success
    except httpx.HTTPError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_group(leader: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGKILL the leader's process group and wait until none of it is left: children can outlive their
    leader, and a killed process lingers until reaped (we reap the leader; init reaps the rest)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(leader.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        leader.poll()
        time.sleep(0.05)
    raise ProcessError(f"process group {leader.pid} survived SIGKILL for {timeout_s} s")


def dead_folders(kind: str) -> list[Path]:
    """Folders <temp>/harness-KIND-PID-* whose process is gone: a run killed (SIGKILL, the OOM killer) before it
    could remove what it made. Named after their process, a dead run's are found without touching a live one's."""
    found = []
    for folder in Path(tempfile.gettempdir()).glob(f"harness-{kind}-*-*"):
        parts = folder.name.split("-")  # harness, KIND, PID, mkdtemp's suffix (never a "-" in it)
        if len(parts) == 4 and parts[2].isdigit() and not Path("/proc", parts[2]).exists():
            found.append(folder)
    return found


def server_folder(kind: str) -> Path:
    """A server's own folder, <temp>/harness-KIND-PID-*: what it writes and nobody needs after it (sockets, caches,
    the proxy's CA key) under scratch/, a log kept for post-mortems beside it. clear_folder() empties it at stop; a
    parent killed before it could stop its server (the tether stops the server; nothing clears its files) leaves
    one, cleared here by the next server of its kind started on this machine."""
    for stale in dead_folders(kind):
        clear_folder(stale)
    folder = Path(tempfile.mkdtemp(prefix=f"harness-{kind}-{os.getpid()}-"))
    (folder / "scratch").mkdir()
    return folder


def clear_folder(folder: Path) -> None:
    """The scratch goes; the folder too, unless a log was left in it."""
    shutil.rmtree(folder / "scratch", ignore_errors=True)
    try:
        folder.rmdir()
    except OSError:  # a log, kept for post-mortems
        pass


class ManagedProcess:
    def __init__(self, name: str, command: list[str], *, env: dict[str, str], log_path: Path,
                 health_url: str, error: type[Exception] = ProcessError, start_hint: str = ""):
        self.name, self.command, self.env = name, command, env
        self.log_path, self.health_url, self.error, self.start_hint = log_path, health_url, error, start_hint
        self.process: subprocess.Popen | None = None
        self.pid: int | None = None  # kept after stop(): the process group id, for checks
        self._log = None

    def start(self, timeout_s: float) -> None:
        self._log = open(self.log_path, "ab")
        # A new session makes the server and its children one process group we can stop as one; the tether
        # execs the command (same pid) after forking the watcher that stops that group if we die first.
        tethered = [sys.executable, "-S", str(TETHER), str(os.getpid()), *self.command]
        self.process = subprocess.Popen(tethered, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.process.pid
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        """Healthy, or an error once its log has not moved for timeout_s (or after START_CAP × timeout_s in all).
        A fixed deadline raced the machine: beside other work a vLLM that was loading, its log still moving, was
        given up at 300 s (a fresh `make demo` at a load of 40 on 2 cores)."""
        started = last_move = time.monotonic()
        size = -1
        while (now := time.monotonic()) - last_move < timeout_s and now - started < START_CAP * timeout_s:
            if self.process.poll() is not None:
                raise self.error(f"{self.name} exited with code {self.process.returncode} while starting.\n"
                                 f"Last lines of its log ({self.log_path}):\n{self.log_tail()}")
            try:
                if httpx.get(self.health_url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            grown = self.log_path.stat().st_size if self.log_path.exists() else 0
            if grown != size:
                size, last_move = grown, now
            time.sleep(0.2)
        why = (f"within {timeout_s:.0f} s of its last log line" if now - last_move >= timeout_s
               else f"within {now - started:.0f} s (its log still moving)")
        raise self.error(f"{self.name} did not become healthy {why}. {self.start_hint}\n"
                         f"Last lines of its log ({self.log_path}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the group, then SIGKILL whatever is left after timeout_s. Safe to call twice."""
        proc, self.process = self.process, None
        if proc is not None:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=timeout_s)
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    pass
            kill_group(proc)
        if self._log:
            self._log.close()
            self._log = None
