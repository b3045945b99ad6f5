"""`local`: a bubblewrap jail per exec over a trial directory on the host.

Each exec gets a fresh tmpfs root, the system dirs and the agent programs bound read-only, per-trial writable /app
/logs /tests and HOME, its own PID namespace (when its first process ends, the kernel kills every process left in
it) and its own network namespace: the only host service it reaches is the capture proxy, through the forwarder
(forwarder.py); no internet, whatever the task's allow_internet says (a jail has no route out: run such tasks in
containers).
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

from harness_trainer._exceptions import SandboxError
from harness_trainer.sandboxes.base import BASE_ENV, SANDBOX_DIRS, ExecResult, Execs, TrialDirs, agent_program_paths


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
            from harness_trainer.sandboxes.forwarder import SocketBridge, in_trial

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


