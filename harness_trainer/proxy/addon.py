"""The capture proxy as a mitmproxy addon: behaviour as small hooks on one flow.

  request          control routes are answered here; a model call is authenticated by its session key,
                   translated to a chat completion, checked against the session's sampling policy, given
                   the capture fields, and re-addressed to the session's upstream
  responseheaders  a streamed answer (read from the engine by relay.py) is passed on chunk by chunk (true
                   streaming) through `CallInFlight.feed`, which accumulates ids and logprobs and rewrites each
                   event for the agent; an engine error mid-stream becomes the dialect's error event
  response         a JSON answer is captured and rewritten; 408/429/5xx are retried; a context overflow
                   becomes a clean stop answer; other upstream errors pass through

A finished call is journaled before the agent receives the answer's last byte. With several engines (engines.py)
each session is pinned to one; a call that finds its engine gone ends the rollout cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

import httpx
from mitmproxy import http

from harness_trainer import fastjson
from harness_trainer._exceptions import NoEngine, PolicyRefusal
from harness_trainer.proxy.anthropic import AnthropicDialect
from harness_trainer.proxy.capture import Completion, SamplingPolicy, SSEDecoder, event_data, prepare_chat_request
from harness_trainer.proxy.control import ControlRoutes, json_response, session_key
from harness_trainer.proxy.dialects import dialect_for
from harness_trainer.proxy.engines import ENGINE_LOST, EnginePool
from harness_trainer.proxy.relay import UPSTREAM_HEADER, StreamRelay
from harness_trainer.proxy.session import Call, Session, compact
from harness_trainer.proxy.store import SessionStore
from harness_trainer.serving.process import HEALTH_EVERY_S

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
BUDGET_STOP = "Step budget exhausted; stopping."
CONTEXT_STOP = "Context length exceeded; stopping."


@dataclass
class CallInFlight:
    """One model call in flight."""
    store: SessionStore
    session: Session
    dialect: object
    asked: dict  # the agent's own request body
    sent: dict  # the chat body sent upstream
    requested_params: dict
    sent_params: dict
    stream: bool
    policy_version: int
    harness_session_id: str | None
    started: float = field(default_factory=time.time)
    completion: Completion = field(default_factory=Completion)
    decoder: SSEDecoder = field(default_factory=SSEDecoder)
    translator: object = None
    finished: bool = False
    failed: bool = False  # an error event was sent: no success ending may follow
    released: bool = False  # no longer counted in flight

    def feed(self, data: bytes) -> list[bytes]:
        """mitmproxy's stream callable: raw upstream SSE bytes in (b"" = end), the agent's chunks out.

        Returns a list: an empty bytes chunk would be sent as HTTP/1.1's terminating chunk and cut the
        stream short, so "nothing yet" must be an empty list."""
        try:
            return self._feed(data)
        except Exception as exc:  # a chunk the proxy cannot read ends the stream in an error, not a dead socket
            if self.failed or self.translator is None:
                return []
            try:
                self.finish()
            except Exception:  # what was read of the call could not be recorded: the agent still gets the error
                self.finished = True
            return [self._fail(f"the capture proxy could not read the engine's stream ({type(exc).__name__}: "
                               f"{exc})")]

    def _feed(self, data: bytes) -> list[bytes]:
        if self.translator is None:
            self.translator = self.dialect.stream_translator(self.asked)
        out = []
        for raw in self.decoder.feed(data) if data else self.decoder.feed(b"\n\n"):
            payload = event_data(raw)
            if payload == "[DONE]":
                self.finish()
                if not self.failed:
                    out.append(self.translator.done())
                continue
            chunk = None
            with contextlib.suppress(json.JSONDecodeError):
                chunk = fastjson.loads(payload) if payload else None
            if isinstance(chunk, dict) and chunk.get("error") and not self.failed:  # the engine failed mid-stream
                error = chunk["error"]
                out.append(self._fail(f"the engine failed mid-answer: "
                                      f"{error.get('message') if isinstance(error, dict) else error}"))
                continue
            if isinstance(chunk, dict) and self._alias(chunk):
                raw = b"data: " + fastjson.dumps(chunk)
            if isinstance(chunk, dict):
                if chunk.get("prompt_token_ids"):  # an array at once: the list would be held the whole answer long
                    self.completion.prompt_token_ids = compact(chunk["prompt_token_ids"], "i")
                for choice in chunk.get("choices") or []:
                    self.completion.add_choice_delta(choice)
                self.completion.usage = chunk.get("usage") or self.completion.usage
            if raw.strip():
                out.append(self.translator.event(raw, chunk if isinstance(chunk, dict) else None))
        if not data and not self.finished:  # the stream ended without [DONE]: cut (the engine died?)
            self.finish()
            if not self.failed:
                out.append(self._fail("the engine's stream ended before the answer was finished"))
        body = b"".join(out)
        return [body] if body else []

    def _alias(self, answer: dict) -> bool:
        """The agent sees the model it was given, not the adapter that sampled (policy-vN): True if renamed."""
        if answer.get("model") == self.sent["model"] != self.session.model:
            answer["model"] = self.session.model
            return True
        return False

    def _fail(self, message: str) -> bytes:
        """The agent gets its dialect's error event (its retry path), never a stream that just stops."""
        self.failed = True
        return self.translator.failed(message)

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        c = self.completion
        self.store.record(self.session, call := Call(
            index=len(self.session.calls), dialect=self.dialect.name, stream=self.stream, model=self.sent["model"],
            policy_version=self.policy_version, n_tools=len(self.sent.get("tools") or []),
            request=self.session.share(self.sent),
            sampling_params=self.sent_params, requested_sampling_params=self.requested_params,
            prompt_token_ids=c.prompt_token_ids or [], completion_token_ids=c.token_ids,
            per_token_logps=c.logprobs, message=c.message(), finish_reason=c.finish_reason,
            problem=c.problem(), harness_session_id=self.harness_session_id,
            started=self.started, finished=time.time()))
        c.prompt_token_ids = call.prompt_token_ids  # the flow outlives this: the call's array, not a list beside it


class CaptureAddon:
    def __init__(self, store: SessionStore, *, upstream: str | list[str], model: str | None = None,
                 admin_key: str | None = None, retries: int = 3, public_url: str | None = None):
        self.store = store
        self.pool = EnginePool([upstream] if isinstance(upstream, str) else upstream)
        self.upstream = self.pool.first  # the model's name is asked here
        self.model = model
        self.retries = retries
        self.control = ControlRoutes(self, admin_key=admin_key, public_url=public_url)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0))
        self.relay = StreamRelay()
        self._watch: asyncio.Task | None = None

    @property
    def several(self) -> bool:
        """One engine: a restarted engine takes its sessions back (the trainer resyncs it). Several: a lost
        engine's sessions end, new ones go to the others."""
        return len(self.pool.engines) > 1

    async def running(self) -> None:
        await self.relay.start()
        if self.several:
            self._watch = asyncio.create_task(self._watch_engines())

    async def _watch_engines(self) -> None:
        while True:
            await asyncio.gather(*(self.check_engine(url) for url in self.pool.engines), return_exceptions=True)
            await asyncio.sleep(HEALTH_EVERY_S)

    async def check_engine(self, url: str, session: Session | None = None) -> bool:
        """Is the engine alive? A silent one is lost, and `session`, whose call failed on it, ends with it."""
        alive = await self.pool.check(self.http, url, self.store.current_version, self.store.current_model)
        if not alive and session is not None:
            self.store.stop(session, f"{ENGINE_LOST}: {self.pool.get(url).why}; the rollout is not moved to "
                                     "another engine")
        return alive

    async def served_model(self, upstream: str) -> str:
        if self.model is None or upstream != self.upstream:
            models = (await self.http.get(f"{upstream}/v1/models")).json()["data"]
            if upstream != self.upstream:
                return models[0]["id"]
            self.model = models[0]["id"]
        return self.model

    def new_session(self, body: dict) -> Session:
        """Called by the control routes (after `served_model` resolved the model)."""
        return self.store.create(
            upstream=body.get("upstream") or self.pool.pick(), model=body["model"], session_id=body.get("id"),
            policy=SamplingPolicy.from_dict(body.get("policy")), max_model_calls=body.get("max_model_calls"),
            policy_version=int(body.get("policy_version", self.store.current_version)),
            metadata=body.get("metadata") or {})

    async def request(self, flow: http.HTTPFlow) -> None:
        """Fails closed: a call that did not go through the whole capture path is refused, never forwarded as
        it came (mitmproxy forwards a flow unchanged when a hook raises)."""
        try:
            await self._route(flow)
        except Exception as exc:
            self._release(flow)
            flow.metadata.pop("capture", None)
            dialect = dialect_for(flow.request.path) or dialect_for("/v1/chat/completions")
            if isinstance(exc, RecursionError):
                status, why = 400, "the request body is nested too deeply to read"
            else:  # a defect of the proxy, not of the request: say so, and keep the request away from the engine
                status, why = 500, (f"the capture proxy failed on this request ({type(exc).__name__}: {exc}); "
                                    "it was not forwarded to the engine")
            flow.response = json_response(status, dialect.error(status, why))

    async def _route(self, flow: http.HTTPFlow) -> None:
        reverse = type(flow.client_conn.proxy_mode).__name__ == "ReverseMode"
        path = flow.request.path.split("?", 1)[0].rstrip("/")
        if path.endswith("/messages/count_tokens"):
            flow.response = await self.count_tokens(flow)
            return
        dialect = dialect_for(path)
        if dialect is None:
            if reverse:
                flow.response = await self.control.handle(flow)
            return  # forward mode: traffic that is not a model call passes through untouched
        if (method := flow.request.method) != "POST":
            flow.response = json_response(405, dialect.error(405, f"{method} {path}: a model call is a POST"))
            return
        session = self.store.sessions.get(session_key(flow.request) or "")
        if session is None:
            flow.response = json_response(401, dialect.error(401, "unknown API key: it must be the id of a "
                                                                  "capture session (POST /sessions)"))
            return
        try:
            asked = fastjson.loads(flow.request.get_content() or b"")
        except (ValueError, UnicodeDecodeError) as exc:
            flow.response = json_response(400, dialect.error(400, f"request body is not valid JSON: {exc}"))
            return
        try:
            if not isinstance(asked, dict):
                raise ValueError("the body must be a JSON object")
            chat = dialect.to_chat(asked)
        except (ValueError, TypeError, AttributeError) as exc:
            flow.response = json_response(400, dialect.error(400, f"invalid {dialect.name} request: {exc}"))
            return
        stream = dialect.wants_stream(asked)
        if self.several and self.pool.is_lost(session.upstream) and not session.started_calls:
            with contextlib.suppress(NoEngine):  # lost before its first call: nothing to move, another takes it
                self.store.move(session, self.pool.pick())
        if self.several and self.pool.is_lost(session.upstream):  # mid-rollout: never moved, it ends here
            flow.response = self.stop_response(dialect, asked, session, "The engine was lost; stopping.", stream,
                                               f"{ENGINE_LOST}: {self.pool.get(session.upstream).why}")
            return
        if session.max_model_calls is not None and session.started_calls >= session.max_model_calls:
            flow.response = self.stop_response(dialect, asked, session, BUDGET_STOP, stream,
                                               f"model-call budget of {session.max_model_calls} used up")
            return
        try:
            sent, requested, sent_params = prepare_chat_request(chat, session.policy,
                                                                session.sampling_model or session.model)
        except (PolicyRefusal, TypeError, ValueError) as exc:
            flow.response = json_response(400, dialect.error(400, str(exc)))
            return
        harness_session = flow.request.headers.get("x-session-id")
        self._forward(flow, session, CallInFlight(self.store, session, dialect, asked, sent, requested, sent_params,
                                                  stream, session.policy_version, harness_session))

    def _forward(self, flow: http.HTTPFlow, session, call: CallInFlight) -> None:
        """Count the call and send the translated request to the session's engine (streams through the relay)."""
        session.started_calls += 1
        self.store.in_flight[call.sent["model"]] = self.store.in_flight.get(call.sent["model"], 0) + 1
        self.pool.call_started(session.upstream)
        flow.metadata["capture"] = call
        if call.stream:  # through the relay, so a stream the engine breaks still ends in an error event
            flow.request.url = f"http://127.0.0.1:{self.relay.port}/v1/chat/completions"
            flow.request.headers[UPSTREAM_HEADER] = session.upstream
        else:
            flow.request.url = f"{session.upstream}/v1/chat/completions"
        for header in ("authorization", "x-api-key", "x-goog-api-key", "accept-encoding"):
            flow.request.headers.pop(header, None)
        flow.request.headers["content-type"] = "application/json"
        flow.request.content = fastjson.dumps(call.sent)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        capture: CallInFlight | None = flow.metadata.get("capture")
        if capture and capture.stream and flow.response.status_code == 200:
            flow.response.stream = capture.feed

    def _release(self, flow: http.HTTPFlow) -> None:
        """The call is over (answered or failed): it no longer holds its model (adapter) in use."""
        capture: CallInFlight | None = flow.metadata.get("capture")
        if capture is not None and not capture.released:
            capture.released = True
            self.store.in_flight[capture.sent["model"]] -= 1
            done = capture.completion
            self.pool.call_ended(capture.session.upstream, len(done.prompt_token_ids or []), len(done.token_ids),
                                 answered=capture.finished and not capture.failed)

    async def error(self, flow: http.HTTPFlow) -> None:
        capture: CallInFlight | None = flow.metadata.get("capture")
        self._release(flow)
        if capture is not None and self.several:
            await self.check_engine(capture.session.upstream, capture.session)

    async def response(self, flow: http.HTTPFlow) -> None:
        capture: CallInFlight | None = flow.metadata.get("capture")
        if capture is None:
            return
        try:
            if not capture.finished:  # a streamed answer finished in `CallInFlight.feed` needs nothing more
                await self._answer(flow, capture)
        except Exception as exc:  # an answer the proxy cannot read is not passed on unread
            flow.response = json_response(502, capture.dialect.error(
                502, f"the engine's answer could not be read ({type(exc).__name__}: {exc})"))
        finally:
            self._release(flow)
        if self.several and (capture.failed or flow.response.status_code in (502, 503, 504)):
            await self.check_engine(capture.session.upstream, capture.session)  # died under the call?

    async def _answer(self, flow: http.HTTPFlow, capture: CallInFlight) -> None:
        """Retry, capture and translate a JSON answer (or a stream that came back in one piece); errors pass."""
        response = flow.response
        for attempt in range(self.retries):
            if response.status_code not in RETRY_STATUS:
                break
            await asyncio.sleep(0.2 * 2 ** attempt)
            try:
                retried = await self.http.post(f"{capture.session.upstream}/v1/chat/completions", json=capture.sent)
            except httpx.HTTPError:
                continue
            response = http.Response.make(retried.status_code, retried.content,
                                          {"content-type": retried.headers.get("content-type", "application/json")})
        if response.status_code == 200:
            if capture.stream:
                body = b"".join(capture.feed(response.content) + capture.feed(b""))
            else:
                answer = fastjson.loads(response.content)
                capture._alias(answer)
                capture.completion = Completion.from_json(answer)
                capture.finish()
                body = fastjson.dumps(capture.dialect.from_chat(answer, capture.asked))
            flow.response = http.Response.make(200, body, {
                "content-type": "text/event-stream" if capture.stream else "application/json"})
            return
        text = response.get_text(strict=False) or ""
        if response.status_code == 400 and "context length" in text.lower():
            flow.response = self.stop_response(capture.dialect, capture.asked, capture.session, CONTEXT_STOP,
                                               capture.stream, f"the prompt does not fit the engine: {text[:300]}")
            return
        try:
            message = json.loads(text).get("error", {}).get("message") or text
        except (ValueError, AttributeError):
            message = text
        flow.response = json_response(response.status_code, capture.dialect.error(response.status_code, message))

    async def count_tokens(self, flow: http.HTTPFlow) -> http.Response:
        """Anthropic's token count, answered by the engine's own tokenizer and never recorded."""
        dialect = AnthropicDialect()
        if flow.request.method != "POST":
            return json_response(405, dialect.error(405, f"{flow.request.method} count_tokens: it is a POST"))
        session = self.store.sessions.get(session_key(flow.request) or "")
        if session is None:
            return json_response(401, dialect.error(401, "unknown API key"))
        try:
            asked = json.loads(flow.request.get_content() or b"")
            if not isinstance(asked, dict):
                raise ValueError("the body must be a JSON object")
            chat = dialect.to_chat(asked)
            if not chat["messages"]:
                raise ValueError("'messages' is empty: there is nothing to count")
            payload = {"model": session.model, "messages": chat["messages"], "add_generation_prompt": True}
            if chat.get("tools"):
                payload["tools"] = chat["tools"]
        except (ValueError, TypeError, AttributeError, KeyError, UnicodeDecodeError) as exc:
            return json_response(400, dialect.error(400, f"invalid count_tokens request: {exc}"))
        try:
            answer = await self.http.post(f"{session.upstream}/tokenize", json=payload)
            counted = answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            return json_response(502, dialect.error(502, f"the engine could not be asked to count tokens: {exc}"))
        if 400 <= answer.status_code < 500:  # the engine refused what the agent sent (a bad message, ...)
            message = (counted.get("error") or {}).get("message") if isinstance(counted, dict) else None
            return json_response(400, dialect.error(400, f"invalid count_tokens request: {message or counted}"))
        if answer.status_code != 200 or not isinstance(counted, dict) or "count" not in counted:
            return json_response(502, dialect.error(502, f"the engine could not count tokens "
                                                         f"({answer.status_code}): {str(counted)[:300]}"))
        return json_response(200, {"input_tokens": counted["count"]})

    def stop_response(self, dialect, asked: dict, session: Session, text: str, stream: bool, why: str) -> http.Response:
        """A clean stop in the agent's dialect: not a captured call, but the session notes why it stopped."""
        self.store.stop(session, why)
        kind = "text/event-stream" if stream else "application/json"
        return http.Response.make(200, dialect.stop_answer(asked, session.model, text, stream), {"content-type": kind})

    async def done(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self.relay.stop()
        await self.http.aclose()
