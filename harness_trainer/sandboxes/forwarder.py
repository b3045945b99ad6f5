"""The one road out of a trial: a TCP port on the trial's own loopback, forwarded to the capture proxy over a
Unix socket.

Each trial runs in a network namespace of its own (bubblewrap's --unshare-net, a container's), so
127.0.0.1 there is not the host's: the engine, its control routes and every other host service are out of
reach. The capture proxy is reached through two hops that need no route and no privilege:

    agent -> 127.0.0.1:PORT (in the trial)  --forwarder.py-->  /tmp/harness-trial-*/proxy.sock  --SocketBridge-->  proxy

so the agent's base URL stays the proxy's own `http://127.0.0.1:PORT/v1`. The proxy still asks for the
session's key on every call, and its admin routes for the admin key, which no trial holds.

The in-trial half runs once per trial exec (bound read-only into the jail, or in a container's network namespace
through nsenter). It is forwarder.c, compiled once per version into the cache where a C compiler is found (~0.3 MB
and ~1 ms to start); else this file, run as a script by the host's Python (~6 MB, ~30 ms): stdlib only, nothing
of the project imported. Both take the same arguments and behave alike (tests/sandboxes/test_forwarder.py):

    forwarder --port PORT --socket PATH --watch PID [--background]
    python forwarder.py --port PORT --socket PATH --watch PID [--background]
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import threading
import time

# The in-trial half runs once per trial, so it imports the least it can: pathlib, shutil and tempfile only where
# the host's half uses them, and no argparse (with re and gettext behind it). 7.7 -> 6.1 MB of PSS a trial.

CHUNK = 65536


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(CHUNK):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass


def refusal(why: str) -> bytes:
    """What the agent gets when the next hop cannot be reached: a 502 in the OpenAI error shape, which agents
    retry or report as an API failure (a connection closed without a word reads as the model saying nothing)."""
    body = ('{"error": {"message": "the trial\'s forwarder could not reach the capture proxy: %s", '
            '"type": "forwarder_error", "code": 502}}' % why.replace('"', "'")).encode()
    return (b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (len(body), body))


def _splice(client: socket.socket, connect) -> None:
    """Both directions between `client` and a new connection from `connect()`; closes both when done."""
    try:
        upstream = connect()
    except OSError as exc:
        try:
            client.sendall(refusal(exc.strerror or str(exc)))
            client.shutdown(socket.SHUT_WR)
            client.settimeout(5)  # the request read to its end (or 5 s): closed unread, it would be reset
            while client.recv(CHUNK):
                pass
        except OSError:
            pass
        client.close()
        return
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _serve(listener: socket.socket, connect) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:  # closed
            return
        threading.Thread(target=_splice, args=(client, connect), daemon=True).start()


class SocketBridge:
    """The host's half: a Unix socket whose every connection is spliced to the proxy's TCP port, in a short
    private folder of its own (`folder`: a socket path must fit in 108 bytes, and a trial folder's may not).
    A thread of the calling process; `close()` stops it and removes the folder."""

    def __init__(self, path: os.PathLike | None, host: str, port: int):
        import pathlib
        import tempfile

        _sweep()
        self.folder = pathlib.Path(tempfile.mkdtemp(prefix=f"harness-trial-{os.getpid()}-"))
        self.folder.chmod(0o755)
        self.path = os.fspath(path or self.folder / "proxy.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        os.chmod(self.path, 0o666)  # an image's USER may not be root
        self.listener.listen(64)
        connect = lambda: socket.create_connection((host, port), timeout=30)  # noqa: E731
        threading.Thread(target=_serve, args=(self.listener, lambda: _settle(connect())), daemon=True).start()

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def in_trial() -> list[str]:
    """The command that runs the in-trial half, its program last (a jail binds that file where it can see it):
    the compiled half where it could be built, else this file under the host's own Python (the one a jail sees:
    a virtual environment's may lie outside it)."""
    with _BUILD:  # 512 trials starting at once: one build, the rest wait for it
        binary = compiled()
        if binary and not os.access(binary, os.X_OK):  # the cache was cleared under a running process
            compiled.cache_clear()
            binary = compiled()
    return [binary] if binary else [os.path.join(sys.base_prefix, "bin", "python3"), "-S", "-I", __file__]


_BUILD = threading.Lock()


@functools.cache  # once per process (and per version across processes: two at once build into names of their own)
def compiled() -> str | None:
    """forwarder.c built into the cache (one binary per version of the source, so an upgrade rebuilds it), or
    None where no C compiler is found or the build fails (then the Python half serves: slower to start, larger)."""
    import hashlib
    import logging
    import pathlib
    import shutil
    import subprocess

    from harness_trainer.models.tiny import cache_root

    source = pathlib.Path(__file__).with_name("forwarder.c")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc or not source.is_file():
        logging.getLogger(__name__).warning("no C compiler (cc): each trial's forwarder is a Python process")
        return None
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    binary = cache_root() / "bin" / f"forwarder-{digest}"
    if binary.is_file():
        return str(binary)
    binary.parent.mkdir(parents=True, exist_ok=True)
    partial = binary.with_name(f"{binary.name}.{os.getpid()}.{threading.get_ident()}")
    build = subprocess.run([cc, "-O2", "-o", str(partial), str(source)], capture_output=True, text=True)
    if build.returncode != 0:
        partial.unlink(missing_ok=True)
        logging.getLogger(__name__).warning("forwarder.c did not build (%s): each trial's forwarder is a Python "
                                            "process\n%s", cc, build.stderr[-500:])
        return None
    os.replace(partial, binary)  # whole or absent: another process may be about to run it
    return str(binary)


@functools.cache  # once per process (two first calls at once would both sweep: harmless)
def _sweep() -> None:
    """Once per process: remove the folders of bridges whose process died without closing them (SIGKILL).

    A folder is named after the process that made it (harness-trial-PID-*), so a dead run's are found without
    touching a live one's. Probing each folder's socket instead, as this did, cost every new trial a connection
    to every other trial's bridge (a thread and a proxy connection each: 2,000 threads at 64 trials), and removed
    the folder of a bridge bound but not yet listening (its trial failed: "no such file ... forwarder.py")."""
    import shutil

    from harness_trainer.serving.process import dead_folders  # the host's side only: the script never sweeps

    for folder in dead_folders("trial"):
        shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _settle(sock: socket.socket) -> socket.socket:
    sock.settimeout(None)  # the connect timeout only: a model call may stream for minutes
    return sock


def _watch(pid: int) -> None:
    """Exit once `pid` is gone: a forwarder must not outlive what it serves, even when that was SIGKILLed (a
    jail's init waits for every child, so a forwarder left running would keep the jail alive too)."""
    while _alive(pid):
        time.sleep(1)
    os._exit(0)


USAGE = "usage: forwarder.py --port PORT --socket PATH --watch PID [--background]"


def parse(argv: list[str]) -> dict:
    """--port PORT --socket PATH --watch PID [--background] (the process to watch: exit when it is gone; in the
    background, return once listening and serve from a child)."""
    args, words = {"background": False}, iter(argv)
    for word in words:
        if word == "--background":
            args["background"] = True
        elif word in ("--port", "--socket", "--watch"):
            args[word[2:]] = next(words, "")
        else:
            raise SystemExit(f"forwarder.py: unknown argument {word!r}\n{USAGE}")
    try:
        if not args["socket"]:
            raise ValueError("no socket")
        return dict(args, port=int(args["port"]), watch=int(args["watch"]))
    except (KeyError, ValueError):
        raise SystemExit(USAGE) from None


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", args["port"]))
    listener.listen(64)

    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(args["socket"])
        return sock

    if args["background"]:
        if os.fork():
            os._exit(0)  # the caller goes on only once the port listens: no race with the agent's first call
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # out of the agent's own output
            os.dup2(devnull, fd)
    else:
        print("listening", flush=True)
    # after the fork: threads do not cross it
    threading.Thread(target=_watch, args=(args["watch"],), daemon=True).start()
    _serve(listener, connect)


if __name__ == "__main__":
    main()
