"""Real Harbor-shaped tasks as Harbor runs them: images built by a real Docker daemon from the tasks'
Dockerfiles (base images made locally by scripts/base_images.sh), a container per trial, the verifier and the
oracle as Harbor's, and a trial that reaches its own capture session and nothing else (bubblewrap and Docker)."""

from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest
from harbor_corpus import (
    BARE_IMAGE,
    build_task,
    compose_task,
    corpus,
    image_task,
    multi_step_task,
    plain_task,
    service_task,
)

from harness_trainer._exceptions import BuildError, SandboxError, TaskError
from harness_trainer.rollouts.tasks import load_dataset, load_task
from harness_trainer.sandboxes.bubblewrap import LocalSandbox
from harness_trainer.sandboxes.containers import DockerSandbox
from harness_trainer.sandboxes.images import LABEL, buildkit, docker_ready, image_for
from harness_trainer.sandboxes.registry import prepare
from harness_trainer.sandboxes.spares import Spares


@pytest.fixture(scope="module")
def docker():
    """A running daemon: make setup starts one as root; elsewhere the container tests cannot run."""
    try:
        docker_ready()
    except SandboxError as exc:
        if os.geteuid() == 0:
            pytest.fail(f"make setup should have started Docker: {exc}")
        pytest.skip(f"no Docker daemon and not root: {exc}")


def trial_containers() -> list[str]:
    listed = subprocess.run(["docker", "ps", "-a", "--filter", f"label={LABEL}={os.getpid()}", "--format",
                             "{{.Names}}"], capture_output=True, text=True)
    return listed.stdout.split()


def test_the_task_format_is_read_as_harbor_writes_it(tmp_path, monkeypatch, capsys):
    tasks = {t.name: t for t in load_dataset(str(corpus(tmp_path / "corpus")))}
    build, image, plain = tasks["build"], tasks["image"], tasks["plain"]
    assert build.needs_container and image.needs_container and not plain.needs_container
    assert build.title == "harness-test/build" and build.verifier_timeout_s == 60
    assert (build.environment.agent_user, build.environment.verifier_user) == ("agent", "root")
    assert image.environment.agent_user is None  # the image's USER
    assert (build.environment.cpus, build.environment.memory_mb, build.environment.build_timeout_s) == (1, 512, 300)
    assert build.app_files() is None  # the Dockerfile's COPY makes /app; nothing is copied around it
    assert image.environment.image == BARE_IMAGE and image.environment.workdir == "/work"
    assert not image.environment.allow_internet and image.environment.env == {"WORD_SOURCE": "the solution's env"}
    assert image.verifier_env == {"EXPECTED": "seven"} and image.solution_env == {"SOLUTION_WORD": "seven"}
    monkeypatch.setenv("HARNESS_CORPUS_WORD", "eight")  # a template takes the host's value over its default
    assert load_task(tmp_path / "corpus" / "image").verifier_env == {"EXPECTED": "eight"}
    assert load_task(tmp_path / "corpus" / "plain").verifier_timeout_s == 60
    steps = tasks["multi-step"]  # Harbor 0.26's [[steps]]: a folder each, in order
    assert [s.name for s in steps.steps] == ["create", "extend", "count"] and steps.reward_strategy == "mean"
    assert steps.instruction == steps.steps[0].instruction == "Create /app/notes.txt holding the line alpha."
    assert steps.steps[0].min_reward == {"reward": 1.0} and steps.steps[1].verifier_env == {"EXPECTED_LINES": "2"}
    # the agent's timeout is the task's own; the verifier's is Harbor's default
    assert steps.steps[0].agent_timeout_s == 600 and steps.steps[0].verifier_timeout_s == 600
    assert [d.name for d in steps.steps[2].tests_dirs(steps.path)] == ["tests"]  # the shared ones only
    # the defaults are Harbor's
    (tmp_path / "corpus" / "plain" / "task.toml").write_text(
        '[metadata]\nx = 1\n\n[verifier.odd]\n[frobnicate]\nk = 1\n')
    assert load_task(tmp_path / "corpus" / "plain").verifier_timeout_s == 600
    assert "unknown key frobnicate" in capsys.readouterr().err  # warned, not fatal
    # every problem of every task in one error; or the readable ones with --skip-invalid-tasks
    bad = tmp_path / "bad"
    for make in (plain_task, build_task):
        make(bad)
    broken_steps = multi_step_task(bad)
    (broken_steps / "steps" / "count" / "instruction.md").unlink()
    toml = broken_steps / "task.toml"
    toml.write_text(toml.read_text().replace("min_reward = 1.0", 'min_reward = "high"'))
    (bad / "build" / "task.toml").write_text(
        '[agent]\nnetwork_mode = "public"\nuser = true\n'
        '[verifier]\ntimeout_sec = -1\nenv = { K = "${HARNESS_NOT_SET_ANYWHERE}" }\nallowed_hosts = ["pypi.org"]\n'
        '[environment]\nnetwork_mode = "allowlist"\n')
    (bad / "build" / "environment" / "docker-compose.yaml").write_text(
        "services:\n  main:\n    image: other\n  side:\n    image: x\n    network_mode: host\n")
    with pytest.raises(TaskError) as refused:
        load_dataset(str(bad))
    message = str(refused.value)
    assert "2 of 3 tasks" in message and "steps/count/instruction.md is missing" in message
    assert "min_reward must be a number or a table of numbers, not 'high'" in message
    assert "HARNESS_NOT_SET_ANYWHERE" in message and "'timeout_sec' must be a positive" in message
    assert "allowlist" in message and "--skip-invalid-tasks" in message
    assert "[agent]: network_mode = 'public', but a trial's network is set once" in message  # not run on another
    assert "[verifier]: allowed_hosts is not supported yet" in message
    assert "[agent]: user must be a user name or a UID, not True" in message
    assert "services.main.image is the trial's to set" in message and "side has network_mode: host" in message
    assert [t.name for t in load_dataset(str(bad), skip_invalid=True)] == ["plain"]
    assert "skipping task multi-step" in capsys.readouterr().err


def test_tasks_that_need_an_image_are_refused_under_local_and_a_failed_build_is_one_clear_error(tmp_path, docker,
                                                                                                  capsys):
    tasks = {t.name: t.environment for t in load_dataset(str(corpus(tmp_path / "corpus")))}
    with pytest.raises(SandboxError, match=r"3 task\(s\) need their own image .* build, image, multi-step"):
        prepare("local", tasks)
    assert prepare("local", {"plain": tasks["plain"]}) == {}
    broken = build_task(tmp_path / "broken")
    (broken / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nRUN echo cannot-build && exit 3\n")
    with pytest.raises(BuildError) as failed:
        prepare("auto", {"broken": load_task(broken).environment, **tasks}, tmp_path / "builds")
    message = str(failed.value)
    assert "1 of 4 task environments" in message and "task broken" in message and "exited" in message
    assert (tmp_path / "builds" / "build-broken.log").read_text().count("cannot-build") >= 1
    # a Dockerfile with heredocs: built where BuildKit is, else refused with the reason (not the classic builder's
    heredoc = build_task(tmp_path / "heredoc")  # "unknown instruction")
    (heredoc / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nRUN <<EOF\necho made > /m\nEOF\n")
    if buildkit():
        assert prepare("auto", {"heredoc": load_task(heredoc).environment}, tmp_path / "builds")
    else:
        with pytest.raises(BuildError, match="uses heredocs .* no BuildKit"):
            prepare("auto", {"heredoc": load_task(heredoc).environment}, tmp_path / "builds")
    # a task that runs in bubblewrap but whose verifier downloads its tools: said before the run, not after
    from harness_trainer.sandboxes.registry import check_task_sandboxes

    online = plain_task(tmp_path / "online")
    (online / "tests" / "test.sh").write_text("#!/bin/bash\napt-get install -y curl && curl -LsSf x | sh\n")
    check_task_sandboxes("auto", [load_task(online)])
    assert "seems to download tools (plain)" in capsys.readouterr().err
    # the good image is built once and reused by its context's digest
    first = image_for("build", tasks["build"])
    assert first.startswith("harness-task/build:") and image_for("build", tasks["build"]) == first
    # a task with a docker_image and a Dockerfile runs the image, as Harbor does; --force-build builds it; a
    # docker_image that cannot be had is built from the Dockerfile, said once
    assert image_for("image", tasks["image"]) == BARE_IMAGE
    (forced,) = check_task_sandboxes("auto", [load_task(tmp_path / "corpus" / "image")], tmp_path / "b1",
                                     force_build=True)
    assert image_for("image", forced.environment, tmp_path / "b1").startswith("harness-task/image:")
    absent = dataclasses.replace(tasks["image"], image="harness-test/never-made:1", build_timeout_s=60)
    assert image_for("image", absent, tmp_path / "b1").startswith("harness-task/image:")
    assert "its docker_image harness-test/never-made:1 could not be had" in capsys.readouterr().err
    # --skip-invalid-tasks runs around a task whose environment cannot be built, naming it with its log
    dataset = [load_task(broken), load_task(tmp_path / "corpus" / "plain")]
    kept = check_task_sandboxes("auto", dataset, tmp_path / "b2", skip_invalid=True)
    assert [t.name for t in kept] == ["plain"]
    err = capsys.readouterr().err
    assert "1 of 1 task environments could not be had; those tasks are skipped" in err
    assert "task build: its environment/Dockerfile did not build" in err  # the broken copy of the build task


def _probe(port: int, request: str) -> str:
    """A bash-only HTTP request (no curl, no python needed in the image): the status line, or why none."""
    return (f"(exec 3<>/dev/tcp/127.0.0.1/{port} && printf '{request} HTTP/1.0\\r\\n%s\\r\\n\\r\\n' \"$AUTH\" >&3 && "
            f"head -n 1 <&3 | tr -d '\\r') 2>/dev/null || echo unreachable")


@pytest.mark.parametrize("kind", ["local", "docker"])
def test_a_trial_reaches_its_own_session_and_nothing_else(kind, engine, proxy, tmp_path, request):
    """From inside a trial: the engine and its control routes are unreachable, the proxy's admin routes and
    another session refuse this trial's key, its own session answers."""
    if kind == "docker":
        request.getfixturevalue("docker")
    engine_port = int(engine.url.rsplit(":", 1)[1])
    own, other = proxy.client.create_session(), proxy.client.create_session()
    address = ("127.0.0.1", proxy.port)
    box = LocalSandbox(tmp_path / "trial", proxy=address) if kind == "local" else \
        DockerSandbox(tmp_path / "trial", BARE_IMAGE, load_task(image_task(tmp_path)).environment, proxy=address)
    probes = {"engine": _probe(engine_port, "GET /v1/models"),
              "engine control": _probe(engine_port, "POST /reset_prefix_cache"),
              "admin": _probe(proxy.port, "GET /sessions"),
              "other session": _probe(proxy.port, f"GET /sessions/{other['id']}/trace"),
              "own session": _probe(proxy.port, "GET /v1/models")}
    box.start()
    try:
        result = box.exec("; ".join(f"echo {name.replace(' ', '_')}: $({probe})" for name, probe in probes.items()),
                          30, env={"AUTH": f"Authorization: Bearer {own['api_key']}"})
    finally:
        box.stop()
    seen = dict(line.split(": ", 1) for line in result.stdout.strip().splitlines() if ": " in line)
    assert len(seen) == 5 and not result.timed_out, (result.stdout, result.stderr)
    assert seen["engine"] == seen["engine_control"] == "unreachable", seen
    assert seen["admin"].split()[1] == seen["other_session"].split()[1] == "403", seen  # the key is a session's
    assert seen["own_session"].split()[1] == "200", seen
    if kind == "docker":
        assert trial_containers() == []


@pytest.mark.parametrize("harness,config", [
    ("mini-swe-agent", "compact"),
    pytest.param("opencode", "compact", marks=pytest.mark.slow), pytest.param("claude-code", "bare",
                                                                              marks=pytest.mark.slow),
    pytest.param("codex", None, marks=pytest.mark.slow), pytest.param("gemini-cli", "compact", marks=pytest.mark.slow),
    pytest.param("qwen-code", "compact", marks=pytest.mark.slow), pytest.param("cline", None, marks=pytest.mark.slow)],
    ids=["mini-swe-agent", "opencode", "claude-code", "codex", "gemini-cli", "qwen-code", "cline"])
def test_the_oracle_wins_every_corpus_task_in_containers(harness, config, engine, docker, tmp_path):
    """Harbor's oracle (solution/ uploaded, solve.sh run unchanged through its shebang) through the real agent,
    each task in its built image (one without Python or Node among them: the agent's runtime is mounted); every
    reward.json key kept; under local the plain task still wins."""
    from harness_trainer.commands.evaluate import EvalConfig, evaluate

    dataset = corpus(tmp_path / "corpus")
    summary, records = evaluate(EvalConfig(dataset=str(dataset), harness=harness, vllm_url=engine.url,
                                           policy="oracle", agent_config=config, max_concurrent_rollouts=3,
                                           output_dir=str(tmp_path / "eval")))
    by_task = {r.task: r for r in records}
    assert summary.wins == summary.rollouts == 4, [(r.task, r.status, r.reason, r.verifier_output) for r in records]
    assert by_task["build"].verifier_rewards == {"reward": 1.0, "efficiency": 0.5}
    assert "written by: agent verified by: root" in by_task["build"].verifier_output  # [agent] and [verifier] user
    assert "home kept: True" in by_task["build"].verifier_output  # the image's /home and /tests under the mounts
    assert by_task["image"].verifier_rewards == {"correctness": 1.0}  # its only key is the training reward
    assert "interfaces: lo" in by_task["image"].verifier_output  # allow_internet = false: no network at all
    steps = by_task["multi-step"].steps  # each step verified in turn, in the one container
    assert [(s["step"], s["rewards"]) for s in steps] == [(n, {"reward": 1.0}) for n in ("create", "extend", "count")]
    assert by_task["multi-step"].verifier_detail == "3 of 3 steps (mean): steps[reward]"
    assert trial_containers() == []
    plain, _ = evaluate(EvalConfig(dataset=str(dataset / "plain"), harness=harness, vllm_url=engine.url,
                                   policy="oracle", agent_config=config, sandbox="local",
                                   output_dir=str(tmp_path / "local")))
    assert plain.wins == 1
    assert summary.solution_failed == 0 and all(r.solution.startswith("solve.sh exited 0") for r in records)
    if harness == "mini-swe-agent":  # a dataset with a task that cannot be built runs the rest, naming it; a
        mixed = tmp_path / "mixed"  # solution that fails is counted apart from a verifier's 0
        plain_task(mixed), build_task(mixed), plain_task(mixed / "failing"), service_task(mixed)
        compose_task(mixed)
        (mixed / "build" / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nRUN exit 3\n")
        (mixed / "failing" / "plain" / "solution" / "solve.sh").write_text("#!/bin/bash\necho no-such-fix\nexit 4\n")
        (mixed / "failing" / "plain").rename(mixed / "failing-plain"), (mixed / "failing").rmdir()
        gated = multi_step_task(mixed)  # its first step done wrong: below min_reward, the others never run; no
        toml = gated / "task.toml"  # image: it runs in bubblewrap (the corpus's copy in a container)
        toml.write_text(toml.read_text().replace('docker_image = "python:3.11-slim"\nworkdir = "/app"\n', ""))
        (gated / "steps" / "create" / "solution" / "solve.sh").write_text("#!/bin/bash\necho gamma > notes.txt\n")
        rest, rows = evaluate(EvalConfig(dataset=str(mixed), harness=harness, vllm_url=engine.url, policy="oracle",
                                         agent_config=config, skip_invalid_tasks=True, output_dir=str(tmp_path / "m")))
        assert (rest.tasks, rest.wins, rest.skipped, rest.solution_failed) == (5, 3, ["build"], 1)
        composed = next(r for r in rows if r.task == "compose")  # its service, built, reached by its name
        assert "the service says: sidecar answer: sidecar" in composed.verifier_output, composed.reason
        served = next(r for r in rows if r.task == "service")  # its servers outlived the agent's command
        assert "entrypoint's server: ready agent's server: served" in served.verifier_output, served.reason
        stopped = next(r for r in rows if r.task == "multi-step")
        assert stopped.status == "ok" and stopped.outcome.env_reward == 0.0 and len(stopped.steps) == 1
        assert stopped.steps[0]["stopped"] == "step create: reward = 0.0 is below its min_reward 1.0"
        failed = next(r for r in rows if r.task == "failing-plain")
        assert failed.solution == "solve.sh exited 4: no-such-fix" and failed.outcome.env_reward == 0.0
        table = rest.table("eval")
        assert "skipped (no environment)  1: build" in table and "solution failed" in table


HOLDER = """
import sys, threading, time
from pathlib import Path
from harness_trainer.sandboxes.containers import DockerSandbox
from harness_trainer.sandboxes.bubblewrap import LocalSandbox
from harness_trainer.sandboxes.images import ContainerSpec
root, port = Path(sys.argv[1]), int(sys.argv[2])
boxes = [LocalSandbox(root / "local", proxy=("127.0.0.1", port)),
         DockerSandbox(root / "docker", sys.argv[3], ContainerSpec(image=sys.argv[3]), proxy=("127.0.0.1", port)),
         DockerSandbox(root / "bare", sys.argv[3], ContainerSpec(image=sys.argv[3])),  # no forwarder to remove it
         DockerSandbox(root / "compose", sys.argv[3], ContainerSpec(image=sys.argv[3], compose=Path(sys.argv[4])),
                       proxy=("127.0.0.1", port))]  # a service beside it, on a network of its own
for box in boxes:
    box.start()
    threading.Thread(target=box.exec, args=("sleep 300", 600), daemon=True).start()
print("running", flush=True)
time.sleep(600)
"""


def test_nothing_of_a_trial_outlives_a_run_killed_with_sigkill(docker, proxy, tmp_path):
    """A run SIGKILLed mid-rollout (no stop(), no cleanup of ours): its jail, its containers and both forwarders
    end by themselves within seconds: a container's forwarder removes it, and the run's reaper every container
    it labelled, one with no forwarder included (one being started, a spare, one being removed), and a compose
    trial's services and network."""
    import signal
    import sys
    import time

    side = tmp_path / "environment" / "docker-compose.yaml"
    side.parent.mkdir()
    side.write_text(f"services:\n  side:\n    image: {BARE_IMAGE}\n    command: [sleep, '3600']\n")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), str(proxy.port), BARE_IMAGE, str(side)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "running"
    pid = holder.pid
    assert len(subprocess.run(["docker", "ps", "-q", "--filter", f"label={LABEL}={pid}"], capture_output=True,
                              text=True).stdout.split()) == 4  # both containers, compose's main and its service
    os.kill(pid, signal.SIGKILL)
    holder.wait()

    def left() -> list[str]:
        containers = subprocess.run(["docker", "ps", "-a", "--filter", f"label={LABEL}={pid}", "--format",
                                     "{{.Names}}"], capture_output=True, text=True).stdout.split()
        processes = subprocess.run(["pgrep", "-af", "--", f"--watch {pid}|{tmp_path}"], capture_output=True,
                                   text=True).stdout.splitlines()
        networks = subprocess.run(["docker", "network", "ls", "-q", "--filter", f"label={LABEL}={pid}"],
                                  capture_output=True, text=True).stdout.split()
        return containers + processes + networks

    deadline = time.monotonic() + 30
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left() == []


def test_a_compose_trial_reaches_its_services_and_nothing_of_the_host(docker, tmp_path):
    """Without internet, a compose trial's network has no route out and no address of the host's: a server on
    every host address (0.0.0.0) is out of its reach, its service is not. (A bridge network, even internal, would
    reach the host's 0.0.0.0 services through its gateway.)"""
    import socket
    import threading

    from harness_trainer.sandboxes.images import ContainerSpec

    listener = socket.create_server(("0.0.0.0", 0))
    threading.Thread(target=lambda: [listener.accept()[0].close() for _ in iter(int, 1)], daemon=True).start()
    hosts = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    hosts += subprocess.run(["docker", "network", "inspect", "bridge", "--format", "{{range .IPAM.Config}}"
                             "{{.Gateway}}{{end}}"], capture_output=True, text=True).stdout.split()
    side = tmp_path / "environment" / "docker-compose.yaml"
    side.parent.mkdir()
    side.write_text("services:\n  side:\n    image: python:3.11-slim\n"
                    "    command: [python3, -m, http.server, '8000']\n")
    box = DockerSandbox(tmp_path / "trial", BARE_IMAGE, ContainerSpec(image=BARE_IMAGE, compose=side,
                                                                      allow_internet=False))
    try:
        box.start()
        port = listener.getsockname()[1]
        reach = "; ".join(f"timeout 5 bash -c 'exec 3<>/dev/tcp/{h}/{port}' 2>/dev/null && echo host {h}"
                          for h in hosts)
        side_up = ("for i in $(seq 600); do (exec 3<>/dev/tcp/side/8000) 2>/dev/null && echo side && break; "
                   "sleep 0.1; done")
        assert box.exec(f"{reach}; {side_up}", 120).stdout.split("\n") == ["side", ""], hosts
    finally:
        box.stop()
        listener.close()
    assert trial_containers() == []


def test_a_task_user_runs_its_phase_and_one_the_image_lacks_is_refused(docker, tmp_path, capsys):
    """Harbor runs the agent as [agent] user and test.sh as [verifier] user (`docker exec -u`); a user the image
    does not have would fail every exec as it: the trial is refused with the reason. Bubblewrap cannot switch
    users: a task that names them is warned about there."""
    spec = dataclasses.replace(load_task(image_task(tmp_path)).environment, agent_user="nobody")
    box = DockerSandbox(tmp_path / "trial", BARE_IMAGE, spec)
    box.start()
    try:
        assert box.exec("id -un", 60, user=spec.agent_user).stdout.strip() == "nobody"
        assert box.exec("id -un", 60).stdout.strip() == "root"  # the image's USER
    finally:
        box.stop()
    ghost = DockerSandbox(tmp_path / "ghost", BARE_IMAGE, dataclasses.replace(spec, verifier_user="ghost"))
    try:
        with pytest.raises(SandboxError, match="the task's user 'ghost' .* does not exist in harness-test/bare:12"):
            ghost.start()
    finally:
        ghost.stop()
    assert trial_containers() == []
    from harness_trainer.sandboxes.registry import _warn_users

    _warn_users("local", [dataclasses.replace(load_task(plain_task(tmp_path)), environment=spec)])
    assert "name an [agent] or [verifier] user (plain), which only a container applies" in capsys.readouterr().err


def _sleeps(box: DockerSandbox) -> int:
    return int(box._root("cat /proc/[0-9]*/comm 2>/dev/null | grep -c '^sleep$'").stdout.strip())


def test_what_the_agent_left_running_serves_the_verifier_and_cannot_rewrite_its_reward(docker, tmp_path):
    """As Harbor leaves the container: a finished exec's background processes stay (a server the tests query); a
    timed-out exec's are killed. An agent that is not root (its [agent] user) and not the verifier: what it left
    cannot write the verifier's tests or rewards (a reward hack a policy could learn)."""
    from stubs import wait_until

    from harness_trainer.rollouts.verifier import verify

    task = load_task(image_task(tmp_path))
    task = dataclasses.replace(task, environment=dataclasses.replace(task.environment, agent_user="nobody"))
    box = DockerSandbox(tmp_path / "trial", BARE_IMAGE, task.environment)
    box.start()
    try:
        box._root("chmod 777 /work")  # as a Dockerfile gives the agent's user its workdir
        hack = ("while :; do echo '{\"correctness\": 1}' > /logs/verifier/reward.json; echo x > /tests/test.sh; "
                "sleep 0.01; done")
        started = box.exec(f"nohup sleep 3600 >/dev/null 2>&1 & nohup sh -c '{hack}' >/dev/null 2>&1 & "
                           "echo seven > word.txt; echo ok", 60, user="nobody")
        assert started.stdout == "ok\n"  # the init's sleep and the agent's, kept (once its fork has become sleep)
        wait_until(lambda: _sleeps(box) >= 2, 300, "the agent's background sleep")
        result = verify(box, task)  # its test.sh wants no python and one interface: it says 1 for "seven"
        assert (result.reward, result.rewards) == (1.0, {"correctness": 1.0})
        box.exec("echo six > word.txt", 60, user="nobody")
        result = verify(box, task)  # the daemon's 1 never lands: /logs/verifier and /tests are root's now
        assert (result.reward, result.rewards) == (0.0, {"correctness": 0.0}), result.stdout
        before = _sleeps(box)
        assert box.exec("nohup sleep 3600 >/dev/null 2>&1 & sleep 3600", 2, user="nobody").timed_out
        assert _sleeps(box) == before  # both of the timed-out exec's sleeps are gone, the kept ones stay
    finally:
        box.stop()
    assert trial_containers() == []


def test_an_images_entrypoint_runs_first_and_one_that_ends_is_refused(docker, tmp_path):
    """Harbor keeps the image's ENTRYPOINT and gives it `sh -c "sleep infinity"`: a service it starts runs."""
    from harness_trainer.sandboxes.images import ContainerSpec

    specs = {}
    for name, entry in (("starts", '#!/bin/sh\necho up > /tmp/service\nexec "$@"\n'), ("ends", "#!/bin/sh\nexit 3\n")):
        context = tmp_path / name
        context.mkdir()
        (context / "entry.sh").write_text(entry)
        (context / "Dockerfile").write_text(f"FROM {BARE_IMAGE}\nCOPY entry.sh /entry.sh\nRUN chmod 755 /entry.sh\n"
                                            'ENTRYPOINT ["/entry.sh"]\n')
        specs[name] = ContainerSpec(context=context)
    images = prepare("docker", specs, tmp_path / "builds")
    box = DockerSandbox(tmp_path / "trial", images["starts"], specs["starts"])
    ended = DockerSandbox(tmp_path / "ended", images["ends"], specs["ends"])
    try:
        box.start()
        assert box.exec("cat /tmp/service", 60).stdout == "up\n"
        with pytest.raises(SandboxError, match=r"ENTRYPOINT \['/entry.sh'\] ended at once \(exit 3\)"):
            ended.start()
    finally:
        box.stop(), ended.stop()
    assert trial_containers() == []


def test_a_cancelled_container_exec_ends_at_once_and_leaves_nothing_inside(docker, tmp_path):
    """The trainer cancels stale rollouts from another thread: killing the docker CLI alone would leave the agent
    running inside the container."""
    import threading

    from stubs import wait_until

    box = DockerSandbox(tmp_path / "trial", BARE_IMAGE, load_task(image_task(tmp_path)).environment)
    box.start()
    sleeps = lambda: box._root("cat /proc/[0-9]*/comm 2>/dev/null | grep -c '^sleep$'").stdout.strip()  # noqa: E731
    try:
        # cancelled once the agent's command runs inside (a timer could fire before the exec has started); the
        # command and its exec's own timeout outlast the test's, so returning at all is the cancel's doing
        threading.Thread(target=lambda: (wait_until(lambda: sleeps() == "2", 300, "the exec inside"), box.cancel()),
                         daemon=True).start()
        result = box.exec("sleep 3600", 3600)
        assert result.returncode != 0
        assert sleeps() == "1"  # the container's own
        assert box.exec("true", 10).stderr == "cancelled"  # and no later exec starts
    finally:
        box.stop()
    assert trial_containers() == []


@pytest.mark.slow
def test_two_training_steps_on_the_corpus_in_containers(docker, fresh_engine, tmp_path):
    """`harness-train` through mini-swe-agent on the Harbor corpus: the image tasks (the multi-step one among them)
    in their containers, the plain one in bubblewrap; every rollout scored (the random model's reward may be 0,
    but never unscorable), the policy synced twice, nothing left running."""
    import json

    from conftest import run_smoke

    dataset = corpus(tmp_path / "corpus")
    out = run_smoke(tmp_path, "--dataset", str(dataset), "--agent-config", "compact", "--vllm-url", fresh_engine.url)
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and summary["policy_version"] == 3
    assert rows and all(r["status"] in ("ok", "timeout") for r in rows), [(r["task"], r["reason"]) for r in rows]
    assert {r["task"] for r in rows} & {"build", "image", "multi-step"}, "no rollout ran in a container"
    assert all(r["steps"] for r in rows if r["task"] == "multi-step")  # its steps, each verified, in its record
    owners = subprocess.run(["docker", "ps", "-a", "--filter", f"label={LABEL}", "--format",
                             '{{.Label "' + LABEL + '"}}'], capture_output=True, text=True).stdout.split()
    assert [pid for pid in owners if not os.path.exists(f"/proc/{pid}")] == []  # the run's are gone (another
    # run's, on the same daemon, may be running: it is not this test's)


def test_a_container_trial_copies_in_one_call_falls_back_without_tar_and_leaves_nothing_running(docker, tmp_path):
    """Uploads go as a tar stream into the container's tar (a file and a folder, owned by root and open to every
    user, as docker cp left them); an image without tar gets docker cp. /logs is read and cleared on the host,
    links refused."""
    src = tmp_path / "src"
    (src / "deep" / "er").mkdir(parents=True)
    (src / "deep" / "er" / "f.txt").write_text("folder\n")
    (tmp_path / "one.txt").write_text("file\n")
    box = DockerSandbox(tmp_path / "trial", BARE_IMAGE, load_task(image_task(tmp_path)).environment)
    box.start()
    try:
        box.upload(src, "/opt/src")
        box.upload(tmp_path / "one.txt", "/solution/sub/one.txt")
        box.upload(src, "/tests")  # a mounted folder: copied on the host, no docker call
        listing = box.exec("cat /opt/src/deep/er/f.txt /solution/sub/one.txt /tests/deep/er/f.txt; "
                           "stat -c '%U %A' /opt/src/deep/er/f.txt /tests/deep/er/f.txt", 60).stdout.split("\n")
        assert listing[:5] == ["folder", "file", "folder", "root -rw-rw-rw-", "root -rw-rw-rw-"]
        # /logs is the trial's own folder, read on the host: a link the agent makes there to a host file is refused
        box.exec("echo 1 > /logs/verifier/reward.txt; ln -s /etc/hostname /logs/agent/leak", 60)
        box.download("/logs/verifier/reward.txt", tmp_path / "reward.txt")
        assert (tmp_path / "reward.txt").read_text() == "1\n"
        with pytest.raises(SandboxError, match="link out of the trial"):
            box.download("/logs/agent/leak", tmp_path / "leak")
        box.clear("/logs/verifier")
        assert box.exec("ls -A /logs/verifier; touch /logs/verifier/new && echo writable", 60).stdout == "writable\n"
        box._root("rm -f \"$(command -v tar)\"")
        box.upload(tmp_path / "one.txt", "/opt/two.txt")
        assert box.exec("cat /opt/two.txt", 60).stdout == "file\n"
    finally:
        box.stop()
    assert trial_containers() == []


def test_a_kind_that_recurs_gets_containers_started_ahead_each_used_once_and_none_left(docker, tmp_path):
    """A kind whose trials come back soon after others ended is hot: as its trials end, spares are started for
    the ones that could start next; the next takes one, a container no trial touched, whose /logs is then the
    trial's own folder on the host. Closing removes the waiting ones, their folders with them."""
    from stubs import wait_until

    spec = load_task(image_task(tmp_path)).environment
    trials = tmp_path / "trials"
    spares = Spares()  # a provider's: each sandbox given it takes from and refills it
    box = lambda n: DockerSandbox(trials / f"t{n}", BARE_IMAGE, spec, spares=spares)  # noqa: E731
    first = box(1)
    first.start()
    first.stop()  # not hot yet: no spare
    second = box(2)
    second.start()  # its own container; the kind is hot now (one ended a moment ago)
    kind, name = second.kind, second.name
    assert not spares.waiting.get(kind) and not spares.pending.get(kind)
    second.stop()  # a trial of a hot kind ends: a spare for the next
    wait_until(lambda: spares.waiting.get(kind), 300, "the spare container")
    spare = spares.waiting[kind][0][1].name
    third = box(3)
    third.start()
    try:
        assert third.name == spare != name
        assert third.exec("echo mine > /logs/agent/note; ls /app | wc -l", 60).stdout == "0\n"  # untouched
        assert (trials / "t3" / "logs" / "agent" / "note").read_text() == "mine\n"  # the trial's own record
    finally:
        third.stop()  # and one more spare for the next
    wait_until(lambda: spares.waiting.get(kind), 300, "the next spare container")
    spares.close()
    assert trial_containers() == []
    assert not list((trials / ".spares").glob("*"))  # a spare's folder went with it, or into its trial's
