"""What the tests' stub HTTP servers share. Each stub stands in for a real part that cannot be made to fail on
demand (an engine answering 500, a stream cut mid-body, an engine started without LoRA); each says so."""

from __future__ import annotations

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
