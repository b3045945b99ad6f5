"""Sandboxes: where an agent and then its verifier run. One small interface, several backends.

    start()                          make the trial's writable dirs (/app /logs /tests, a private HOME)
    exec(command, timeout_s, env)    run `bash -c command` inside; the whole process tree dies at the timeout
    upload(src, dst) / download(src, dst)
    stop()

`local` needs no container runtime: each exec is a bubblewrap jail with a fresh tmpfs root, the system dirs
and the agent programs bound read-only, per-trial writable /app /logs /tests and HOME, its own PID namespace
(when its first process ends, the kernel kills every process left in it), and the host network (so the agent
reaches the capture proxy on 127.0.0.1). `e2b` runs in E2B's cloud; `docker` needs a Docker daemon.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

REPO_ROOT = Path(__file__).resolve().parents[2]
SANDBOX_DIRS = ("app", "logs", "tests", "home", "tmp")


class SandboxError(RuntimeError):
    """A sandbox could not be created or used; the message names the missing binary, daemon or credential."""


@dataclass
class ExecResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float


class Sandbox(Protocol):
    def start(self) -> None: ...
    def exec(self, command: str, timeout_s: float, env: dict[str, str] | None = None) -> ExecResult: ...
    def upload(self, src: Path, dst: str) -> None: ...
    def download(self, src: str, dst: Path) -> None: ...
    def stop(self) -> None: ...


def agent_program_paths() -> list[Path]:
    """Read-only paths an agent program needs inside the jail: the Python install behind the project's
    virtual environments, and the agents' own environments."""
    paths = {Path(sys.base_prefix).resolve()}
    for name in (".venv-mini", ".tools"):
        if (REPO_ROOT / name).exists():
            paths.add((REPO_ROOT / name).resolve())
    return sorted(paths)


class LocalSandbox:
    """bubblewrap jail per exec, over a trial directory on the host."""

    def __init__(self, trial_dir: str | Path, *, readonly: list[Path] | None = None, max_file_mb: int = 1024,
                 max_open_files: int = 4096):
        if not shutil.which("bwrap"):
            raise SandboxError("the local sandbox needs bubblewrap: `apt-get install bubblewrap` (make setup does "
                               "this as root), or choose --sandbox e2b|docker")
        self.trial = Path(trial_dir).resolve()
        self.readonly = readonly if readonly is not None else agent_program_paths()
        self.limits = f"ulimit -f {max_file_mb * 1024}; ulimit -n {max_open_files}; ulimit -c 0"

    def host_path(self, inside: str) -> Path:
        """The host path behind a path inside the jail (only the writable dirs are mapped)."""
        parts = Path(inside).parts
        if len(parts) < 2 or parts[0] != "/" or parts[1] not in SANDBOX_DIRS:
            raise SandboxError(f"{inside} is not under a writable sandbox dir (/{', /'.join(SANDBOX_DIRS)})")
        return self.trial.joinpath(*parts[1:])

    def start(self) -> None:
        for name in SANDBOX_DIRS:
            (self.trial / name).mkdir(parents=True, exist_ok=True)

    def _argv(self, command: str, env: dict[str, str]) -> list[str]:
        argv = ["bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                "--tmpfs", "/", "--proc", "/proc", "--dev", "/dev"]
        for top in ("usr", "etc", "opt", "bin", "sbin", "lib", "lib64"):
            path = Path("/") / top
            if path.is_symlink():
                argv += ["--symlink", os.readlink(path), str(path)]
            elif path.is_dir():
                argv += ["--ro-bind", str(path), str(path)]
        for path in self.readonly:
            argv += ["--ro-bind", str(path), str(path)]
        for name in SANDBOX_DIRS:
            argv += ["--bind", str(self.trial / name), f"/{name}"]
        argv += ["--clearenv", "--chdir", "/app"]
        for key, value in env.items():
            argv += ["--setenv", key, value]
        return argv + ["bash", "-c", f"{self.limits}; {command}"]

    def exec(self, command: str, timeout_s: float, env: dict[str, str] | None = None) -> ExecResult:
        full_env = {"HOME": "/home", "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": "/tmp",
                    **(env or {})}
        started = time.perf_counter()
        process = subprocess.Popen(self._argv(command, full_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   stdin=subprocess.DEVNULL, start_new_session=True, text=True, errors="replace")
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            # Killing the jail's process group takes its PID namespace, and with it every process inside.
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            timed_out = True
        return ExecResult(process.returncode, stdout, stderr, timed_out, time.perf_counter() - started)

    def upload(self, src: Path, dst: str) -> None:
        target = self.host_path(dst)
        if Path(src).is_dir():
            shutil.copytree(src, target, dirs_exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)

    def download(self, src: str, dst: Path) -> None:
        source = self.host_path(src)
        if source.is_dir():
            shutil.copytree(source, dst, dirs_exist_ok=True)
        else:
            shutil.copy2(source, dst)

    def clear(self, inside: str) -> None:
        path = self.host_path(inside)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True, exist_ok=True)

    def stop(self) -> None:
        pass  # nothing outlives an exec; the trial directory stays as the rollout's record


class E2BSandbox:
    """E2B cloud sandbox (pip install e2b). Needs E2B_API_KEY, and a proxy URL the sandbox can reach
    (--public-url): a sandbox in the cloud cannot see 127.0.0.1 on this machine."""

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
        self.box = None

    def start(self) -> None:
        from e2b import Sandbox as E2B

        self.box = E2B.create(template=self.template, timeout=self.timeout_s)
        self.box.commands.run("mkdir -p /app /logs/verifier /tests", user="root")

    def exec(self, command: str, timeout_s: float, env: dict[str, str] | None = None) -> ExecResult:
        from e2b.sandbox.commands.command_handle import CommandExitException

        started = time.perf_counter()
        try:
            r = self.box.commands.run(command, envs=env or {}, cwd="/app", timeout=timeout_s, user="root")
            return ExecResult(r.exit_code, r.stdout, r.stderr, False, time.perf_counter() - started)
        except CommandExitException as exc:
            return ExecResult(exc.exit_code, exc.stdout, exc.stderr, False, time.perf_counter() - started)
        except TimeoutError:
            return ExecResult(-9, "", "", True, time.perf_counter() - started)

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


def make_sandbox(kind: str, trial_dir: Path, **options) -> Sandbox:
    if kind == "local":
        return LocalSandbox(trial_dir)
    if kind == "e2b":
        return E2BSandbox(public_url=options.get("public_url"))
    if kind == "docker":
        if not shutil.which("docker") or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
            raise SandboxError("--sandbox docker needs a running Docker daemon (`docker info` fails here); "
                               "use --sandbox local (bubblewrap) instead")
        raise SandboxError("--sandbox docker is not implemented yet; use --sandbox local")
    if kind == "harbor":
        raise SandboxError("--sandbox harbor needs the harbor package in its own Python >= 3.12 environment, "
                           "which `make setup` does not build yet; use --sandbox local")
    raise SandboxError(f"unknown sandbox '{kind}': choose local, e2b, docker or harbor")
