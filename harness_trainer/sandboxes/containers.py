"""A container per trial, from the task's image (images.py builds and finds it).

Why Docker's CLI rather than Harbor's own environment classes: harbor needs Python 3.12 (the trainer is
3.11), so reusing them means a bridge process per trial (`--sandbox harbor:docker` still offers that); driving
the CLI directly is a few commands, lets the trial keep the project's own isolation (its network namespace
with the forwarder, forwarder.py) and mounts, and reports build failures before any rollout.

How the agent gets into an image that may hold neither Python nor Node: its runtime is mounted, read-only, at
the same paths as on the host (the Python install behind the project's environments, .venv-mini, .tools:
opencode, claude-code and codex are single native binaries). The image needs a glibc-based userland with bash
(Debian, Ubuntu, python:*-slim: the common case); in one without (Alpine, distroless) the agent does not
start, and the rollout is unscorable with that reason. Under an image's non-root USER the folders above those
mounts (/root is 0700 in Debian's images) are given the search bit in the container, so the USER can reach them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from harness_trainer._exceptions import SandboxError
from harness_trainer.sandboxes import compose
from harness_trainer.sandboxes.base import ExecResult, Execs, TrialDirs, agent_program_paths, kill_group, run_process
from harness_trainer.sandboxes.images import (
    LABEL,
    ContainerSpec,
    compose_digest,
    docker_cli,
    image_config,
    image_folder,
    warn_once,
)
from harness_trainer.sandboxes.spares import Spares

# The container's command (Harbor's is `sh -c "sleep infinity"`, after the image's ENTRYPOINT, which is kept): it
# idles, and reaps what dies under it. A process whose parent dies is handed to the init, so the ones an exec's
# timeout kills would otherwise stay as zombies for the container's life (`sleep infinity` never waits); the
# shell's `wait` reaps any child. (An ENTRYPOINT that does not `exec "$@"` stays the init, and reaps or not.)
REAPER = "while :; do sleep 2147483647 & wait; done"
ROOT = {"root", "0"}
# Every process of the execs in progress: in the container, an exec's first process has no parent (0), and what
# a finished exec left running has the init (1) for its root. Killed by a root exec, itself left out ($$); read
# from /proc/PID/stat, which every user may read (a root without CAP_SYS_PTRACE cannot read others' environ).
KILL_EXECS = ("for p in $(cat /proc/[0-9]*/stat 2>/dev/null | awk -v me=$$ '{ r = $0; sub(/.*\\) /, \"\", r); "
              "split(r, f, \" \"); parent[$1] = f[2] } END { for (p in parent) { q = p; while ((q in parent) && "
              "parent[q] != 0) q = parent[q]; if (q != 1 && q != me) print p } }'); do kill -9 $p 2>/dev/null; "
              "done; true")


@functools.cache  # one per process (a forked child has a pid, and a reaper, of its own)
def _reaper(pid: int) -> subprocess.Popen:
    """Once process `pid` is gone, SIGKILLed included, every container it labelled is removed. A trial's forwarder
    does that for its own container, but only once it runs: a container being started, a spare, or one whose
    removal was under way when the run died has none (6 of 16 were left after a SIGKILL at scale)."""
    script = (f"tail --pid={pid} -f /dev/null; "  # GNU tail: one process that polls, no `sleep` a second
              f"docker ps -aq --filter label={LABEL}={pid} | xargs -r docker rm -f >/dev/null 2>&1; "
              f"docker network ls -q --filter label={LABEL}={pid} | xargs -r docker network rm >/dev/null 2>&1")
    return subprocess.Popen(["sh", "-c", script], start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _host_cpus(cpus: float) -> float:
    """A task's cpus, at most the host's: Docker refuses more than it has, which would make every trial of a
    task written for a bigger machine unscorable (Harbor fails them; here they run on what there is)."""
    host = os.cpu_count() or 1
    if cpus > host:
        warn_once(f"a task asks for cpus = {cpus:g} and this host has {host}: its containers get {host}")
    return min(cpus, host)


class DockerSandbox(TrialDirs):
    """One container per trial from the task's image: its ENTRYPOINT, WORKDIR, ENV and USER honoured, cpus and
    memory applied, no network or the bridge's (allow_internet), the trial's /logs and /home bind-mounted, the
    agent programs mounted read-only. The capture proxy is reached through the forwarder, in the container's own
    network namespace (forwarder.py). Each exec is `docker exec`, as the task's [agent] / [verifier]
    user; what a finished exec left running stays (a server for the tests), a timed-out or cancelled exec's
    processes are killed. `stop()` removes it: in the background with the provider's `spares` (which also starts
    containers ahead for a kind of trial that recurs), else at once."""

    MOUNTED = ("logs", "home", "tests")  # the trial's own folders: read, cleared, filled on the host
    SEEDED = ("home", "tests")  # ... which start with what the image holds there (a mount would hide it)

    def __init__(self, trial_dir: str | Path, image: str, spec: ContainerSpec | None = None,
                 proxy: tuple[str, int] | None = None, spares: Spares | None = None):
        super().__init__(trial_dir)
        self.image, self.spec, self.proxy, self.spares = image, spec or ContainerSpec(), proxy, spares
        config = image_config(image)
        self.workdir = self.spec.workdir or ((config.get("WorkingDir") or "/") if self.spec.needs_container else "/app")
        self.user = (config.get("User") or "root").split(":")[0]
        self.name = f"harness-trial-{os.getpid()}-{hashlib.sha1(str(self.trial).encode()).hexdigest()[:10]}"
        self.bridge = self.forwarder = self.kind = self.origin = None
        self.spare, self.execs, self.uids = False, Execs(), {"root": 0, "0": 0}
        self.compose_files: list[str] = []  # a task with a docker-compose.yaml: its project's files (compose.py)

    def start(self) -> None:
        """A spare if one waits (spares.py), else a container of its own; then a spare for the next."""
        super().start()
        if self.spare or self.spares is None or self.spec.compose is not None:  # a compose project: none ahead
            return self._run()
        kind = (self.image, repr(self.spec), self.proxy, self.trial.parent)
        spare = self.spares.take(kind)
        self.kind = kind
        if spare is not None and any(any((self.trial / name).iterdir()) for name in self.MOUNTED):
            spare.stop()  # a trial folder that holds files already (a rerun's) keeps them: no spare's folders
            spare = None
        if spare is None:
            self._run()
        else:
            self._adopt(spare)
        self.spares.refill(kind, self._start_spare)

    def _start_spare(self) -> DockerSandbox:
        box = DockerSandbox(self.trial.parent / ".spares" / uuid.uuid4().hex[:12], self.image, self.spec, self.proxy,
                            self.spares)
        box.spare = True
        try:
            box.start()
        except BaseException:
            box.stop()  # whatever it got as far as starting
            raise
        return box

    def _adopt(self, spare: DockerSandbox) -> None:
        """The spare's container becomes this trial's: its mounted folders move into the trial's (a bind mount
        follows its folder, renamed on the same file system), its forwarder and name come along."""
        for name in self.MOUNTED:
            shutil.rmtree(self.trial / name)  # made empty a moment ago
            os.rename(spare.trial / name, self.trial / name)
        self.name, self.bridge, self.forwarder, self.origin = spare.name, spare.bridge, spare.forwarder, spare.trial
        self.uids = spare.uids

    def _run(self) -> None:
        _reaper(os.getpid())
        for name in ("logs/agent", "logs/verifier"):  # made on the host: no exec in the container to make them
            (self.trial / name).mkdir(parents=True, exist_ok=True)
        for name in self.SEEDED:
            self._seed(name)
        for name in (*self.MOUNTED, "logs/agent", "logs/verifier"):
            (self.trial / name).chmod(0o777)  # the image's USER may not be root
        (self.trial / "logs").chmod(0o1777)  # sticky: what the agent left cannot swap /logs/verifier for its own
        spec, main = self.spec, self._main()
        if spec.compose is not None:  # its services beside it, on a network of the trial's own
            self.compose_files = compose.up_trial(self.name, self.trial / ".compose", spec.compose, main,
                                                  image=self.image, digest=compose_digest(spec),
                                                  internet=spec.allow_internet, timeout_s=spec.build_timeout_s)
        else:
            argv = ["docker", "run", "-d", "--name", self.name, "--network", "bridge" if spec.allow_internet
                    else "none", "-w", main["working_dir"], "--label", f"{LABEL}={os.getpid()}"]
            argv += (["--cpus", str(main["cpus"])] if "cpus" in main else []) + \
                (["--memory", main["mem_limit"]] if "mem_limit" in main else [])
            argv += [arg for key, value in main["environment"].items() for arg in ("-e", f"{key}={value}")]
            argv += [arg for volume in main["volumes"] for arg in ("-v", volume)]
            result = subprocess.run(argv + [self.image, *main["command"]], capture_output=True, text=True)
            if result.returncode != 0:
                raise SandboxError(f"docker could not start {self.image}: {result.stderr.strip()[:300]}")
        if image_config(self.image).get("Entrypoint"):
            self._running()
        users = {self.user, spec.agent_user or self.user, spec.verifier_user or self.user} - ROOT
        self._known(users)
        if users:  # (the workdir: `docker run -w` makes it)
            self._traversable(agent_program_paths())
        if self.proxy:
            self._forward()
        if spec.healthcheck:
            self._healthy(spec.healthcheck)

    def _main(self) -> dict:
        """The trial's container as a compose service: `docker run`'s arguments, or compose's `main`."""
        main = {"container_name": self.name, "working_dir": self.workdir, "environment": dict(self.spec.env),
                "command": ["sh", "-c", REAPER], "labels": {LABEL: str(os.getpid())},
                "volumes": [f"{self.trial / name}:/{name}" for name in self.MOUNTED] +
                           [f"{path}:{path}:ro" for path in agent_program_paths()]}
        if self.spec.cpus:
            main["cpus"] = _host_cpus(self.spec.cpus)
        if self.spec.memory_mb:
            main["mem_limit"] = f"{self.spec.memory_mb}m"
        return main

    def _root(self, command: str, timeout_s: float = 60) -> ExecResult:
        return run_process(["docker", "exec", "-u", "root", self.name, "sh", "-c", command], timeout_s, kill_group)

    @property
    def guarded(self) -> bool:
        """A non-root agent and a verifier that is someone else: what the agent left running (kept, as Harbor
        keeps it) must not rewrite the verifier's tests or rewards, so /tests and /logs/verifier are closed to it
        for the verifier. A root agent can do anything in its container, there as in Harbor."""
        agent, verifier = self.spec.agent_user or self.user, self.spec.verifier_user or self.user
        return agent not in ROOT and agent != verifier

    def _open(self, inside: str, paths) -> None:
        """The host's `paths`, under the trial's folder mounted at `inside`, open to every user (the image's USER
        may not be root); or, under /tests and /logs/verifier of a guarded trial, the verifier's user's alone."""
        parts = Path(inside).parts
        closed = self.guarded and (parts[1:2] == ("tests",) or parts[1:3] == ("logs", "verifier"))
        owner = max(self.uids.get(self.spec.verifier_user or self.user, 0), 0)
        for path in paths:
            if path.is_symlink():
                continue
            if not closed:
                path.chmod(0o777 if path.is_dir() else path.stat().st_mode & 0o7777 | 0o666)
                continue
            try:
                os.chown(path, owner, owner)
            except PermissionError:  # not root on the host (Docker through its group): closed all the same
                warn_once(f"cannot give {inside} to the verifier's user (uid {owner}) as a non-root process: "
                          "a non-root verifier could not write its rewards there")
            path.chmod(0o755 if path.is_dir() else path.stat().st_mode & 0o7755 | 0o444)

    def _running(self) -> None:
        """An image's ENTRYPOINT runs first, with the idle command as its arguments (Harbor's order): one that
        ends instead (it ignores them) ends the container, and every exec would fail in it."""
        state = docker_cli("inspect", "--format", "{{.State.Running}} {{.State.ExitCode}}", self.name).stdout.split()
        if state[:1] != ["true"]:
            logs = docker_cli("logs", "--tail", "20", self.name)
            raise SandboxError(f"{self.image}'s ENTRYPOINT {image_config(self.image)['Entrypoint']} ended at once "
                               f"(exit {state[1] if len(state) > 1 else '?'}) instead of running its command "
                               f"`sh -c ...`, as Harbor runs it too: {(logs.stdout + logs.stderr).strip()[-300:]}. "
                               "Give the image an ENTRYPOINT that ends with exec \"$@\" (or none)")

    def _known(self, users: set[str]) -> None:
        """The non-root users its phases run as exist in the image (else every exec as one would fail); their uids
        kept, to give the verifier's folders to its user."""
        for user in sorted(users):
            found = self._root(f"id -u {shlex.quote(user)}")
            self.uids[user] = int(found.stdout.strip() or -1) if found.returncode == 0 else -1
            if found.returncode != 0:
                raise SandboxError(f"the task's user {user!r} ([agent] or [verifier] user in task.toml) does not exist "
                                   f"in {self.image}: create it in the Dockerfile (useradd) or name a user it has")

    def _traversable(self, paths: list[Path]) -> None:
        """An image's non-root USER must reach the mounted runtimes: their folders in the image (/root is 0700
        in Debian's) get the search bit, nothing more: their listing and files stay as the image has them."""
        folders = sorted({str(parent) for path in paths for parent in path.parents if parent != Path("/")})
        self._root("for d in " + " ".join(map(shlex.quote, folders)) + '; do [ -d "$d" ] && chmod a+x "$d"; done; true')

    def _forward(self) -> None:
        """The proxy's port on the container's own loopback: a forwarder in its network namespace (entered from
        the host, so the image needs no Python) to a Unix socket the host splices to the proxy."""
        from harness_trainer.sandboxes.forwarder import SocketBridge, in_trial

        host, port = self.proxy
        self.bridge = SocketBridge(None, host, port)
        socket_path = self.bridge.path
        pid = docker_cli("inspect", "--format", "{{.State.Pid}}", self.name).stdout.strip()
        # It watches this process: if the run is SIGKILLed, the forwarder exits and the shell around it removes
        # the container (stop() does both otherwise).
        forward = shlex.join(["nsenter", "-t", pid, "-n", *in_trial(), "--port", str(port),
                              "--socket", str(socket_path), "--watch", str(os.getpid())])
        self.forwarder = subprocess.Popen(
            ["sh", "-c", f"{forward}; docker rm -f {self.name} >/dev/null 2>&1; {compose.remove(self.name)}; "
                         f"rm -rf {self.bridge.folder}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        if self.forwarder.stdout.readline().strip() != "listening":
            raise SandboxError(f"the proxy forwarder did not start in {self.name}: "
                               f"{self.forwarder.stderr.read()[-300:]}")

    def _healthy(self, check: dict) -> None:
        """Harbor's healthcheck: the command must pass before the agent starts (retries, interval, timeout)."""
        deadline = time.monotonic() + float(check.get("start_period_sec", 0))
        failures, result = 0, None
        while True:
            result = self.exec(check["command"], float(check.get("timeout_sec", 30)))
            if result.returncode == 0:
                return
            if time.monotonic() >= deadline:
                failures += 1
                if failures >= int(check.get("retries", 3)):
                    break
            time.sleep(float(check.get("interval_sec", 5)))
        raise SandboxError(f"the task's healthcheck `{check['command']}` failed {failures} times: "
                           f"{(result.stderr or result.stdout).strip()[-300:]}")

    def exec(self, command: str, timeout_s: float, env: dict[str, str] | None = None,
             user: str | None = None) -> ExecResult:
        argv = ["docker", "exec", "-w", self.workdir] + (["-u", user] if user else [])
        for key, value in {"HOME": "/home", **(env or {})}.items():  # the image's PATH and ENV stay its own
            argv += ["-e", f"{key}={value}"]
        # As in Harbor, what a finished command left running (a server the tests will query) stays until the
        # container goes. One cut short (a timeout, a cancel) is ended whole: killing the docker CLI stops nothing
        # inside, so a root exec kills its processes (a trial's execs run one at a time).
        result = self.execs.run(argv + [self.name, "bash", "-c", command], timeout_s)
        if result.returncode == 1 and result.stderr.startswith("Error response from daemon") \
                and "is not running" in result.stderr:  # it never ran: as a command that could not start (126)
            return dataclasses.replace(result, returncode=126, stderr=f"the trial's container {self.name} is not "
                                       f"running (its init or ENTRYPOINT ended): {result.stderr.strip()[:200]}")
        if result.timed_out or self.execs.cancelled or result.returncode < 0:
            self._root(KILL_EXECS)
        return result

    def cancel(self) -> None:
        """Stop the exec in progress (from another thread) and refuse later ones: the rollout ends cancelled."""
        self.execs.cancel()

    def upload(self, src: Path, dst: str) -> None:
        """One docker call: the files as a tar stream into the container's `tar` (docker cp and the mkdir and chmod
        around it were three). An image without tar gets the three; a mounted folder (/tests) none."""
        if self._mounted(dst):
            super().upload(src, dst)
            self._open(dst, [target := self.host_path(dst), *(target.rglob("*") if target.is_dir() else ())])
            return
        if self._untar(Path(src), dst) == 127:
            self._root(f"mkdir -p '{dst}'" if Path(src).is_dir() else f"mkdir -p '{Path(dst).parent}'")
            source = f"{src}/." if Path(src).is_dir() else str(src)
            copied = docker_cli("cp", source, f"{self.name}:{dst}")
            if copied.returncode != 0:
                raise SandboxError(f"could not copy {src} into {self.name}:{dst}: {copied.stderr.strip()[:300]}")
            self._root(f"chmod -R a+rwX '{dst}'")  # docker cp leaves root's files; the image's USER may not be root

    def _untar(self, src: Path, dst: str) -> int:
        """`src` (a folder's contents, or a file named as `dst`) unpacked at `dst` as root's files, then opened to
        every user as docker cp's road does. Returns tar's status: 127 when the image has no tar."""
        import tarfile

        folder, name = (dst, ".") if src.is_dir() else (str(Path(dst).parent), Path(dst).name)
        script = (f"command -v tar >/dev/null || exit 127; mkdir -p {shlex.quote(folder)} && tar -xf - -C "
                  f"{shlex.quote(folder)} && chmod -R a+rwX {shlex.quote(dst)}")
        as_root = lambda info: info.replace(uid=0, gid=0, uname="root", gname="root", deep=False)  # noqa: E731
        process = subprocess.Popen(["docker", "exec", "-i", "-u", "root", self.name, "sh", "-c", script],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            with tarfile.open(fileobj=process.stdin, mode="w|") as archive:
                archive.add(src, arcname=name, filter=as_root)
        except BrokenPipeError:  # tar is missing or failed: its status says which
            pass
        _, err = process.communicate(timeout=600)  # closes its input: tar sees the end
        if process.returncode not in (0, 127):
            raise SandboxError(f"could not copy {src} into {self.name}:{dst}: {err.decode(errors='replace')[:300]}")
        return process.returncode

    def _mounted(self, inside: str) -> bool:
        """Under a folder bind-mounted from the trial's (/logs, /home): read and cleared on the host, no docker call."""
        parts = Path(inside).parts
        return len(parts) > 1 and parts[0] == "/" and parts[1] in self.MOUNTED

    def download(self, src: str, dst: Path) -> None:
        if self._mounted(src):
            try:
                return super().download(src, dst)
            except PermissionError:  # a file the container's root kept to itself, and this process is not root
                pass
        copied = docker_cli("cp", f"{self.name}:{src}", str(dst))
        if copied.returncode != 0:
            raise FileNotFoundError(f"{src} in {self.name}: {copied.stderr.strip()[:200]}")

    def _seed(self, name: str) -> None:
        """The trial's mounted folder given what the image keeps there (a /tests of reference data, a /home)."""
        if seed := image_folder(self.image, f"/{name}"):
            shutil.copytree(seed, self.trial / name, symlinks=True, dirs_exist_ok=True)
            self._open(f"/{name}", (self.trial / name).rglob("*"))

    def clear(self, inside: str) -> None:
        """Emptied; /tests back to what the image holds there (the verifier's tests go on top, as in Harbor, and
        whatever the agent changed in it is gone)."""
        if self._mounted(inside):  # closed first (if it is to be): nothing the agent left can add to it meanwhile
            self._open(inside, [self.host_path(inside)])
        self._empty(inside)
        if self._mounted(inside) and inside.strip("/") in self.SEEDED:
            self._seed(inside.strip("/"))

    def _empty(self, inside: str) -> None:
        if self._mounted(inside):
            super().clear(inside)
            path = self.host_path(inside)
            if not any(path.iterdir()):  # else the container's root made what this process may not remove
                self._open(inside, [path])
                return
        self._root(f"rm -rf '{inside}' && mkdir -p '{inside}' && chmod 777 '{inside}'")

    def stop(self) -> None:
        """With spares, in the background (`spares.settle()` waits; the provider's close does): its trial's record
        is whole, and a removal is ~0.2 s the next rollout need not wait for. Without, at once."""
        if self.spares is None:
            return self._remove()
        if self.kind is not None:
            self.spares.ended(self.kind, self._start_spare)
            self.kind = None
        self.spares.discard(self._remove)

    def _remove(self) -> None:
        if self.forwarder is not None:
            kill_group(self.forwarder)
            self.forwarder.wait()
        if self.bridge is not None:
            self.bridge.close()
        if self.compose_files:
            compose.down(self.name, self.compose_files)
        else:
            docker_cli("rm", "-f", self.name)
        # A spare's folder is no trial's record (an adopted one's: what docker cp made again where its mounts were)
        for folder in (self.trial if self.spare else None, self.origin):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
