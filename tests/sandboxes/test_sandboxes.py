"""The sandboxes without a model: the bubblewrap jail's isolation and timeouts, what a trial links out of itself,
the trials' socket bridges, the registry of kinds (a class of your own included), the provider that owns what a
run's sandboxes share, and the clear errors of the kinds this machine cannot make (e2b, harbor, docker)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from harness_trainer._exceptions import SandboxError
from harness_trainer.sandboxes.bubblewrap import LocalSandbox
from harness_trainer.sandboxes.images import ContainerSpec
from harness_trainer.sandboxes.remote import E2BSandbox


def test_sandbox_isolation(tmp_path):
    a, b = LocalSandbox(tmp_path / "trial-a"), LocalSandbox(tmp_path / "trial-b")
    a.start(), b.start()
    secret = a.exec("echo TOPSECRET-42 > /app/secret.txt && cat /app/secret.txt", 10)
    assert secret.stdout == "TOPSECRET-42\n"
    for path in ("/usr/evil", "/etc/evil", "/evil-at-root", str(tmp_path / "escape")):
        b.exec(f"echo x > {path}", 10)
        assert not Path(path).exists()
    probe = b.exec(f"cat /app/secret.txt {tmp_path}/trial-a/app/secret.txt 2>&1; ls /app", 10)
    assert "TOPSECRET-42" not in probe.stdout
    assert (tmp_path / "trial-a" / "app" / "secret.txt").exists()

def test_sandbox_kills_a_runaway_tree_at_the_timeout(tmp_path):
    box = LocalSandbox(tmp_path / "t")
    box.start()
    marker = f"runaway-{os.getpid()}"
    result = box.exec(f"(setsid bash -c 'exec -a {marker} sleep 300' &); "
                      f"for i in 1 2 3; do (exec -a {marker} sleep 300 &); done; sleep 300", 2)
    assert result.timed_out and result.seconds < 10
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert left == []

def test_e2b_without_credentials_is_a_clear_error_with_no_network(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(SandboxError, match="needs E2B_API_KEY"):
        E2BSandbox(public_url="https://example.invalid")
    monkeypatch.setenv("E2B_API_KEY", "k")
    with pytest.raises(SandboxError, match="--public-url"):
        E2BSandbox()

def test_docker_without_a_daemon_is_a_clear_error(tmp_path):
    import shutil

    from harness_trainer.sandboxes.registry import prepare

    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        pytest.skip("a Docker daemon is running here")
    with pytest.raises(SandboxError, match="need a running Docker daemon|need Docker"):
        prepare("docker", {"t": ContainerSpec()})

def test_harbor_sandbox_errors_are_clear(tmp_path, monkeypatch):
    from harness_trainer.paths import REPO_ROOT
    from harness_trainer.sandboxes.registry import make_sandbox

    monkeypatch.setenv("HARNESS_HARBOR_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(SandboxError, match="make setup HARBOR=1"):
        make_sandbox("harbor:docker", tmp_path / "t")
    monkeypatch.delenv("HARNESS_HARBOR_PYTHON")
    if not (REPO_ROOT / ".venv-harbor" / "bin" / "python").exists():
        pytest.skip("the Harbor environment is built only on request (make setup HARBOR=1)")
    task = tmp_path / "with-docker"
    (task / "environment").mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\n")
    box = make_sandbox("harbor:docker", tmp_path / "trial", task_dir=task)
    try:
        with pytest.raises(SandboxError, match="Harbor environment 'docker' failed to start"):
            box.start()
    finally:
        box.stop()

def test_sandbox_kinds_are_a_registry_that_takes_a_class_of_your_own(tmp_path):
    """--sandbox NAME from sandboxes/registry.py's SANDBOXES, or module:Class made from the trial's Trial; an
    unknown name is refused with the names there are."""
    from harness_trainer.sandboxes.registry import SANDBOXES, make_sandbox

    box = make_sandbox("stubs:TrialBox", tmp_path / "t", task="fix-it", proxy_url="http://127.0.0.1:9")
    assert box.trial.task == "fix-it" and box.trial.proxy == ("127.0.0.1", 9)
    assert type(make_sandbox("local", tmp_path / "jail")).__name__ == "LocalSandbox"
    with pytest.raises(SandboxError, match="--sandbox 'jail': choose auto, " + ", ".join(SANDBOXES)):
        make_sandbox("jail", tmp_path / "t")

def test_agent_programs_under_tmp_stay_visible_in_the_jail(tmp_path):
    """A checkout under /tmp (or /home) must not be hidden by the trial's own /tmp (or /home)."""
    program = tmp_path / "checkout" / ".venv-mini"
    program.mkdir(parents=True)
    (program / "agent.sh").write_text("echo agent-ran")
    box = LocalSandbox(tmp_path / "trial", readonly=[program])
    box.start()
    assert box.exec(f"bash {program}/agent.sh && touch /tmp/mine", 10).stdout == "agent-ran\n"
    assert (tmp_path / "trial" / "tmp" / "mine").exists()

def test_bridges_made_at_once_keep_their_folders_and_only_a_dead_runs_are_swept():
    """A bridge's folder is swept only when the process named in it is gone: bridges made by many threads at
    once all keep theirs (probing sockets instead removed one bound but not yet listening)."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from harness_trainer.sandboxes import forwarder

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = Path(tempfile.mkdtemp(prefix=f"harness-trial-{dead.pid}-"))
    unnamed = Path(tempfile.mkdtemp(prefix="harness-trial-"))  # no process in its name (an older run's): kept
    forwarder._sweep.cache_clear()
    with ThreadPoolExecutor(32) as pool:
        bridges = list(pool.map(lambda _: forwarder.SocketBridge(None, "127.0.0.1", 9), range(64)))
    try:
        assert not stale.exists() and unnamed.exists()
        assert all((b.folder / "proxy.sock").exists() for b in bridges)
        assert all(b.folder.name.startswith(f"harness-trial-{os.getpid()}-") for b in bridges)
        forwarder._sweep.cache_clear()
        forwarder._sweep()  # this process is alive: nothing of its own is touched
        assert all(b.folder.exists() for b in bridges)
    finally:
        for bridge in bridges:
            bridge.close()
        unnamed.rmdir()

def test_what_a_trial_links_out_of_itself_is_never_read_or_cleared_on_the_host(tmp_path):
    """The trial's files are read on the host: a link the agent made to a host file is refused, links inside a
    folder are left out, and clearing a folder the agent turned into a link removes the link, not its target."""
    from harness_trainer.sandboxes.base import TrialDirs

    secret, keep = tmp_path / "secret.txt", tmp_path / "keep"
    secret.write_text("host only\n")
    keep.mkdir()
    (keep / "k.txt").write_text("keep\n")
    trial = TrialDirs(tmp_path / "trial")
    trial.start()
    logs = tmp_path / "trial" / "logs"
    (logs / "agent").mkdir()
    (logs / "agent" / "own.txt").write_text("own\n")
    (logs / "agent" / "leak.txt").symlink_to(secret)
    (logs / "agent" / "inside.txt").symlink_to("own.txt")  # within the trial: still a link, still left out
    with pytest.raises(SandboxError, match="link out of the trial"):
        trial.download("/logs/agent/leak.txt", tmp_path / "got.txt")
    trial.download("/logs/agent", tmp_path / "copied")
    assert sorted(p.name for p in (tmp_path / "copied").iterdir()) == ["own.txt"]
    (logs / "verifier").symlink_to(keep)
    trial.clear("/logs/verifier")
    assert (logs / "verifier").is_dir() and not (logs / "verifier").is_symlink()
    assert (keep / "k.txt").read_text() == "keep\n" and secret.read_text() == "host only\n"


def test_a_runs_sandboxes_come_from_one_provider_closed_by_whoever_made_it(tmp_path, monkeypatch):
    """What a run's sandboxes share (containers started ahead) is its provider's, not the process's: closed by
    whoever made the provider, so a session factory given one leaves it open, and one that made its own closes
    it."""
    from harness_trainer.agents.command import CommandHarness
    from harness_trainer.rollouts.session import LocalSessionFactory
    from harness_trainer.sandboxes.registry import SandboxProvider
    from harness_trainer.sandboxes.spares import Spares

    closed = []
    monkeypatch.setattr(Spares, "close", lambda self: closed.append(self))
    with SandboxProvider("local") as sandboxes:
        assert isinstance(sandboxes.make(tmp_path / "t", task="x"), LocalSandbox)
        assert sandboxes.kind_for(ContainerSpec(image="img")) == "local"
        given = LocalSessionFactory(proxy=None, harness=CommandHarness("true {instruction}"), sandbox=sandboxes)
        given.close()
        assert closed == []
    assert closed == [sandboxes.spares]
    own = LocalSessionFactory(proxy=None, harness=CommandHarness("true {instruction}"), sandbox="auto")
    own.close()
    assert closed == [sandboxes.spares, own.sandboxes.spares] and own.sandboxes.kind == "auto"
    with pytest.raises(SandboxError, match="--sandbox 'jail': choose"):
        SandboxProvider("jail")
