"""What the tests' stubs share. Each stub stands in for a real part that cannot be made to fail on demand (an
engine answering 500, a stream cut mid-body, an engine started without LoRA, a stalled route) or for what only
timing would decide; each says so where it is used.

  StubHandler   a stub HTTP server's handler
  FlakyUpstream an engine that answers 503 when told to, else forwards to the real one
  Link          a TCP hop in front of a real server, which the test can cut, stall, or pause mid-stream
  wait_until    wait on a condition the test controls (never on the machine's speed: bounds are generous)
  ScriptedSessions, StubPolicy, StubSync   the trainer's collaborators (a session factory, the policy, the
                engine sync) with no agent, model or engine: the loop's own tests (tests/training/test_loop.py)
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler

import httpx


class StubHandler(BaseHTTPRequestHandler):
    def send_json(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class FlakyUpstream(StubHandler):
    """A stub upstream for fault injection (a real vLLM cannot be made to fail on demand): answers 503
    `failures` times, then forwards to the real engine; a last message "bad" gets a 422, "down" a 503 always."""
    failures = 0
    seen = 0
    engine_url = ""

    def do_GET(self):
        self.send_json(200, httpx.get(self.engine_url + self.path, timeout=30).content)

    def do_POST(self):
        payload = self.rfile.read(int(self.headers["content-length"]))
        type(self).seen += 1
        last = json.loads(payload).get("messages", [{}])[-1].get("content")
        if type(self).seen <= type(self).failures or last == "down":
            status, body = 503, b'{"error": {"message": "overloaded"}}'
        elif last == "bad":
            status, body = 422, b'{"error": {"message": "upstream says no"}}'
        else:
            answer = httpx.post(self.engine_url + self.path, content=payload, timeout=60,
                                headers={"content-type": "application/json"})
            status, body = answer.status_code, answer.content
        self.send_json(status, body)


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
      release()        the held rest of each paused response passes, and what follows it
      hold_answers(b"/route")  an answer to a request on that route is held whole (streamed or not):
                       `answer_held` is set once one is; drop() ends it
    """

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.held: bytes | None = None
        self.paused = False
        self.first_event = threading.Event()
        self.answers_held: bytes | None = None
        self.answer_held = threading.Event()
        self.connections: list[socket.socket] = []
        self.alive = True
        self._dropped, self._released = threading.Event(), threading.Event()
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
        route: list[bytes] = [b""]  # the request line this connection last sent (HTTP/1.1: answers in order)
        threading.Thread(target=self._pump, args=(upstream, client, False, route), daemon=True).start()
        self._pump(client, upstream, True, route)

    def _pump(self, source: socket.socket, sink: socket.socket, requests: bool = False,
              route: list[bytes] | None = None) -> None:
        try:
            while data := source.recv(65536):
                if requests and route is not None and data[:8].split(b" ")[0] in (b"GET", b"POST"):
                    route[0] = data.split(b"\r\n", 1)[0]
                if not requests and self.answers_held and route and self.answers_held in route[0]:
                    self.answer_held.set()
                    dropped = self._dropped
                    dropped.wait()  # held whole until the test drops the connection
                    return
                if requests and self.held and self.held in data.split(b"\r\n", 1)[0]:
                    while self.alive and source.recv(65536):  # held: read, never forward, never answer
                        pass
                    return
                if not requests and self.paused and (end := _first_event_end(data)) is not None:
                    sink.sendall(data[:end])
                    self.first_event.set()
                    dropped, released = self._dropped, self._released
                    while not (dropped.is_set() or released.wait(0.05)):  # nothing more passes until told
                        pass
                    if dropped.is_set():
                        return
                    data = data[end:]
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
        self._released = threading.Event()

    def hold_answers(self, route: bytes | None) -> None:
        self.answers_held = route
        self.answer_held.clear()

    def release(self) -> None:
        self.paused = False
        self._released.set()

    def drop(self) -> None:
        connections, self.connections = self.connections, []
        self.paused, self.answers_held = False, None
        for s in connections:
            try:  # shutdown first: a close alone does not wake a pump blocked in recv on the socket, which then
                # keeps it open (a stream held open forever, seen beside a CPU hog); linger 0 makes the close a RST
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._dropped.set()  # a paused pump returns
        for s in connections:
            with contextlib.suppress(OSError):
                s.close()
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


# ---- the trainer's collaborators as stubs: the loop (training/trainer.py) run with no engine, model or agent ----

def scripted_turns(prompt: list[int], completion: list[int], version: int, logp: float = -2.0) -> list[dict]:
    """One captured turn in the trace's wire form, as the proxy exports it (training/packing.py reads it)."""
    return [{"node_id": "n0", "prompt_token_ids": prompt, "completion_token_ids": completion,
             "per_token_logps": [logp] * len(completion), "loss_mask": [0] * len(prompt) + [1] * len(completion),
             "metadata": {"policy_version": version}}]


class ScriptedSession:
    """A RolloutSession (rollouts/session.py) that runs no agent: its turns and reward are given. `hold` keeps it
    running until the test sets the event (or the trainer cancels it): an agent still at work, with no clock."""
    end_reason, environment, error, timed_out, timeout_s = "", None, None, False, 60.0

    def __init__(self, episode_id: str, turns: list[dict], reward: float | None, hold: threading.Event | None):
        from harness_trainer.agents.base import AgentReport

        self.episode_id, self.turns, self.reward = episode_id, turns, reward
        self.report, self.cancelled = AgentReport(), False
        self.hold = hold

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        while self.hold is not None and not self.cancelled and not self.hold.wait(0.05):
            pass
        return 0

    def fetch_training_trace(self):
        from openenv.core.harness.training import TrainingTrace

        return TrainingTrace.model_validate({"turns": self.turns})

    def trace_json(self) -> bytes:
        return self.fetch_training_trace().model_dump_json().encode()

    def proxy_stops(self) -> list[str]:
        return []

    def first_version(self) -> int | None:  # the version its first call was stamped with, as the proxy says
        return min((t["metadata"]["policy_version"] for t in self.turns), default=None)

    def rollout_calls(self) -> list[dict]:  # as the proxy's graph gives them: a call's token counts, no ids
        return [{"node_id": t["node_id"], "role": "agent", "prompt_tokens": len(t["prompt_token_ids"]),
                 "completion_tokens": len(t["completion_token_ids"])} for t in self.turns]

    def verify(self, transcript=None, final_state=None):
        from openenv.core.harness.rollout import VerifyResult

        return VerifyResult(env_reward=self.reward, done=True, metrics={"verifier": "scripted"})

    def cancel(self) -> None:
        self.cancelled = True

    def close(self) -> None:
        pass


class ScriptedSessions:
    """A SessionFactory (rollouts/session.py) of ScriptedSessions. `script(task, index, episode_id, version)`
    gives a rollout's (turns, reward); `version()` is the policy version the proxy would stamp on its turns now;
    tasks named in `held` run until their event is set or they are cancelled. Called with the trainer's sampling
    policy, as a partial of LocalSessionFactory is."""

    def __init__(self, script, version=lambda: 0, held: dict[str, threading.Event] | None = None):
        self.script, self.version, self.held = script, version, held or {}
        self.sampling = None
        self.created: list[str] = []
        self.closed = False

    def __call__(self, sampling):
        self.sampling = sampling
        return self

    def create(self, task, seed: int | None = None, episode_id: str | None = None) -> ScriptedSession:
        index = int(episode_id.rsplit("-", 1)[1])
        turns, reward = self.script(task, index, episode_id, self.version())
        self.created.append(episode_id)
        return ScriptedSession(episode_id, turns, reward, self.held.get(task.name))

    def close(self) -> None:
        self.closed = True


class StubPolicy:
    """A TrainablePolicy (training/protocols.py) with no model: a step records the groups it was given and says
    how many tokens it would train; a checkpoint holds the steps taken."""
    model, peft, model_dir, rank, world_size = None, None, None, 0, 1

    def __init__(self):
        import torch

        self.dtype = torch.float32
        self.steps: list[tuple[int, list[str]]] = []  # (step, the episode ids trained on)
        self.restored: dict | None = None
        self.leading = False

    def step(self, groups: list, step: int) -> dict:
        self.steps.append((step, [r.episode_id for records in groups for r in records]))
        tokens = sum(len(t["completion_token_ids"]) for records in groups for r in records
                     for t in (r.training_trace or {}).get("turns", []))
        return {"trained_tokens": tokens, "loss": 0.0}

    def together(self, work: str):
        raise AssertionError("one rank: nothing to gather")

    def full_weights(self):
        return None

    def optimizer_state(self) -> dict:
        return {"steps": len(self.steps)}

    def probe_logits(self):
        raise AssertionError("the stub sync never probes")

    def save_model(self, path):
        from pathlib import Path

        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "policy.json").write_text(json.dumps(self.steps))
        return Path(path)

    save_policy = save_model

    def restore(self, path, optimizer_state: dict) -> None:
        self.restored = {"path": str(path), "optimizer": optimizer_state}

    @contextlib.contextmanager
    def lead(self):
        self.leading = True
        try:
            yield
        finally:
            self.leading = False


class StubSync:
    """An EngineSync (training/protocols.py) with no engine: each sync moves the version on and is recorded;
    `stop_at` makes ensure_services (a service gone) or sync_weights (a failed sync) stop the run at that step."""

    def __init__(self, stop_services_at: int | None = None, stop_sync_at: int | None = None):
        self.version, self.last_probe_gap = 0, 0.0
        self.synced: list[int] = []  # the step at each sync
        self.stop_services_at, self.stop_sync_at = stop_services_at, stop_sync_at
        self.closed = False

    def sync_weights(self, step: int) -> float:
        from harness_trainer._exceptions import TrainingStopped

        if step == self.stop_sync_at:
            raise TrainingStopped(f"weight sync at step {step} failed: the stub was told to fail")
        self.synced.append(step)
        self.version += 1
        return 0.0

    def ensure_services(self, step: int) -> bool:
        from harness_trainer._exceptions import TrainingStopped

        if step == self.stop_services_at:
            raise TrainingStopped("the engine at stub has not answered for 5 s. Start it again, then resume")
        return False

    def engine_metrics(self) -> dict:
        return {}

    def engine_time(self) -> dict:
        return {}  # no engine: the rollout side's idle is not reported

    def take_recovered(self) -> list[str]:
        return []

    def close(self) -> None:
        self.closed = True


class TrialBox:
    """A sandbox of a user's own, named `--sandbox stubs:TrialBox` (sandboxes/registry.py takes module:Class): it
    keeps the Trial it was made from, for the test to read."""

    def __init__(self, trial):
        self.trial = trial
