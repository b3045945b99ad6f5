"""The in-trial half of the forwarder, both of it: forwarder.c compiled (what trials run where a C compiler is
found) and forwarder.py under Python (where none is). Each relays bytes both ways with half-closes, serves
connections side by side, listens before a --background call returns, exits once the process it watches is gone,
and refuses bad arguments. A Unix socket server of the test's own stands for the host's bridge."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest

from harness_trainer.sandboxes import forwarder
from harness_trainer.serving.process import free_port

HALVES = {"compiled": lambda: [forwarder.compiled()],
          "python": lambda: [sys.executable, "-S", "-I", forwarder.__file__]}


@pytest.fixture(params=sorted(HALVES))
def half(request) -> list[str]:
    command = HALVES[request.param]()
    if command[0] is None:
        pytest.fail("forwarder.c did not build here: trials would each start a Python forwarder")
    return command


class Upstream:
    """The bridge's stand-in: each connection reads until the other side's half-close, then answers with what it
    read, reversed, and closes (so both directions and both half-closes go through the forwarder)."""

    def __init__(self, path: str):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer(conn: socket.socket):
        with conn:
            data = bytearray()
            while chunk := conn.recv(65536):
                data += chunk
            conn.sendall(bytes(reversed(data)))


def _roundtrip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        answer = bytearray()
        while chunk := sock.recv(65536):
            answer += chunk
        return bytes(answer)


@pytest.fixture
def upstream(tmp_path):
    path = str(tmp_path / "proxy.sock")
    server = Upstream(path)
    yield path
    server.listener.close()


def test_it_relays_both_ways_side_by_side_and_exits_when_its_process_is_gone(half, upstream):
    watched = subprocess.Popen(["sleep", "3600"])
    port = free_port()
    proc = subprocess.Popen([*half, "--port", str(port), "--socket", upstream, "--watch", str(watched.pid)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "listening"
        payloads = [os.urandom(n) for n in (1, 65536, 3 * 65536 + 7, 4 << 20)]  # across the relay's 64 KB chunks
        answers = [None] * len(payloads)

        def call(i):
            answers[i] = _roundtrip(port, payloads[i])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(payloads))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert answers == [bytes(reversed(p)) for p in payloads]
        watched.kill()
        watched.wait()
        assert proc.wait(timeout=60) == 0  # it noticed, within its one-second check (the bound only ends a hang)
    finally:
        watched.kill()
        proc.kill()
        proc.wait()


def test_an_answer_the_proxy_closed_after_reaches_a_slow_reader_whole(half, tmp_path):
    """The bridge sends a large answer and closes at once (as the proxy does after its last byte) while the agent
    reads in small pieces: the relay holds what the agent has not read yet, and a hangup of the side that is done
    must not end it (the compiled half once did: a 4 MB answer arrived cut, seen on a loaded fresh clone)."""
    answer = os.urandom(16 << 20)  # past every buffer on the way, so the bridge closes while most is still held
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "flood.sock"))
    listener.listen(1)

    def flood():
        conn, _ = listener.accept()
        with conn:
            conn.sendall(answer)

    threading.Thread(target=flood, daemon=True).start()
    watched, port = subprocess.Popen(["sleep", "3600"]), free_port()
    proc = subprocess.Popen([*half, "--port", str(port), "--socket", str(tmp_path / "flood.sock"), "--watch",
                             str(watched.pid)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "listening"
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            got = bytearray()
            while chunk := sock.recv(4096):
                got += chunk
        assert len(got) == len(answer) and got == answer
    finally:
        watched.kill()
        proc.kill()
        proc.wait()
        listener.close()


def test_in_the_background_it_listens_before_the_call_returns(half, upstream):
    port, watched = free_port(), subprocess.Popen(["sleep", "3600"])  # the background one ends with it
    try:
        done = subprocess.run([*half, "--port", str(port), "--socket", upstream, "--watch", str(watched.pid),
                               "--background"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert _roundtrip(port, b"hello") == b"olleh"  # no wait: the port listened before the call returned
    finally:
        watched.kill()
        watched.wait()


@pytest.mark.parametrize("args", [[], ["--port", "80"], ["--port", "x", "--socket", "s", "--watch", "1"],
                                  ["--port", "80", "--socket", "s", "--watch", "1", "--nope"]])
def test_bad_arguments_are_refused_with_the_usage(half, args):
    done = subprocess.run([*half, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "usage: forwarder" in done.stderr


def test_without_a_compiler_trials_fall_back_to_the_python_half(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    monkeypatch.setenv("HARNESS_TRAINER_CACHE", str(tmp_path))
    forwarder.compiled.cache_clear()
    try:
        command = forwarder.in_trial()
    finally:
        forwarder.compiled.cache_clear()
    assert command[-1] == forwarder.__file__ and command[1:3] == ["-S", "-I"]
    assert "did not build" in caplog.text and not list(tmp_path.rglob("forwarder-*"))


def test_a_client_gone_for_good_ends_its_relay_without_waiting_for_the_upstream(tmp_path):
    """The compiled half relays each connection in a child of its own: when the agent's side is reset (the
    agent killed mid-call) while the engine is still generating, that child ends at once, not when the engine
    next speaks (a minute of generation, here never)."""
    import struct

    import psutil
    from stubs import wait_until

    path = str(tmp_path / "proxy.sock")
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # accepts, reads, never answers
    silent.bind(path)
    silent.listen(4)
    watched, port = subprocess.Popen(["sleep", "3600"]), free_port()
    proc = subprocess.Popen([forwarder.compiled(), "--port", str(port), "--socket", path, "--watch",
                             str(watched.pid)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "listening"
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(b"POST /v1/chat/completions")
        held, _ = silent.accept()  # the call reached the upstream, which is "generating"
        relays = psutil.Process(proc.pid).children()
        assert len(relays) == 1
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # a reset, as when the agent is killed
        wait_until(lambda: not relays[0].is_running() or relays[0].status() == psutil.STATUS_ZOMBIE, 60,
                   "the relay to end")  # the upstream never answers: ending at all is the reset's doing
        held.close()
    finally:
        watched.kill()
        proc.kill()
        proc.wait()
        silent.close()


def test_a_proxy_out_of_reach_is_answered_with_a_502_that_says_so(half, tmp_path):
    """Nothing listens on the bridge's socket (the bridge gone, its backlog refusing): the agent's call is answered,
    not dropped, with a 502 in the OpenAI error shape that agents retry or report as an API failure. A connection
    closed without a word would read as the model saying nothing, and the rollout be scored as it stood."""
    port, watched = free_port(), subprocess.Popen(["sleep", "3600"])
    relay = subprocess.Popen([*half, "--port", str(port), "--socket", str(tmp_path / "none.sock"), "--watch",
                              str(watched.pid)], stdout=subprocess.PIPE, text=True)
    try:
        assert relay.stdout.readline().strip() == "listening"
        answer = _roundtrip(port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 502 ") and b"content-length: %d" % len(body) in head
        error = __import__("json").loads(body)["error"]
        assert error["message"].startswith("the trial's forwarder could not reach the capture proxy: ")
        assert "No such file or directory" in error["message"] and error["code"] == 502
    finally:
        watched.kill()
        watched.wait()
        relay.wait(timeout=60)
