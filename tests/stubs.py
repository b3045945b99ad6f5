"""What the tests' stubs share. Each stub stands in for a real part that cannot be made to fail on demand (an
engine answering 500, a stream cut mid-body, an engine started without LoRA, a stalled route) or for what only
timing would decide; each says so where it is used.

  StubHandler   a stub HTTP server's handler
  Link          a TCP hop in front of a real server, which the test can cut, stall, or pause mid-stream
  wait_until    wait on a condition the test controls (never on the machine's speed: bounds are generous)
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler


class StubHandler(BaseHTTPRequestHandler):
    def send_json(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _first_event_end(data: bytes) -> int | None:
    """Where the first server-sent event of a response ends in `data` (with its chunk's CRLF under chunked
    encoding), or None when no whole event is in it yet."""
    start = data.find(b"data: ")
    if start < 0:
        return None
    end = data.find(b"\n\n", start)
    if end < 0:
        return None
    end += 2
    return end + 2 if data[end:end + 2] == b"\r\n" else end


class Link:
    """A TCP hop in front of a real server (a stub: a real engine cannot be made to stall one route, or to be
    caught mid-stream, on demand; the tiny model writes 3,000 tokens faster than a test can kill it).

      cut()            resets every connection and refuses new ones (the server gone for good)
      drop()           resets every connection and keeps accepting (the server killed: its port answers again
                       once it is restarted)
      hold(b"/route")  requests whose first line names the route are read and never answered (a stalled call)
      pause_streams()  each response passes up to the end of its first event and no further: the stream is
                       "in the middle" for as long as the test wants; `first_event` is set when one has passed
    """

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.held: bytes | None = None
        self.paused = False
        self.first_event = threading.Event()
        self.connections: list[socket.socket] = []
        self.alive = True
        self._dropped = threading.Event()
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
                if not requests and self.paused and (end := _first_event_end(data)) is not None:
                    sink.sendall(data[:end])
                    self.first_event.set()
                    self._dropped.wait()  # nothing more passes: the test kills the server, then drops
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

    def pause_streams(self) -> None:
        self.paused = True
        self.first_event.clear()

    def drop(self) -> None:
        connections, self.connections = self.connections, []
        self.paused = False
        self._dropped.set()
        for s in connections:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
                s.close()
            except OSError:
                pass
        self._dropped = threading.Event()

    def cut(self) -> None:
        self.alive, self.cut_at = False, time.monotonic()
        self.listener.close()
        self.drop()


def wait_until(condition, timeout_s: float, what: str, poll_s: float = 0.1):
    """Poll `condition` until it is true; the bound only ends a test that would otherwise hang, so it is far
    above what the condition takes on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
