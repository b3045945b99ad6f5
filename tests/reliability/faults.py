"""Fault injection for the reliability tests: an agent that can be told to hang, crash or call twice, and a TCP
hop (a stub, since a real engine cannot be made to stall one route on demand) that can be cut for good or told
to hold the requests of one route."""

from __future__ import annotations

import shlex
import socket
import threading
import time

from harness_trainer.agents.harnesses import CommandHarness

# The agent: one model call (retried, as real agents retry their API), its answer written to /app/answer.txt;
# then what its instruction says: hang, crash (SIGKILL itself), or pause and call once more.
AGENT = r"""
import json, os, sys, time, urllib.request
mode = sys.argv[1]
def call(stream, history=()):
    body = {"model": os.environ["OPENAI_MODEL"], "max_tokens": 48 if stream else 4, "stream": stream,
            "messages": [{"role": "user", "content": mode}, *history]}
    headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"}
    for attempt in range(90):
        try:
            request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                             json.dumps(body).encode(), headers)
            with urllib.request.urlopen(request, timeout=60) as answer:
                if not stream:
                    return json.load(answer)["choices"][0]["message"]["content"] or ""
                text = ""
                for line in answer:
                    if line.startswith(b"data: {"):
                        chunk = json.loads(line[6:])
                        if chunk.get("error"):
                            raise RuntimeError(chunk["error"])
                        for choice in chunk.get("choices") or []:
                            text += choice["delta"].get("content") or ""
                return text
        except Exception as exc:
            print(f"model call failed ({exc}); retrying", file=sys.stderr, flush=True)
            time.sleep(1)
    sys.exit(3)
first = call("stream" in mode)
open("/app/answer.txt", "w").write(first)
if "hang" in mode:
    time.sleep(600)
if "crash" in mode:
    os.kill(os.getpid(), 9)
if "twice" in mode:
    time.sleep(4)
    again = [{"role": "assistant", "content": first}, {"role": "user", "content": "Once more."}]
    open("/app/answer.txt", "w").write(call(False, again))
"""
AGENT_HARNESS = CommandHarness(f"python3 -c {shlex.quote(AGENT)} {{instruction}}")


class Link:
    """A TCP hop in front of a real server. `cut()` resets every connection and refuses new ones;
    `hold(b"/route")` keeps requests whose first bytes name the route unanswered (a stalled call)."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.held: bytes | None = None
        self.connections: list[socket.socket] = []
        self.alive = True
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while self.alive:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            client.close()
            return
        self.connections += [client, upstream]
        threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
        self._pump(client, upstream, requests=True)

    def _pump(self, source: socket.socket, sink: socket.socket, requests: bool = False) -> None:
        try:
            while data := source.recv(65536):
                if requests and self.held and self.held in data.split(b"\r\n", 1)[0]:
                    while self.alive and source.recv(65536):  # held: read, never forward, never answer
                        pass
                    return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def hold(self, route: bytes | None) -> None:
        self.held, self.held_at = route, time.monotonic()

    def cut(self) -> None:
        self.alive, self.cut_at = False, time.monotonic()
        self.listener.close()
        for s in self.connections:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
                s.close()
            except OSError:
                pass


def wait_until(condition, timeout_s: float, what: str, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
