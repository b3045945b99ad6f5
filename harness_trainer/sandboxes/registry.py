"""Which sandbox a trial runs in, by name (`--sandbox`), and the checks made before the first rollout.

    auto     (default) each task where it can run: a task with an image (environment/Dockerfile or
             docker_image) in a container, any other in a bubblewrap jail
    local    bubblewrap (bubblewrap.py): tasks that need an image are refused up front with the reason
    docker   every task in a container (containers.py); a task without an image gets images.DEFAULT_IMAGE
    e2b      E2B's cloud (needs --public-url)
    harbor[:ENV]  any Harbor environment backend, through Harbor's own package
    module:Class  a Sandbox of your own (base.py's protocol), made from a Trial

The names are a registry (SANDBOXES: name -> maker), not a chain of ifs. A run's sandboxes come from one
SandboxProvider (the kind, and what its trials share: the containers started ahead), closed by whoever made it.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from harness_trainer._exceptions import SandboxError
from harness_trainer.choices import refused
from harness_trainer.sandboxes.base import Sandbox
from harness_trainer.sandboxes.bubblewrap import LocalSandbox
from harness_trainer.sandboxes.containers import DockerSandbox
from harness_trainer.sandboxes.images import ContainerSpec, image_for, prepare_images, warn_once
from harness_trainer.sandboxes.remote import E2BSandbox, HarborSandbox
from harness_trainer.sandboxes.spares import Spares


@dataclass
class Trial:
    """What a sandbox kind is made from: one trial's folder and task, the proxy the agent must reach (and the only
    thing it may), and what a kind needs besides (`arg`: the part after `harbor:`)."""
    trial_dir: Path
    task: str = ""
    spec: ContainerSpec = field(default_factory=ContainerSpec)
    proxy: tuple[str, int] | None = None
    public_url: str | None = None
    task_dir: Path | None = None
    log_dir: Path | None = None
    arg: str = ""
    spares: Spares | None = None  # the provider's containers started ahead (containers only)


def _local(trial: Trial) -> Sandbox:
    if trial.spec.needs_container:
        raise SandboxError(f"task {trial.task} needs its own image and cannot run under --sandbox local")
    return LocalSandbox(trial.trial_dir, proxy=trial.proxy)


def _docker(trial: Trial) -> Sandbox:
    return DockerSandbox(trial.trial_dir, image_for(trial.task, trial.spec, trial.log_dir), trial.spec,
                         proxy=trial.proxy, spares=trial.spares)


# --sandbox NAME -> the maker of its sandbox; "auto" picks local or docker per task (kind_for). A name not here
# may be `module:Class`: a class taking the Trial (the Sandbox protocol, base.py).
SANDBOXES: dict[str, Callable[[Trial], Sandbox]] = {
    "local": _local,
    "docker": _docker,
    "e2b": lambda trial: E2BSandbox(public_url=trial.public_url),
    "harbor": lambda trial: HarborSandbox(trial.trial_dir, trial.arg or "docker", trial.task_dir),
}
KINDS = ("auto", *SANDBOXES)


def sandbox_maker(kind: str) -> Callable[[Trial], Sandbox]:
    """The maker for `--sandbox kind` (a registered name, harbor:ENV, or module:Class); a SandboxError lists
    the names otherwise."""
    name = kind.partition(":")[0]
    if name in SANDBOXES:
        return SANDBOXES[name]
    if ":" in kind and name not in KINDS:
        module, _, attr = kind.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise SandboxError(f"--sandbox {kind}: cannot import {attr} from {module} ({exc})") from None
    raise SandboxError(refused("--sandbox", kind, (*KINDS, "harbor:ENV", "module:Class"),
                               hint=" (ENV: any Harbor environment type, e.g. docker, modal, daytona, or "
                                    "module:Class; module:Class: a Sandbox of your own, made from a Trial)"))


def check_kind(kind: str) -> None:
    if kind != "auto":
        sandbox_maker(kind)


def kind_for(requested: str, spec: ContainerSpec) -> str:
    """The sandbox one task's trials get under `--sandbox requested`."""
    if requested == "auto":
        return "docker" if spec.needs_container else "local"
    return requested


def prepare(requested: str, tasks: dict[str, ContainerSpec], log_dir: Path | None = None,
            skip_failed: bool = False) -> dict[str, str]:
    """Before any rollout: refuse what cannot run where it was asked to, and build every image the run needs.
    Returns {task: image} for the tasks that run in containers (with skip_failed, less those whose image could
    not be had). One SandboxError lists every refused task."""
    check_kind(requested)
    if requested == "local":
        refused = [name for name, spec in tasks.items() if spec.needs_container]
        if refused:
            raise SandboxError(
                f"{len(refused)} task(s) need their own image (an environment/Dockerfile or [environment] "
                f"docker_image) and cannot run under --sandbox local, which would run them on this host's files "
                f"as if the image had been built: {', '.join(refused[:10])}{' ...' if len(refused) > 10 else ''}. "
                "Use --sandbox auto or docker (needs a Docker daemon)")
    in_containers = {name: spec for name, spec in tasks.items() if kind_for(requested, spec) == "docker"}
    return prepare_images(in_containers, log_dir, skip_failed) if in_containers else {}


def proxy_address(proxy_url: str) -> tuple[str, int]:
    """Where the host's half of a trial's forwarder connects: the capture proxy (on the loopback when it
    listens on every interface)."""
    parts = urlsplit(proxy_url)
    host = parts.hostname or "127.0.0.1"
    return ("127.0.0.1" if host in ("localhost", "0.0.0.0") else host), parts.port or 80


def make_sandbox(kind: str, trial_dir: Path, *, task: str = "", spec: ContainerSpec | None = None,
                 proxy_url: str | None = None, public_url: str | None = None, task_dir: Path | None = None,
                 log_dir: Path | None = None, spares: Spares | None = None) -> Sandbox:
    """One trial's sandbox. `proxy_url`: the capture proxy the agent must reach (and the only thing it may)."""
    spec = spec or ContainerSpec()
    kind = kind_for(kind, spec)
    trial = Trial(trial_dir, task, spec, proxy_address(proxy_url) if proxy_url else None, public_url, task_dir,
                  log_dir, arg=kind.partition(":")[2] if kind.partition(":")[0] in SANDBOXES else "", spares=spares)
    return sandbox_maker(kind)(trial)


class SandboxProvider:
    """The sandboxes of one run under `--sandbox kind`: each trial's made on demand, and what they share (the
    containers started ahead, spares.py) owned here; `close()` removes those. Whoever made it closes it."""

    def __init__(self, kind: str = "auto", *, public_url: str | None = None, log_dir: Path | None = None):
        check_kind(kind)
        self.kind, self.public_url, self.log_dir = kind, public_url, log_dir
        self.spares = Spares()

    def kind_for(self, spec: ContainerSpec) -> str:
        return kind_for(self.kind, spec)

    def make(self, trial_dir: Path, *, task: str = "", spec: ContainerSpec | None = None,
             proxy_url: str | None = None, task_dir: Path | None = None) -> Sandbox:
        return make_sandbox(self.kind, trial_dir, task=task, spec=spec, proxy_url=proxy_url,
                            public_url=self.public_url, task_dir=task_dir, log_dir=self.log_dir, spares=self.spares)

    def close(self) -> None:
        self.spares.close()

    def __enter__(self) -> SandboxProvider:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


DOWNLOADS = re.compile(r"\b(apt-get|apt|curl|wget|pip3? install|uvx?|npm (install|i)|npx)\b")


def _warn_users(sandbox: str, tasks: list) -> None:
    """[agent] / [verifier] user is applied by containers only (`docker exec -u`): said once, where it is not."""
    named = [task.name for task in tasks if (task.environment.agent_user or task.environment.verifier_user)
             and kind_for(sandbox, task.environment) != "docker"]
    if named:
        warn_once(f"{len(named)} task(s) name an [agent] or [verifier] user ({', '.join(named[:5])}), which only a "
                  f"container applies: under --sandbox {sandbox} every phase runs as the sandbox's own user")


def check_task_sandboxes(kind: str, tasks: list, log_dir: Path | None = None, *, public_url: str | None = None,
                         force_build: bool = False, skip_invalid: bool = False) -> list:
    """A run's check before it starts anything (`tasks`: rollouts' Task objects) under `--sandbox kind`: the
    sandbox exists and can be made (credentials, daemon, URL), no task is refused, every image is built. A
    bubblewrap task whose verifier seems to download its tools is warned about: a jail has no internet, and a
    verifier that cannot install its tools may well write 0. Returns the tasks to run: with `force_build` each
    task's Dockerfile is built even where it names a docker_image (set aside); with `skip_invalid` a task whose
    image could not be had is left out (named, with its build log)."""
    check_kind(kind)
    _warn_users(kind, tasks)
    if force_build:
        tasks = [dataclasses.replace(task, environment=dataclasses.replace(task.environment, image=None))
                 if task.environment.context is not None else task for task in tasks]
    if kind.partition(":")[0] in ("e2b", "harbor"):  # remote: made once to raise with what is missing
        make_sandbox(kind, Path("/nonexistent"), public_url=public_url)
        return tasks
    if kind not in KINDS:  # module:Class, your own: it is trusted to say what it needs when made
        return tasks
    offline = [task.name for task in tasks if kind_for(kind, task.environment) == "local"
               and any(DOWNLOADS.search(test.read_text(errors="replace")) for test in task.path.glob("**/test.sh"))]
    if offline:
        print(f"harness-train: warning: the verifier of {len(offline)} task(s) seems to download tools "
              f"({', '.join(offline[:5])}{' ...' if len(offline) > 5 else ''}), but runs in bubblewrap, which has no "
              "internet: give such tasks an environment/Dockerfile (or --sandbox docker), or their rewards may be "
              "0s that say nothing", file=sys.stderr)
    images = prepare(kind, {task.name: task.environment for task in tasks}, log_dir, skip_invalid)
    return [task for task in tasks if kind_for(kind, task.environment) != "docker" or task.name in images]
