"""A task's environment/docker-compose.yaml: its services beside the trial's container, as Harbor runs them.

Harbor merges the task's compose file into its own (`environments/docker/docker.py`): the trial's container is
the service `main`, from the task's Dockerfile or docker_image with `sh -c "sleep infinity"` as its command; the
task's file adds services (a database, a server its tests query) and may add to `main` (depends_on,
environment). Here the same merge goes to Debian's docker-compose (1.29), three files in order:

    main.yaml   `main` as `docker run` would start it (containers.py): image, the idle command, workdir, env,
                limits, the trial's mounts
    the task's  its services, and what it adds to `main`
    labels.yaml the run's label on every service and the network, so a run killed with SIGKILL leaves none
                (containers.py's reaper, images.remove_orphans); a built service's image named once per task;
                the network, internal and without the host's address when the task has no internet

Each trial is a project of its own (its container's name): its services answer to their names on its network
only, and the capture proxy stays the agent's one road out (the forwarder runs in main's network namespace).
A service with `build:` is built once, before any rollout (images.py), under a name of the task's.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from harness_trainer._exceptions import SandboxError

MAIN = "main"
MAIN_OWN = ("image", "build", "network_mode", "networks", "container_name")  # the trial's to set, not the task's


def services(compose: Path) -> tuple[dict, list[str]]:
    """The task's services, and what is wrong with its file (each problem a sentence naming the file)."""
    try:
        config = yaml.safe_load(compose.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, OSError) as exc:
        return {}, [f"{compose}: not valid YAML ({exc}); fix the file"]
    found = config.get("services") if isinstance(config, dict) else None
    if not isinstance(found, dict) or not all(isinstance(s, dict) for s in found.values()):
        return {}, [f"{compose}: needs a `services:` table of services"]
    main = found.get(MAIN) or {}
    problems = [f"{compose}: services.main.{key} is the trial's to set (the task's Dockerfile or docker_image, "
                f"the trial's own network): remove it" for key in MAIN_OWN if key in main]
    problems += [f"{compose}: service {name} has network_mode: host, which would put it on this machine's network: "
                 "remove it" for name, service in found.items() if service.get("network_mode") == "host"]
    return found, problems


def built_image(service: str, digest: str) -> str:
    """A built service's image, named by its task's environment/ folder (its digest) and the service."""
    return f"harness-service/{service.lower()}:{digest}"


def write_files(folder: Path, compose: Path, main: dict, digest: str, *, labels: dict,
                internet: bool = True) -> list[str]:
    """Our two files in `folder` (main.yaml, labels.yaml) and the task's between them: the `-f` arguments."""
    found, _ = services(compose)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "main.yaml").write_text(yaml.safe_dump({"services": {MAIN: main}}))
    # The network in the last file: a later file's definition replaces an earlier one's whole. Without internet:
    # internal (no route out) and no address of the host's on its bridge, so the host's own services (anything
    # listening on 0.0.0.0, reached through a bridge's gateway) are out of reach too
    network = {"labels": labels}
    if not internet:
        network.update(internal=True, driver_opts={"com.docker.network.bridge.inhibit_ipv4": "true"})
    named = {name: {"labels": labels, **({"image": built_image(name, digest)} if "build" in service else {})}
             for name, service in found.items() if name != MAIN}
    (folder / "labels.yaml").write_text(yaml.safe_dump({
        "services": {MAIN: {"labels": labels}, **named}, "networks": {"default": network}}))
    # the task's relative paths (`build: ./web`) are its folder's, not those of the first file's folder
    return ["--project-directory", str(compose.parent), "-f", str(folder / "main.yaml"), "-f", str(compose), "-f",
            str(folder / "labels.yaml")]


def up_trial(project: str, folder: Path, compose: Path, main: dict, *, image: str, digest: str, internet: bool,
             timeout_s: float) -> list[str]:
    """A trial's project started: `main` (containers.py's container, as a service) with the task's services;
    `depends_on` conditions waited for, as compose waits. Returns its files' `-f` arguments (for `down`);
    SandboxError with compose's own words when it cannot start (nothing of it left)."""
    files = write_files(folder, compose, {"image": image, **main}, digest, labels=main["labels"], internet=internet)
    try:
        done = subprocess.run(["docker-compose", "-p", project, *files, "up", "-d", "--no-build"],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        down(project, files)
        raise SandboxError(f"the task's services did not start within {timeout_s:.0f} s (docker-compose up)") from None
    if done.returncode != 0:
        down(project, files)
        raise SandboxError(f"the task's services could not start (docker-compose up exited {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-400:]}")
    return files


def down(project: str, files: list[str]) -> None:
    """The project's containers, network and volumes removed."""
    subprocess.run(["docker-compose", "-p", project, *files, "down", "-v", "-t", "0", "--remove-orphans"],
                   capture_output=True, text=True, timeout=300)


def remove(project: str) -> str:
    """A shell line that removes a project without its files (a run killed with SIGKILL: the forwarder's shell)."""
    return (f"docker ps -aq --filter label=com.docker.compose.project={project} | xargs -r docker rm -f >/dev/null "
            f"2>&1; docker network rm {project}_default >/dev/null 2>&1")
