"""Task environments as Harbor builds them, in Docker: one image per task (its environment/ folder as the build
context of its Dockerfile, or its docker_image); a container per trial runs it (containers.py).

Images are tagged by the digest of their build context (`harness-task/NAME:DIGEST`), so a task is built once
and every rollout and later run reuses it until a file of its environment/ changes. `prepare_images` builds
every task's image before the first rollout: a build that fails is one error naming each failed task and its
build log, never a rollout that scores 0 in an environment that was not there.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness_trainer._exceptions import BuildError, SandboxError
from harness_trainer.sandboxes import compose

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
    compose: Path | None = None  # environment/docker-compose.yaml: services beside the trial's (compose.py)
    agent_user: str | None = None  # [agent] user: who runs the agent (and so the oracle's solve.sh); None: USER
    verifier_user: str | None = None  # [verifier] user: who runs test.sh; None: the image's USER

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


def docker_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s)


def image_exists(image: str) -> bool:
    return docker_cli("image", "inspect", "--format", "{{.Id}}", image).returncode == 0


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
    """The image a task's trials run (`_main_image`); a task with a docker-compose.yaml also gets the services
    it builds, once (compose.py)."""
    image = _main_image(name, spec, log_dir)
    if spec.compose is not None:
        if not shutil.which("docker-compose"):
            raise BuildError(f"task {name} has an environment/docker-compose.yaml and this machine has no "
                             "docker-compose: `apt-get install docker-compose` (make setup does, as root)")
        digest = compose_digest(spec)
        with _LOCK:
            lock = _BUILDING.setdefault(f"services:{digest}", threading.Lock())
        with lock:
            found, _ = compose.services(spec.compose)
            if any("build" in s and not image_exists(compose.built_image(n, digest)) for n, s in found.items()):
                _build_services(name, spec, image, digest, log_dir)
    return image


def compose_digest(spec: ContainerSpec) -> str:
    """What names a compose task's built services: its environment/ folder's digest."""
    return _cached_digest(spec.compose.parent)[:16]


def _main_image(name: str, spec: ContainerSpec, log_dir: Path | None = None) -> str:
    """The image of a task's trial container: its docker_image (Harbor's choice when a task has both; --force-build sets
    it aside: sandboxes.check_task_sandboxes), else built (or reused) from its Dockerfile, else the default
    image. A docker_image that cannot be had is built from the task's Dockerfile when it has one, with a
    warning. BuildError when there is no image."""
    if spec.image is not None:
        error = _UNAVAILABLE.get(spec.image) or _have(spec.image, spec.build_timeout_s)
        if not error:
            return spec.image
        if spec.context is None:
            raise BuildError(f"task {name}: its docker_image {spec.image} is not on this machine and could not be "
                             f"pulled: {error}. Build or load it (`docker load`, `docker tag`), or give the task an "
                             "environment/Dockerfile")
        _UNAVAILABLE[spec.image] = error  # each trial's call would try the pull again
        warn_once(f"task {name}: its docker_image {spec.image} could not be had ({error[:200]}): built from its "
                   "environment/Dockerfile instead")
    if spec.context is not None:
        tag = f"harness-task/{_slug(name)}:{_cached_digest(spec.context)[:16]}"
        with _LOCK:
            lock = _BUILDING.setdefault(tag, threading.Lock())
        with lock:  # concurrent rollouts of one task wait for one build
            if not image_exists(tag):
                _build(name, spec, tag, log_dir)
        return tag
    if error := _have(DEFAULT_IMAGE, spec.build_timeout_s):
        raise BuildError(f"task {name}: the default image for tasks without one ({DEFAULT_IMAGE}) is not on this "
                         f"machine and could not be pulled: {error}. Build or load it, or give the task an "
                         "environment/Dockerfile")
    return DEFAULT_IMAGE


def _have(image: str, timeout_s: float) -> str:
    """"" when the image is here (pulled if it was not), else why it cannot be had."""
    if image_exists(image):
        return ""
    try:
        pulled = docker_cli("pull", image, timeout_s=timeout_s)
        return "" if pulled.returncode == 0 else (pulled.stderr or pulled.stdout).strip()[-300:]
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f} s"


_UNAVAILABLE: dict[str, str] = {}  # docker_image -> why it could not be had (its task's Dockerfile built instead)


_WARNED: set[str] = set()


def warn_once(message: str, key: str | None = None) -> None:
    """Print a warning the first time its key (default: the message itself) is seen in this process."""
    if (key or message) not in _WARNED:
        _WARNED.add(key or message)
        print(f"harness-train: warning: {message}", file=sys.stderr)


HEREDOC = re.compile(r"^\s*(?:RUN|COPY|ADD)\b[^\n]*<<-?\s*[\"']?([A-Za-z_]\w*)", re.MULTILINE | re.IGNORECASE)


def uses_heredocs(dockerfile: str) -> bool:
    """A RUN/COPY/ADD `<<WORD` whose WORD closes it on a later line of its own (not a `<<` inside a string)."""
    return any(re.search(rf"^\s*{m.group(1)}\s*$", dockerfile[m.end():], re.MULTILINE)
               for m in HEREDOC.finditer(dockerfile))


@functools.cache
def buildkit() -> bool:
    """Whether this Docker builds with BuildKit (its buildx plugin): Debian's docker.io 20.10 has neither."""
    return subprocess.run(["docker", "buildx", "version"], capture_output=True).returncode == 0


def _build(name: str, spec: ContainerSpec, tag: str, log_dir: Path | None) -> None:
    dockerfile = (spec.context / "Dockerfile").read_text(errors="replace")
    if uses_heredocs(dockerfile) and not buildkit():  # the classic builder reads `<<EOF` lines as instructions
        raise BuildError(f"task {name}: its environment/Dockerfile uses heredocs (RUN <<EOF ...), which only "
                         "BuildKit builds, and this Docker has no BuildKit (no `docker buildx`; Debian's docker.io "
                         "20.10 ships none): install Docker's buildx plugin, or write the heredoc as RUN lines")
    _logged(["docker", "build", "--force-rm", "--label", "harness-trainer.task=" + name, "-t", tag, str(spec.context)],
            (log_dir or Path.cwd()) / f"build-{_slug(name)}.log", spec.build_timeout_s,
            f"task {name}: its environment/Dockerfile", f"the image of task {name} ({tag})")


def _build_services(name: str, spec: ContainerSpec, main_image: str, digest: str, log_dir: Path | None) -> None:
    """The services of a task's docker-compose.yaml that have `build:`, once, named by its environment/ digest."""
    found, _ = compose.services(spec.compose)
    wanted = [n for n, service in found.items() if "build" in service and n != compose.MAIN]
    with tempfile.TemporaryDirectory() as folder:
        files = compose.write_files(Path(folder), spec.compose, {"image": main_image}, digest, labels={})
        _logged(["docker-compose", "-p", f"harness-build-{digest}", *files, "build", "--force-rm", *wanted],
                (log_dir or Path.cwd()) / f"build-{_slug(name)}-services.log", spec.build_timeout_s,
                f"task {name}: a service of its docker-compose.yaml", f"the services of task {name}")


def _logged(argv: list[str], log: Path, timeout_s: float, what: str, done: str) -> None:
    """A build, its output in `log`; BuildError naming `what` did not build, with the log's last lines."""
    tool = " ".join(word for word in argv if word in ("docker", "docker-compose", "build"))
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        try:
            built = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
            failure = f"{tool} exited {built.returncode}" if built.returncode else ""
        except subprocess.TimeoutExpired:
            failure = f"the build ran past build_timeout_sec ({timeout_s:.0f} s)"
    if failure:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:])
        raise BuildError(f"{what} did not build ({failure}); the build log is {log}:\n{tail}")
    print(f"built {done} in {time.perf_counter() - started:.0f} s", file=sys.stderr)


def prepare_images(tasks: dict[str, ContainerSpec], log_dir: Path | None = None,
                   skip_failed: bool = False) -> dict[str, str]:
    """Every task's image, before any rollout: {task name: image}. One BuildError lists every task that failed;
    with skip_failed, those are left out of the answer and each is named on stderr with its build log instead.
    Also removes trial containers left by runs that no longer exist (a run killed with SIGKILL)."""
    docker_ready()
    remove_orphans()
    images, failed = {}, []
    for name, spec in tasks.items():
        try:
            images[name] = image_for(name, spec, log_dir)
        except BuildError as exc:
            failed.append(str(exc))
    if failed and skip_failed:
        print(f"harness-train: warning: {len(failed)} of {len(tasks)} task environments could not be had; those "
              "tasks are skipped (--skip-invalid-tasks):\n" + "\n".join(failed), file=sys.stderr)
    elif failed:
        raise BuildError(f"{len(failed)} of {len(tasks)} task environments could not be had; no rollout was "
                         "started:\n" + "\n".join(failed))
    return images


def remove_orphans() -> list[str]:
    """Remove trial containers (and compose trials' networks) whose run's process is gone; returns the
    containers' names."""
    listed = docker_cli("ps", "-a", "--filter", f"label={LABEL}", "--format", '{{.Names}} {{.Label "' + LABEL + '"}}')
    gone = []
    for line in listed.stdout.splitlines():
        container, _, owner = line.partition(" ")
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            docker_cli("rm", "-f", container)
            gone.append(container)
    listed = docker_cli("network", "ls", "--filter", f"label={LABEL}", "--format",
                        '{{.Name}} {{.Label "' + LABEL + '"}}')
    for line in listed.stdout.splitlines():  # a compose trial's network (compose.py)
        network, _, owner = line.partition(" ")
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            docker_cli("network", "rm", network)
    return gone


_CONFIGS: dict[str, dict] = {}  # every trial's start asked Docker; a task's tag names one build (its digest)


_FOLDERS: dict[tuple[str, str], Path | None] = {}
FOLDER_CACHE = Path(tempfile.gettempdir()) / "harness-image-folders"


def image_folder(image: str, inside: str) -> Path | None:
    """A copy on the host of what the image holds at `inside` (/tests, /home), once per image; None when it holds
    nothing there. A trial bind-mounts its own folder there (read and cleared on the host), which would hide the
    image's files: the container sandbox seeds the trial's folder with this copy (Harbor keeps them)."""
    if (image, inside) in _FOLDERS:
        return _FOLDERS[(image, inside)]
    digest = docker_cli("image", "inspect", "--format", "{{.Id}}", image).stdout.strip().replace("sha256:", "")
    target = FOLDER_CACHE / (digest or _slug(image))[:24] / inside.strip("/")
    if not target.is_dir():
        created = docker_cli("create", "--label", f"{LABEL}={os.getpid()}", "--entrypoint", "sh", image)
        if created.returncode != 0:
            return None
        container = created.stdout.strip()
        try:
            copied = subprocess.run(["docker", "cp", f"{container}:{inside}/.", "-"], capture_output=True, timeout=300)
        finally:
            docker_cli("rm", "-f", container)
        if copied.returncode == 0:  # (not there: docker cp says so and fails)
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=target.parent))  # then renamed: a half-made copy is never used
            with tarfile.open(fileobj=io.BytesIO(copied.stdout)) as archive:
                archive.extractall(staging, filter="data")
            try:
                os.rename(staging, target)
            except OSError:  # another process made it first
                shutil.rmtree(staging, ignore_errors=True)
    found = target if target.is_dir() and any(target.iterdir()) else None
    _FOLDERS[(image, inside)] = found
    return found


def image_config(image: str) -> dict:
    """The image's Config (WorkingDir, Env, User, ...); {} when it cannot be read (not kept: it may be built yet)."""
    if image in _CONFIGS:
        return _CONFIGS[image]
    answer = docker_cli("image", "inspect", "--format", "{{json .Config}}", image)
    if answer.returncode != 0:
        return {}
    _CONFIGS[image] = config = json.loads(answer.stdout or "null") or {}
    return config
