"""A server that dies with its parent: `python -S tether.py PARENT_PID COMMAND...` becomes COMMAND (exec, same
pid, same exit code) after forking one small watcher into the server's process group. The watcher waits on two
pidfds: the server's, and the parent's that started it. If the parent goes first — SIGKILL, the OOM killer, a
crash, anything that skips its `finally` — the watcher stops the whole group: SIGTERM, then SIGKILL after a grace
period. A parent that stops its servers itself (ManagedProcess.stop signals the group) kills the watcher with them.

Standard library only, and never imports harness_trainer: it runs under whichever Python started the server, and
its start-up costs a few milliseconds."""

from __future__ import annotations

import os
import select
import signal
import sys
import time

GRACE_S = 10.0  # between the group's SIGTERM and its SIGKILL: vLLM frees its engine core, mitmproxy its flows


def watch(parent_fd: int, server_pid: int) -> None:
    """The watcher's whole life: wait for the parent or the server to end; on the parent's end stop the group."""
    try:
        server_fd = os.pidfd_open(server_pid)
    except ProcessLookupError:
        return
    ready, _, _ = select.select([parent_fd, server_fd], [], [])
    if server_fd in ready:  # the server ended on its own: its parent (alive) reads the exit code and cleans up
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the watcher outlives the group's SIGTERM, to follow it up
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and not select.select([server_fd], [], [], 0.2)[0]:
        pass
    os.killpg(0, signal.SIGKILL)  # the server's children too (and the watcher itself)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python -S tether.py PARENT_PID COMMAND [ARG...]")
    parent = int(argv[0])
    if os.getppid() != parent:  # the parent died before we started: start nothing
        sys.exit(1)
    try:
        parent_fd = os.pidfd_open(parent)
    except OSError as exc:  # no pidfds (Linux < 5.3): the server runs untethered, as it would without us
        print(f"tether: cannot watch the parent ({exc}); the server will not stop if its parent is killed",
              file=sys.stderr)
        os.execvp(argv[1], argv[1:])
    server_pid = os.getpid()
    if os.fork() == 0:
        try:
            watch(parent_fd, server_pid)
        finally:
            os._exit(0)
    os.close(parent_fd)
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
