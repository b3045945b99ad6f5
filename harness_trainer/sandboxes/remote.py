"""The sandboxes elsewhere: `e2b` (E2B's cloud) and `harbor[:ENV]` (any of Harbor's environment backends, through
a bridge process in Harbor's own Python 3.12 environment: harbor_bridge.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from harness_trainer._exceptions import SandboxError
from harness_trainer.paths import venv_python
from harness_trainer.sandboxes.base import BASE_ENV, ExecResult


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
        python = Path(os.environ.get("HARNESS_HARBOR_PYTHON", venv_python("harbor")))
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
