"""The policy sync's answers when an engine goes away at the wrong moment (training/policy_sync.py), on a stub
engine that answers /health and drops every other request (fault injection: a real engine cannot be made to
vanish between two requests on demand). Found on a fresh clone: an engine cut between the pre-step check's /health
and its next request crashed the run with a raw ConnectError instead of the clear stop."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import pytest
from stubs import StubHandler

from harness_trainer._exceptions import EngineUnreachable
from harness_trainer.serving.sync_steps import post_step
from harness_trainer.training.policy_sync import PolicySync


class HealthOnly(StubHandler):
    def do_GET(self):
        if self.path == "/health":
            self.send_json(200, b"{}")
        else:
            self.close_connection = True
            self.connection.shutdown(2)  # gone before it answers: a transport error for the client

    do_POST = do_GET


@pytest.fixture
def engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), HealthOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_an_engine_that_goes_away_after_its_health_check_is_not_a_crash(engine):
    # full weights, then LoRA: "cannot say now" (the sync after the step meets it, and waits for it)
    assert PolicySync._engine_serves_policy(SimpleNamespace(served_name=None, version=3), engine) is True
    assert PolicySync._engine_serves_policy(SimpleNamespace(served_name="policy-v3", version=3), engine) is True


def test_a_sync_step_that_cannot_reach_its_engine_says_so_by_its_kind(engine):
    with httpx.Client(timeout=5) as client, pytest.raises(EngineUnreachable, match="weight sync step 'pause' could"):
        post_step(client, f"{engine}/pause", "pause")
