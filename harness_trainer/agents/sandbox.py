"""Sandboxes: where an agent and then its verifier run. One small interface, several backends.

    start()                          make the trial's writable dirs (/app /logs /tests, a private HOME)
    exec(command, timeout_s, env)    run `bash -c command` inside; the whole process tree dies at the timeout
    upload(src, dst) / download(src, dst)
    stop()

`local` needs no container runtime: each exec is a bubblewrap jail with a fresh tmpfs root, the system dirs
and the agent programs bound read-only, per-trial writable /app /logs /tests and HOME, its own PID namespace
(when its first process ends, the kernel kills every process left in it) and its own network namespace: the
only host service it reaches is the capture proxy, through the forwarder (agents/forwarder.py); no internet,
whatever the task's allow_internet says (a jail has no route out: run such tasks under docker). `docker`
(agents/containers.py) runs a task's own image; `e2b` runs in E2B's cloud; `harbor[:ENV]` delegates to any
Harbor environment backend through a bridge process in Harbor's own Python 3.12 environment. The registry of
names is agents/sandboxes.py.
"""

from __future__ import annotations

import os
import shlex
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

REPO_ROOT = Path(__file__).resolve().parents[2]
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
    harbor = REPO_ROOT / ".venv-harbor" / "bin" / "python"  # terminus-2's: Harbor needs Python 3.12, its own install
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


class LocalSandbox(TrialDirs):
    """bubblewrap jail per exec, over a trial directory on the host."""

    workdir = "/app"

    def __init__(self, trial_dir: str | Path, *, readonly: list[Path] | None = None, max_file_mb: int = 1024,
                 max_open_files: int = 4096, proxy: tuple[str, int] | None = None):
        if not shutil.which("bwrap"):
            raise SandboxError("the local sandbox needs bubblewrap: `apt-get install bubblewrap` (make setup does "
                               "this as root), or choose --sandbox e2b|docker")
        super().__init__(trial_dir)
        self.readonly = readonly if readonly is not None else agent_program_paths()
        self.limits = f"ulimit -f {max_file_mb * 1024}; ulimit -n {max_open_files}; ulimit -c 0"
        self.proxy, self.bridge, self.forwarder = proxy, None, []
        self.execs = Execs()

    def start(self) -> None:
        super().start()
        if self.proxy:  # the jail's one road out: its loopback port -> this socket -> the proxy
            from harness_trainer.agents.forwarder import SocketBridge, in_trial

            self.bridge = SocketBridge(None, *self.proxy)
            self.forwarder = in_trial()

    def _argv(self, command: str, env: dict[str, str]) -> list[str]:
        argv = ["bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                "--unshare-net", "--tmpfs", "/", "--proc", "/proc", "--dev", "/dev"]
        for top in ("usr", "etc", "opt", "bin", "sbin", "lib", "lib64"):
            path = Path("/") / top
            if path.is_symlink():
                argv += ["--symlink", os.readlink(path), str(path)]
            elif path.is_dir():
                argv += ["--ro-bind", str(path), str(path)]
        for name in SANDBOX_DIRS:
            argv += ["--bind", str(self.trial / name), f"/{name}"]
        # After the writable dirs: a checkout under /tmp or /home must not be hidden by the trial's own.
        for path in self.readonly:
            argv += ["--ro-bind", str(path), str(path)]
        forward = ""
        if self.bridge is not None:
            # The program on a bind of its own: the package may lie under /tmp or /home, hidden by the trial's.
            *run, program = self.forwarder
            seen = f"/run/{Path(program).name}"
            argv += ["--ro-bind", str(self.bridge.folder), "/run/harness", "--ro-bind", program, seen]
            forward = (f"{shlex.join([*run, seen])} --port {self.proxy[1]} --socket /run/harness/proxy.sock "
                       "--watch $$ --background || exit 125; ")
        argv += ["--clearenv", "--chdir", "/app"]
        for key, value in env.items():
            argv += ["--setenv", key, value]
        return argv + ["bash", "-c", f"{forward}{self.limits}; {command}"]

    def exec(self, command: str, timeout_s: float, env: dict[str, str] | None = None,
             user: str | None = None) -> ExecResult:
        # At the timeout, killing the jail's process group takes its PID namespace and every process inside.
        return self.execs.run(self._argv(command, {**BASE_ENV, **(env or {})}), timeout_s)

    def cancel(self) -> None:
        """Kill the exec in progress (its whole jail) and refuse later ones, from another thread."""
        self.execs.cancel()

    def stop(self) -> None:  # nothing outlives an exec; the trial directory stays as the rollout's record
        if self.bridge is not None:
            self.bridge.close()
            self.bridge = None


class E2BSandbox:
    """E2B cloud sandbox (pip install e2b). Needs E2B_API_KEY, and a proxy URL the sandbox can reach
    (--public-url): a sandbox in the cloud cannot see 127.0.0.1 on this machine."""
    workdir = "/app"

    def __init__(self, template: str = "base", *, public_url: str | None = None, timeout_s: int = 3600):
        if not os.environ.get("E2B_API_KEY"):
            raise SandboxError("--sandbox e2b needs E2B_API_KEY in the environment (from e2b.dev); nothing was sent")
        if not public_url:
            raise SandboxError("--sandbox e2b needs --public-url: the address at which E2B sandboxes reach this "
                               "machine's capture proxy (127.0.0.1 is not reachable from the cloud)")
        try:
            import e2b  # noqa: F401
        except ImportError:
            raise SandboxError("--sandbox e2b needs the e2b package: .venv/bin/pip install e2b") from None
        self.template, self.public_url, self.timeout_s = template, public_url, timeout_s
        self.box, self.cancelled = None, False

    def start(self) -> None:
        from e2b import Sandbox as E2B

        self.box = E2B.create(template=self.template, timeout=self.timeout_s)
        self.box.commands.run("mkdir -p /app /logs/verifier /tests", user="root")

    def exec(self, command: str, timeout_s: float, env: dict[str, str] | None = None,
             user: str | None = None) -> ExecResult:
        from e2b.sandbox.commands.command_handle import CommandExitException

        started = time.perf_counter()
        try:
            if self.cancelled:
                raise SandboxError("cancelled")
            r = self.box.commands.run(command, envs=env or {}, cwd="/app", timeout=timeout_s, user="root")
            return ExecResult(r.exit_code, r.stdout, r.stderr, False, time.perf_counter() - started)
        except CommandExitException as exc:
            return ExecResult(exc.exit_code, exc.stdout, exc.stderr, False, time.perf_counter() - started)
        except TimeoutError:
            return ExecResult(-9, "", "", True, time.perf_counter() - started)
        except Exception:
            if not self.cancelled:
                raise
            return ExecResult(-9, "", "cancelled", False, time.perf_counter() - started)

    def cancel(self) -> None:
        """The sandbox is killed: its command in progress ends, and so does every later one."""
        self.cancelled = True
        if self.box is not None:
            self.box.kill()

    def upload(self, src: Path, dst: str) -> None:
        files = [p for p in Path(src).rglob("*") if p.is_file()] if Path(src).is_dir() else [Path(src)]
        for path in files:
            rel = path.relative_to(src) if Path(src).is_dir() else Path(path.name) if dst.endswith("/") else None
            target = f"{dst.rstrip('/')}/{rel}" if rel is not None else dst
            self.box.files.write(target, path.read_bytes())

    def download(self, src: str, dst: Path) -> None:
        Path(dst).write_bytes(self.box.files.read(src, format="bytes"))

    def clear(self, inside: str) -> None:
        self.box.commands.run(f"rm -rf {inside} && mkdir -p {inside}", user="root")

    def stop(self) -> None:
        if self.box is not None:
            self.box.kill()
            self.box = None


class HarborSandbox:
    """Any of Harbor's environment backends (docker, modal, daytona, e2b, ... or `module:Class`), driven
    through `harbor_bridge.py` in the Harbor environment (`make setup HARBOR=1`: harbor needs Python 3.12)."""
    workdir = "/app"

    def __init__(self, trial_dir: str | Path, environment: str, task_dir: Path | None = None):
        python = Path(os.environ.get("HARNESS_HARBOR_PYTHON", REPO_ROOT / ".venv-harbor" / "bin" / "python"))
        if not python.exists():
            raise SandboxError("--sandbox harbor needs the Harbor environment: run `make setup HARBOR=1` "
                               "(harbor requires Python >= 3.12), or set HARNESS_HARBOR_PYTHON")
        self.trial = Path(trial_dir).resolve()
        self.environment, self.task_dir, self.cancelled = environment, task_dir, False
        self.bridge = subprocess.Popen([str(python), str(Path(__file__).with_name("harbor_bridge.py"))],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                       text=True, start_new_session=True)

    def _call(self, **request) -> dict:
        import json

        try:
            self.bridge.stdin.write(json.dumps(request) + "\n")
            self.bridge.stdin.flush()
            line = self.bridge.stdout.readline()
        except OSError:  # killed (cancel) or gone: the pipe is broken
            line = ""
        if not line:
            raise SandboxError(f"the Harbor bridge exited (code {self.bridge.poll()}) during '{request['op']}'")
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise SandboxError(f"Harbor environment '{self.environment}' failed to {request['op']}: {answer['error']}")
        return answer

    def start(self) -> None:
        env_dir = (self.task_dir / "environment") if self.task_dir else self.trial / "environment"
        env_dir.mkdir(parents=True, exist_ok=True)
        self._call(op="start", type=self.environment, environment_dir=str(env_dir), name=self.trial.name,
                   trial_dir=str(self.trial))
        self.exec("mkdir -p /app /logs/verifier /tests /home", 60)

    def exec(self, command: str, timeout_s: float, env: dict[str, str] | None = None,
             user: str | None = None) -> ExecResult:
        started = time.perf_counter()
        try:
            a = self._call(op="exec", command=command, timeout_s=timeout_s, env={**BASE_ENV, **(env or {})})
        except SandboxError:
            if not self.cancelled:
                raise
            return ExecResult(-9, "", "cancelled", False, time.perf_counter() - started)
        return ExecResult(a["returncode"], a["stdout"], a["stderr"], a["timed_out"], time.perf_counter() - started)

    def cancel(self) -> None:
        """The bridge is killed (its environment stopped by stop()): the exec in progress and later ones end."""
        self.cancelled = True
        self.bridge.kill()

    def upload(self, src: Path, dst: str) -> None:
        self._call(op="upload", src=str(Path(src).resolve()), dst=dst)

    def download(self, src: str, dst: Path) -> None:
        self._call(op="download", src=src, dst=str(Path(dst).resolve()))

    def clear(self, inside: str) -> None:
        self.exec(f"rm -rf {inside} && mkdir -p {inside}", 60)

    def stop(self) -> None:
        if self.bridge.poll() is None:
            try:
                self._call(op="stop")
            except SandboxError:
                pass
            self.bridge.kill()
            self.bridge.wait()
