"""Which sandbox a trial runs in, by name (`--sandbox`), and the checks made before the first rollout.

    auto     (default) each task where it can run: a task with an image (environment/Dockerfile or
             docker_image) in a container, any other in a bubblewrap jail
    local    bubblewrap (agents/sandbox.py): tasks that need an image are refused up front with the reason
    docker   every task in a container (agents/containers.py); a task without an image gets DEFAULT_IMAGE
    e2b      E2B's cloud (needs --public-url)
    harbor[:ENV]  any Harbor environment backend, through Harbor's own package
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

from harness_trainer.agents.containers import ContainerSpec, DockerSandbox, image_for, prepare_images
from harness_trainer.agents.sandbox import E2BSandbox, HarborSandbox, LocalSandbox, Sandbox, SandboxError

KINDS = ("auto", "local", "docker", "e2b", "harbor")


def check_kind(kind: str) -> None:
    if kind.partition(":")[0] not in KINDS:
        raise SandboxError(f"unknown sandbox '{kind}': choose auto, local, docker, e2b or harbor[:ENV] (ENV: any "
                           "Harbor environment type, e.g. docker, modal, daytona, or module:Class)")


def kind_for(requested: str, spec: ContainerSpec) -> str:
    """The sandbox one task's trials get under `--sandbox requested`."""
    if requested == "auto":
        return "docker" if spec.needs_container else "local"
    return requested


def prepare(requested: str, tasks: dict[str, ContainerSpec], log_dir: Path | None = None) -> dict[str, str]:
    """Before any rollout: refuse what cannot run where it was asked to, and build every image the run needs.
    Returns {task: image} for the tasks that run in containers. One SandboxError lists every refused task."""
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
    return prepare_images(in_containers, log_dir) if in_containers else {}


def proxy_address(proxy_url: str) -> tuple[str, int]:
    """Where the host's half of a trial's forwarder connects: the capture proxy (on the loopback when it
    listens on every interface)."""
    parts = urlsplit(proxy_url)
    host = parts.hostname or "127.0.0.1"
    return ("127.0.0.1" if host in ("localhost", "0.0.0.0") else host), parts.port or 80


def make_sandbox(kind: str, trial_dir: Path, *, task: str = "", spec: ContainerSpec | None = None,
                 proxy_url: str | None = None, public_url: str | None = None, task_dir: Path | None = None,
                 log_dir: Path | None = None) -> Sandbox:
    """One trial's sandbox. `proxy_url`: the capture proxy the agent must reach (and the only thing it may)."""
    check_kind(kind)
    spec = spec or ContainerSpec()
    kind = kind_for(kind, spec)
    proxy = proxy_address(proxy_url) if proxy_url else None
    if kind == "local":
        if spec.needs_container:
            raise SandboxError(f"task {task} needs its own image and cannot run under --sandbox local")
        return LocalSandbox(trial_dir, proxy=proxy)
    if kind == "docker":
        return DockerSandbox(trial_dir, image_for(task, spec, log_dir), spec, proxy=proxy)
    if kind == "e2b":
        return E2BSandbox(public_url=public_url)
    return HarborSandbox(trial_dir, kind.partition(":")[2] or "docker", task_dir)


DOWNLOADS = re.compile(r"\b(apt-get|apt|curl|wget|pip3? install|uvx?|npm (install|i)|npx)\b")


def check_task_sandboxes(cfg, tasks: list, log_dir: Path | None = None) -> dict[str, str]:
    """A run's check before it starts anything (`cfg`: a RolloutConfig; `tasks`: rollouts' Task objects): the
    sandbox exists and can be made (credentials, daemon, URL), no task is refused, every image is built. A
    bubblewrap task whose verifier seems to download its tools is warned about: a jail has no internet, and a
    verifier that cannot install its tools may well write 0."""
    check_kind(cfg.sandbox)
    if cfg.sandbox == "e2b" or cfg.sandbox.startswith("harbor"):
        make_sandbox(cfg.sandbox, Path("/nonexistent"), public_url=cfg.public_url)  # raises with what is missing
        return {}
    offline = [task.name for task in tasks if kind_for(cfg.sandbox, task.environment) == "local"
               and DOWNLOADS.search((task.tests_dir / "test.sh").read_text(errors="replace"))]
    if offline:
        print(f"harness-train: warning: the verifier of {len(offline)} task(s) seems to download tools "
              f"({', '.join(offline[:5])}{' ...' if len(offline) > 5 else ''}), but runs in bubblewrap, which has no "
              "internet: give such tasks an environment/Dockerfile (or --sandbox docker), or their rewards may be "
              "0s that say nothing", file=sys.stderr)
    return prepare(cfg.sandbox, {task.name: task.environment for task in tasks}, log_dir)
