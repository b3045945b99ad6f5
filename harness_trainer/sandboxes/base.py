"""The Sandbox protocol: where an agent and then its verifier run. One small interface, several kinds.

    start()                          make the trial's writable dirs (/app /logs /tests, a private HOME)
    exec(command, timeout_s, env)    run `bash -c command` inside; the whole process tree dies at the timeout
    upload(src, dst) / download(src, dst)
    stop()

The kinds: bubblewrap.py (`local`), containers.py (`docker`, a task's own image), remote.py (`e2b`, and
`harbor[:ENV]`: any Harbor environment backend). registry.py names them. Here: the protocol, an exec's result, a
trial's folders on the host and the cancellable execs the local kinds share.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from harness_trainer._exceptions import SandboxError
from harness_trainer.paths import REPO_ROOT, venv_python

SANDBOX_DIRS = ("app", "logs", "tests", "home", "tmp", "solution")


@dataclass
class ExecResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float


class Sandbox(Protocol):
    workdir: str  # where the agent's commands run (the task image's WORKDIR; /app elsewhere)

    def start(self) -> None: ...
    # user: who runs it, a task's [agent] / [verifier] user (None: the sandbox's own). Only containers have users
    # to switch to; the others run every phase as they always do (check_task_sandboxes warns)
    def exec(self, command: str, timeout_s: float, env: dict[str, str] | None = None,
             user: str | None = None) -> ExecResult: ...
    def upload(self, src: Path, dst: str) -> None: ...
    def download(self, src: str, dst: Path) -> None: ...
    def clear(self, inside: str) -> None: ...  # empty a folder inside (the verifier's /tests, /logs/verifier)
    def cancel(self) -> None: ...  # from another thread: stop the exec in progress, refuse later ones
    def stop(self) -> None: ...


def agent_program_paths() -> list[Path]:
    """Read-only paths an agent program needs inside the jail: the Python install behind the project's
    virtual environments, and the agents' own environments."""
    paths = {Path(sys.base_prefix).resolve()}
    for name in (".venv-mini", ".tools", ".venv-harbor"):
        if (REPO_ROOT / name).exists():
            paths.add((REPO_ROOT / name).resolve())
    harbor = venv_python("harbor")  # terminus-2's: Harbor needs Python 3.12, its own install
    if harbor.exists():
        paths.add(harbor.resolve().parents[1])
    return sorted(paths)


class TrialDirs:
    """A trial directory on the host whose subdirs are the sandbox's writable /app /logs /tests /home /tmp
    /solution (filled for the oracle policy only):
    files move in and out by plain copies, whatever runs the commands."""

    def __init__(self, trial_dir: str | Path):
        self.trial = Path(trial_dir).resolve()

    def host_path(self, inside: str) -> Path:
        """The host path behind a path inside the jail (only the writable dirs are mapped)."""
        parts = Path(inside).parts
        if len(parts) < 2 or parts[0] != "/" or parts[1] not in SANDBOX_DIRS:
            raise SandboxError(f"{inside} is not under a writable sandbox dir (/{', /'.join(SANDBOX_DIRS)})")
        return self.trial.joinpath(*parts[1:])

    def start(self) -> None:
        for name in SANDBOX_DIRS:
            (self.trial / name).mkdir(parents=True, exist_ok=True)

    def upload(self, src: Path, dst: str) -> None:
        target = self.host_path(dst)
        if not target.resolve().is_relative_to(self.trial):  # written on the host: never through a trial's link
            raise SandboxError(f"{dst} is a link out of the trial: nothing copied")
        if Path(src).is_dir():
            shutil.copytree(src, target, dirs_exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)

    def download(self, src: str, dst: Path) -> None:
        """Read on the host, so a link the trial made (to the host's /etc/shadow, say) must lead nowhere: one that
        leaves the trial is refused, and the links inside a folder are left out."""
        source = self.host_path(src)
        if not source.resolve().is_relative_to(self.trial):
            raise SandboxError(f"{src} is a link out of the trial: not read")
        if source.is_dir():
            links = lambda folder, names: [n for n in names if os.path.islink(os.path.join(folder, n))]  # noqa: E731
            shutil.copytree(source, dst, dirs_exist_ok=True, ignore=links)
        else:
            shutil.copy2(source, dst)

    def clear(self, inside: str) -> None:
        """Emptied, not replaced: the folder may be a container's mount (/tests), which would keep the old one."""
        path = self.host_path(inside)
        if path.is_symlink():  # the trial made it a link: the link goes, not what it points to
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        for child in path.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


def kill_group(process) -> None:
    """SIGKILL a process started with start_new_session and everything in its group."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_process(argv: list[str], timeout_s: float, on_timeout, on_start=None) -> ExecResult:
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                               start_new_session=True, text=True, errors="replace")
    if on_start:
        on_start(process)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        on_timeout(process)
        stdout, stderr = process.communicate()
        timed_out = True
    return ExecResult(process.returncode, stdout, stderr, timed_out, time.perf_counter() - started)


class Execs:
    """Runs a sandbox's execs so another thread can cancel them: `cancel()` kills the one in progress (its
    process group) and refuses every later one."""

    _LOCK = threading.Lock()

    def __init__(self):
        self.running, self.cancelled = None, False

    def run(self, argv: list[str], timeout_s: float) -> ExecResult:
        if self.cancelled:  # cancelled before it even started
            return ExecResult(-signal.SIGKILL, "", "cancelled", False, 0.0)
        return run_process(argv, timeout_s, kill_group, on_start=self._started)

    def _started(self, process) -> None:
        with self._LOCK:
            self.running = process
            cancelled = self.cancelled
        if cancelled:  # a cancel() that came between the check above and the process's start
            kill_group(process)

    def cancel(self) -> None:
        with self._LOCK:
            self.cancelled = True
            process = self.running
        if process is not None:
            kill_group(process)


BASE_ENV = {"HOME": "/home", "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
