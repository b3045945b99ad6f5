"""The HTTP the proxy's own front speaks (proxy/front.py, proxy/upstream.py), on raw sockets against the real
proxy and engine: keep-alive, chunked bodies with `Expect: 100-continue`, clear errors for what is not HTTP, and
a kept engine connection that the engine closed while it sat idle."""

from __future__ import annotations

import http.client
import json
import re
import socket

from stubs import Link

CALL = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


def _read_answer(sock: socket.socket) -> tuple[int, bytes]:
    """One answer with a content-length, read off a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or b"!"
        assert not data.endswith(b"!"), f"the connection closed before an answer: {data!r}"
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ")[1]), body


def test_one_connection_carries_health_json_and_streamed_calls(proxy):
    session = proxy.client.create_session()
    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
    headers = {"authorization": f"Bearer {session['api_key']}", "content-type": "application/json"}
    sockets = []
    for method, path, body in [("GET", "/health", None), ("POST", "/v1/chat/completions", CALL),
                               ("POST", "/v1/chat/completions", dict(CALL, stream=True)),
                               ("POST", "/v1/chat/completions", CALL)]:
        connection.request(method, path, body=json.dumps(body) if body else None, headers=headers)
        answer = connection.getresponse()
        content = answer.read()
        assert answer.status == 200, content
        sockets.append(connection.sock)
        if body and body.get("stream"):
            assert answer.getheader("transfer-encoding") == "chunked" and content.rstrip().endswith(b"[DONE]")
    assert all(s is sockets[0] for s in sockets), "every request went over the one connection"
    assert len(proxy.client.rollout(session["id"])["calls"]) == 3


def test_a_chunked_body_after_100_continue_is_captured(proxy):
    session = proxy.client.create_session()
    body = json.dumps(CALL).encode()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
                     b"content-type: application/json\r\ntransfer-encoding: chunked\r\nexpect: 100-continue\r\n\r\n"
                     % session["api_key"].encode())
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        half = len(body) // 2
        sock.sendall(b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:]))
        status, answer = _read_answer(sock)
    assert status == 200 and json.loads(answer)["choices"][0]["message"]
    assert len(proxy.client.rollout(session["id"])["calls"]) == 1


def test_what_is_not_http_gets_a_clear_error_and_a_closed_connection(proxy):
    cases = [(b"HELLO\r\n\r\n", 400, "not an HTTP request line"),
             (b"GET /health HTTP/1.1\r\nx-pad: " + b"a" * (2 << 20) + b"\r\n\r\n", 431, "headers are too long"),
             (b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 999999999999\r\n\r\n", 413, "over the proxy"),
             (b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: ten\r\n\r\n", 400, "bad content-length")]
    for request, status, says in cases:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=60) as sock:
            sock.sendall(request)
            got, body = _read_answer(sock)
            assert (got, says) == (status, says) and says in json.loads(body)["error"]["message"]
            try:  # closed after a request it could not read (reset where part of the request was left unread)
                assert sock.recv(100) == b""
            except ConnectionResetError:
                pass


def test_pipelined_requests_are_answered_in_order_and_a_smuggling_request_is_refused(proxy):
    """llhttp reads the requests (proxy/http1.py): two sent at once get two answers in order; a body framed two
    ways at once (Content-Length and chunked: how requests are smuggled past a front) gets a 400."""
    two = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\nGET /nope HTTP/1.1\r\nhost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=60) as sock:
        sock.sendall(two)
        data = b""
        while data.count(b"HTTP/1.1 ") < 2 or not data.rstrip().endswith(b"}"):  # both answers, whole
            data += sock.recv(65536) or b"!"
            assert not data.endswith(b"!"), f"the connection closed before two answers: {data!r}"
        assert re.findall(rb"HTTP/1\.1 (\d{3}) ", data) == [b"200", b"404"]
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"0\r\n\r\nGET /health HTTP/1.1\r\n\r\n")
        status, body = _read_answer(sock)
        assert status == 400 and "Content-Length" in json.loads(body)["error"]["message"]


def test_an_engine_connection_closed_while_idle_is_not_the_agents_failure(proxy, engine):
    link = Link(int(engine.url.rsplit(":", 1)[1]))  # a stub hop: the engine cannot be made to reset on demand
    session = proxy.client.create_session(upstream=link.url)
    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
    headers = {"authorization": f"Bearer {session['api_key']}", "content-type": "application/json"}
    for _ in range(3):
        connection.request("POST", "/v1/chat/completions", body=json.dumps(CALL), headers=headers)
        answer = connection.getresponse()
        assert answer.status == 200, answer.read()
        answer.read()
        link.drop()  # the proxy's kept connection to the engine is reset between two calls
    assert len(proxy.client.rollout(session["id"])["calls"]) == 3
    link.cut()


class ClosesAfterOneAnswer:
    """A stub engine whose kept connections are closed by it when the next request comes (as a server whose
    keep-alive timeout ends just then): a real vLLM cannot be made to do that on demand. The first request of
    each connection waits until `together` have come, so the proxy holds that many connections to it. Its
    answers are bench/template_engine.py's (vLLM-shaped: prompt ids, sampled ids, logprobs)."""

    def __init__(self, together: int):
        import threading

        import template_engine

        self.answer, self.barrier = template_engine.answer, threading.Barrier(together)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client, client.makefile("rb") as stream:
            for served in range(2):
                head = b"".join(iter(stream.readline, b"\r\n"))
                if not head or served == 1 and head.startswith(b"POST"):
                    return  # the kept connection is closed, the request never answered
                length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length")), b"0"))
                body = stream.read(length)
                if head.startswith(b"POST"):
                    self.barrier.wait(60)  # a bound for a broken test only: the calls are sent at once
                    out = self.answer(json.loads(body))
                else:
                    out = b'{"object":"list","data":[{"id":"tiny","object":"model"}]}'
                client.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                               % (len(out), out))


def test_a_call_that_finds_two_kept_engine_connections_closed_is_answered_on_a_new_one(tmp_path):
    """Two calls at once leave the proxy two kept connections to the engine; the engine closes each when the next
    call comes on it. The retry took a second kept connection, found it closed too, and the agent's connection
    was closed with no answer: every call must be answered."""
    import sys
    import threading
    from pathlib import Path

    import httpx

    from harness_trainer.proxy.client import ProxyServer

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    engine = ClosesAfterOneAnswer(together=2)
    with ProxyServer(engine.url, model="tiny", journal=tmp_path / "journal") as proxy:
        keys = [proxy.client.create_session(id=f"kept-{k}")["api_key"] for k in range(2)]

        def call(key: str, marker: str) -> httpx.Response:
            messages = [{"role": "user", "content": f"go [[{marker}]]"}]
            return httpx.post(f"{proxy.url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                              json={"model": "tiny", "messages": messages}, timeout=60)

        answers: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda k=k: answers.append(call(k, k))) for k in keys]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert [a.status_code for a in answers] == [200, 200]
        engine.barrier = threading.Barrier(1)  # from now on each call is answered alone
        again = call(keys[0], "again")
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["message"]["content"] == "turn 0 of [[again]]"
