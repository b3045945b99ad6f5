"""Task environments as Harbor builds them, in Docker: one image per task (its environment/ folder as the build
context of its Dockerfile, or its docker_image), one container per trial.

Images are tagged by the digest of their build context (`harness-task/NAME:DIGEST`), so a task is built once
and every rollout and later run reuses it until a file of its environment/ changes. `prepare_images` builds
every task's image before the first rollout: a build that fails is one error naming each failed task and its
build log, never a rollout that scores 0 in an environment that was not there.

Why Docker's CLI rather than Harbor's own environment classes: harbor needs Python 3.12 (the trainer is
3.11), so reusing them means a bridge process per trial (`--sandbox harbor:docker` still offers that); driving
the CLI directly is a few commands, lets the trial keep the project's own isolation (its network namespace
with the forwarder, agents/forwarder.py) and mounts, and reports build failures before any rollout.

How the agent gets into an image that may hold neither Python nor Node: its runtime is mounted, read-only, at
the same paths as on the host (the Python install behind the project's environments, .venv-mini, .tools:
opencode, claude-code and codex are single native binaries). The image needs a glibc-based userland with bash
(Debian, Ubuntu, python:*-slim: the common case); in one without (Alpine, distroless) the agent does not
start, and the rollout is unscorable with that reason. Under an image's non-root USER the folders above those
mounts (/root is 0700 in Debian's images) are given the search bit in the container, so the USER can reach them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness_trainer._exceptions import BuildError, SandboxError
from harness_trainer.agents.sandbox import ExecResult, Execs, TrialDirs, agent_program_paths, kill_group, run_process

DEFAULT_IMAGE = "python:3.11-slim"  # for a task with no image of its own run under --sandbox docker
LABEL = "harness-trainer.owner"  # every trial container carries its run's pid: orphans are found by it


@dataclass(frozen=True)
class ContainerSpec:
    """[environment] of a task, as the container sandbox applies it."""
    context: Path | None = None  # environment/ when it holds a Dockerfile: the build context
    image: str | None = None  # docker_image: used as it is
    workdir: str | None = None  # where commands run (default: the image's WORKDIR)
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None  # not enforced by overlay2 without quotas: warned
    build_timeout_s: float = 600.0
    allow_internet: bool = True  # true: the container's bridge (never the host's loopback); false: no network
    env: dict = field(default_factory=dict)  # set in the container (templates already resolved)
    healthcheck: dict | None = None  # command, interval_sec, timeout_sec, retries, start_period_sec

    @property
    def needs_container(self) -> bool:
        return self.context is not None or self.image is not None


def docker_ready() -> None:
    """The docker CLI and a daemon, or SandboxError saying what to do."""
    try:
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                              text=True, timeout=60)
    except FileNotFoundError:
        raise SandboxError("container tasks need Docker: `apt-get install docker.io` (make setup does this as root), "
                           "then start its daemon (`dockerd &`)") from None
    if info.returncode != 0:
        raise SandboxError("container tasks need a running Docker daemon (`docker info` fails: "
                           f"{(info.stderr or info.stdout).strip()[:200]}): start it (`dockerd &` as root; make "
                           "setup does), or run only tasks without an environment image under --sandbox local")


def _docker(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s)


def image_exists(image: str) -> bool:
    return _docker("image", "inspect", "--format", "{{.Id}}", image).returncode == 0


def context_digest(context: Path) -> str:
    """sha256 over every file of the build context: its path, whether it is executable, its bytes."""
    digest = hashlib.sha256()
    for path in sorted(p for p in context.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(context).as_posix()}\0{os.access(path, os.X_OK)}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


_LOCK = threading.Lock()
_BUILDING: dict[str, threading.Lock] = {}  # per tag: concurrent rollouts of one task wait for one build
_DIGESTS: dict[Path, tuple[tuple, str]] = {}


def _cached_digest(context: Path) -> str:
    """context_digest, read again only when a file's size, time or mode changed: every trial asks for its image,
    and a context can hold hundreds of megabytes of data."""
    files = sorted(p for p in context.rglob("*") if p.is_file())
    signature = tuple((str(p), st.st_size, st.st_mtime_ns, st.st_mode) for p in files for st in (p.stat(),))
    with _LOCK:
        known = _DIGESTS.get(context)
    if known and known[0] == signature:
        return known[1]
    digest = context_digest(context)
    with _LOCK:
        _DIGESTS[context] = (signature, digest)
    return digest


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9_.-]+", "-", name.lower()).strip("-.")[:100] or "task"



def image_for(name: str, spec: ContainerSpec, log_dir: Path | None = None) -> str:
    """The image a task's trials run: built (or reused) from its Dockerfile, its docker_image, or the default
    image for a task that has neither. BuildError when it cannot be had."""
    if spec.context is not None:
        tag = f"harness-task/{_slug(name)}:{_cached_digest(spec.context)[:16]}"
        with _LOCK:
            lock = _BUILDING.setdefault(tag, threading.Lock())
        with lock:  # concurrent rollouts of one task wait for one build
            if not image_exists(tag):
                _build(name, spec, tag, log_dir)
        return tag
    image = spec.image or DEFAULT_IMAGE
    if not image_exists(image):
        try:
            pulled = _docker("pull", image, timeout_s=spec.build_timeout_s)
            error = "" if pulled.returncode == 0 else (pulled.stderr or pulled.stdout).strip()[-300:]
        except subprocess.TimeoutExpired:
            error = f"timed out after {spec.build_timeout_s:.0f} s"
        if error:
            what = "its docker_image" if spec.image else f"the default image for tasks without one ({DEFAULT_IMAGE})"
            raise BuildError(f"task {name}: {what} {image} is not on this machine and could not be pulled: {error}. "
                             f"Build or load it (`docker load`, `docker tag`), or give the task an environment/"
                             "Dockerfile")
    return image


def _build(name: str, spec: ContainerSpec, tag: str, log_dir: Path | None) -> None:
    log = (log_dir or Path.cwd()) / f"build-{_slug(name)}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        try:
            built = subprocess.run(["docker", "build", "--force-rm", "--label", "harness-trainer.task=" + name,
                                    "-t", tag, str(spec.context)], stdout=out, stderr=subprocess.STDOUT,
                                   timeout=spec.build_timeout_s)
            failure = f"docker build exited {built.returncode}" if built.returncode else ""
        except subprocess.TimeoutExpired:
            failure = f"the build ran past build_timeout_sec ({spec.build_timeout_s:.0f} s)"
    if failure:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:])
        raise BuildError(f"task {name}: its environment/Dockerfile did not build ({failure}); the build log is {log}:"
                         f"\n{tail}")
    print(f"built the image of task {name} ({tag}) in {time.perf_counter() - started:.0f} s", file=sys.stderr)


def prepare_images(tasks: dict[str, ContainerSpec], log_dir: Path | None = None) -> dict[str, str]:
    """Every task's image, before any rollout: {task name: image}. One BuildError lists every task that failed.
    Also removes trial containers left by runs that no longer exist (a run killed with SIGKILL)."""
    docker_ready()
    remove_orphans()
    images, failed = {}, []
    for name, spec in tasks.items():
        try:
            images[name] = image_for(name, spec, log_dir)
        except BuildError as exc:
            failed.append(str(exc))
    if failed:
        raise BuildError(f"{len(failed)} of {len(tasks)} task environments could not be had; no rollout was "
                         "started:\n" + "\n".join(failed))
    return images


def remove_orphans() -> list[str]:
    """Remove trial containers whose run's process is gone; returns their names."""
    listed = _docker("ps", "-a", "--filter", f"label={LABEL}", "--format", '{{.Names}} {{.Label "' + LABEL + '"}}')
    gone = []
    for line in listed.stdout.splitlines():
        container, _, owner = line.partition(" ")
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _docker("rm", "-f", container)
            gone.append(container)
    return gone


def image_config(image: str) -> dict:
    """The image's Config (WorkingDir, Env, User, ...); {} when it cannot be read."""
    answer = _docker("image", "inspect", "--format", "{{json .Config}}", image)
    if answer.returncode != 0:
        return {}
    return json.loads(answer.stdout or "null") or {}


# The container's init: it idles, and reaps what dies under it. A process whose parent dies is handed to the init,
# so the ones each exec kills would otherwise stay as zombies for the container's life (`sleep infinity` never
# waits); the shell's `wait` reaps any child. A kill -9 -1 inside reaches its sleep, never itself: it sleeps again.
REAPER = "while :; do sleep 2147483647 & wait; done"


class DockerSandbox(TrialDirs):
    """One container per trial from the task's image: its WORKDIR, ENV and USER honoured, cpus and memory
    applied, no network or the bridge's (allow_internet), the trial's /logs and /home bind-mounted, the agent
    programs mounted read-only. The capture proxy is reached through the forwarder, in the container's own
    network namespace (agents/forwarder.py). Each exec is `docker exec`; afterwards every process but the
    container's init is killed, so nothing the agent started outlives its turn. `stop()` removes it."""

    MOUNTED = ("logs", "home")

    def __init__(self, trial_dir: str | Path, image: str, spec: ContainerSpec | None = None,
                 proxy: tuple[str, int] | None = None):
        super().__init__(trial_dir)
        self.image, self.spec, self.proxy = image, spec or ContainerSpec(), proxy
        config = image_config(image)
        self.workdir = self.spec.workdir or ((config.get("WorkingDir") or "/") if self.spec.needs_container else "/app")
        self.user = (config.get("User") or "root").split(":")[0]
        self.name = f"harness-trial-{os.getpid()}-{hashlib.sha1(str(self.trial).encode()).hexdigest()[:10]}"
        self.bridge = self.forwarder = None
        self.execs = Execs()

    def start(self) -> None:
        super().start()
        for name in ("logs/agent", "logs/verifier"):  # made on the host: no exec in the container to make them
            (self.trial / name).mkdir(parents=True, exist_ok=True)
        for name in (*self.MOUNTED, "logs/agent", "logs/verifier"):
            (self.trial / name).chmod(0o777)  # the image's USER may not be root
        spec, argv = self.spec, ["docker", "run", "-d", "--name", self.name, "--label", f"{LABEL}={os.getpid()}",
                                 "--network", "bridge" if self.spec.allow_internet else "none",
                                 "--entrypoint", "sh", "-w", self.workdir]
        if spec.cpus:
            argv += ["--cpus", str(spec.cpus)]
        if spec.memory_mb:
            argv += ["--memory", f"{spec.memory_mb}m"]
        for key, value in spec.env.items():
            argv += ["-e", f"{key}={value}"]
        for name in self.MOUNTED:
            argv += ["-v", f"{self.trial / name}:/{name}"]
        for path in agent_program_paths():
            argv += ["-v", f"{path}:{path}:ro"]
        result = subprocess.run(argv + [self.image, "-c", REAPER], capture_output=True, text=True)
        if result.returncode != 0:
            raise SandboxError(f"docker could not start {self.image}: {result.stderr.strip()[:300]}")
        if self.user not in ("root", "0"):  # (the workdir: `docker run -w` makes it)
            self._traversable(agent_program_paths())
        if self.proxy:
            self._forward()
        if spec.healthcheck:
            self._healthy(spec.healthcheck)

    def _root(self, command: str, timeout_s: float = 60) -> ExecResult:
        return run_process(["docker", "exec", "-u", "root", self.name, "sh", "-c", command], timeout_s, kill_group)

    def _traversable(self, paths: list[Path]) -> None:
        """An image's non-root USER must reach the mounted runtimes: their folders in the image (/root is 0700
        in Debian's) get the search bit, nothing more: their listing and files stay as the image has them."""
        folders = sorted({str(parent) for path in paths for parent in path.parents if parent != Path("/")})
        self._root("for d in " + " ".join(map(shlex.quote, folders)) + '; do [ -d "$d" ] && chmod a+x "$d"; done; true')

    def _forward(self) -> None:
        """The proxy's port on the container's own loopback: a forwarder in its network namespace (entered from
        the host, so the image needs no Python) to a Unix socket the host splices to the proxy."""
        from harness_trainer.agents.forwarder import SocketBridge, in_trial

        host, port = self.proxy
        self.bridge = SocketBridge(None, host, port)
        socket_path = self.bridge.path
        pid = _docker("inspect", "--format", "{{.State.Pid}}", self.name).stdout.strip()
        # It watches this process: if the run is SIGKILLed, the forwarder exits and the shell around it removes
        # the container (stop() does both otherwise).
        forward = shlex.join(["nsenter", "-t", pid, "-n", *in_trial(), "--port", str(port),
                              "--socket", str(socket_path), "--watch", str(os.getpid())])
        self.forwarder = subprocess.Popen(
            ["sh", "-c", f"{forward}; docker rm -f {self.name} >/dev/null 2>&1; rm -rf {self.bridge.folder}"],
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

    def exec(self, command: str, timeout_s: float, env: dict[str, str] | None = None) -> ExecResult:
        argv = ["docker", "exec", "-w", self.workdir]
        for key, value in {"HOME": "/home", **(env or {})}.items():  # the image's PATH and ENV stay its own
            argv += ["-e", f"{key}={value}"]
        # Nothing the command started outlives it. Run as root (most task images), it kills the rest itself on
        # its way out (kill -1: every process but the container's init and the caller), so the exec is one docker
        # call; a timeout or a cancel kills the CLI, not what runs inside, and an image's other USER cannot kill
        # what it started through sudo: then a root exec does it.
        inline = self.user in ("root", "0")
        wrapped = ["bash", "-c", 'bash -c "$0"; rc=$?; kill -9 -1 2>/dev/null; exit $rc', command] if inline \
            else ["bash", "-c", command]
        result = self.execs.run(argv + [self.name, *wrapped], timeout_s)
        if not inline or result.timed_out or self.execs.cancelled or result.returncode < 0:
            self._root("kill -9 -1 2>/dev/null; true")
        return result

    def cancel(self) -> None:
        """Stop the exec in progress (from another thread) and refuse later ones: the rollout ends cancelled."""
        self.execs.cancel()

    def upload(self, src: Path, dst: str) -> None:
        """One docker call: the files as a tar stream into the container's `tar` (docker cp and the mkdir and chmod
        around it were three). An image without tar gets the three."""
        if self._untar(Path(src), dst) == 127:
            self._root(f"mkdir -p '{dst}'" if Path(src).is_dir() else f"mkdir -p '{Path(dst).parent}'")
            source = f"{src}/." if Path(src).is_dir() else str(src)
            copied = _docker("cp", source, f"{self.name}:{dst}")
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
        copied = _docker("cp", f"{self.name}:{src}", str(dst))
        if copied.returncode != 0:
            raise FileNotFoundError(f"{src} in {self.name}: {copied.stderr.strip()[:200]}")

    def clear(self, inside: str) -> None:
        if self._mounted(inside):
            super().clear(inside)
            path = self.host_path(inside)
            if not any(path.iterdir()):  # else the container's root made what this process may not remove
                path.chmod(0o777)  # the image's USER may not be root
                return
        self._root(f"rm -rf '{inside}' && mkdir -p '{inside}' && chmod 777 '{inside}'")

    def stop(self) -> None:
        if self.forwarder is not None:
            kill_group(self.forwarder)
            self.forwarder.wait()
        if self.bridge is not None:
            self.bridge.close()
        _docker("rm", "-f", self.name)
