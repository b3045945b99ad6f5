"""The capture proxy's behaviour, whichever front speaks HTTP (front.py for base-URL agents, addon.py for
HTTPS_PROXY agents through mitmproxy). A front calls, per request:

  route    control routes are answered; a model call is authenticated by its session key, translated to a chat
           completion, checked against the session's sampling policy and given the capture fields: the front
           gets a `Reply` to write, or a `CallInFlight` to send to `call.url` (None: forward-mode traffic that
           is not a model call, passed through untouched)
  then, for a call it sent:
    feed     a streamed 200 answer, chunk by chunk (CallInFlight.feed), then `ended`
    answer   any other answer (JSON, an error, a stream that came back in one piece): 408/429/5xx are retried,
             a context overflow becomes a clean stop answer, other upstream errors pass through translated
    failed   the engine could not be reached, or the agent went away before the answer was finished

With several engines (engines.py) each session is pinned to one; a call that finds its engine gone ends the
rollout cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys

import httpx

from harness_trainer import fastjson
from harness_trainer._exceptions import NoEngine, PolicyRefusal
from harness_trainer.proxy.anthropic import AnthropicDialect
from harness_trainer.proxy.capture import Completion, SamplingPolicy, prepare_chat_request
from harness_trainer.proxy.control import ControlRoutes, session_key
from harness_trainer.proxy.dialects import dialect_for
from harness_trainer.proxy.engines import ENGINE_LOST, EnginePool
from harness_trainer.proxy.google import GoogleDialect
from harness_trainer.proxy.google import route as google_route
from harness_trainer.proxy.inflight import CallInFlight
from harness_trainer.proxy.session import Session
from harness_trainer.proxy.store import SessionStore
from harness_trainer.proxy.wire import Reply, Request, json_reply
from harness_trainer.serving.process import HEALTH_EVERY_S
from harness_trainer.traces.sharing import share_request

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
BUDGET_STOP = "Step budget exhausted; stopping."
CONTEXT_STOP = "Context length exceeded; stopping."


class Capture:
    def __init__(self, store: SessionStore, *, upstream: str | list[str], model: str | None = None,
                 admin_key: str | None = None, retries: int = 3, public_url: str | None = None,
                 confdir: str | None = None):
        self.store = store
        self.pool = EnginePool([upstream] if isinstance(upstream, str) else upstream)
        self.upstream = self.pool.first  # the model's name is asked here
        self.model = model
        self.retries = retries
        self.control = ControlRoutes(self, admin_key=admin_key, public_url=public_url, confdir=confdir)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0))  # retries and control calls
        self._watch: asyncio.Task | None = None

    @property
    def several(self) -> bool:
        """One engine: a restarted engine takes its sessions back (the trainer resyncs it). Several: a lost
        engine's sessions end, new ones go to the others."""
        return len(self.pool.engines) > 1

    async def running(self) -> None:
        if self.several:
            self._watch = asyncio.create_task(self._watch_engines())

    async def done(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self.http.aclose()

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
        """Called by the control routes (after `served_model` resolved the model): journaled before they answer."""
        return self.store.create(
            upstream=body.get("upstream") or self.pool.pick(), model=body["model"], session_id=body.get("id"),
            policy=SamplingPolicy.from_dict(body.get("policy")), max_model_calls=body.get("max_model_calls"),
            policy_version=int(body.get("policy_version", self.store.current_version)),
            metadata=body.get("metadata") or {})

    async def route(self, request: Request, *, reverse: bool) -> Reply | CallInFlight | None:
        """Fails closed: a call that did not go through the whole capture path is refused, never forwarded as
        it came."""
        try:
            return await self._route(request, reverse)
        except Exception as exc:
            dialect = dialect_for(request.path) or dialect_for("/v1/chat/completions")
            if isinstance(exc, RecursionError):
                status, why = 400, "the request body is nested too deeply to read"
            else:  # a defect of the proxy, not of the request: say so, and keep the request away from the engine
                status, why = 500, (f"the capture proxy failed on this request ({type(exc).__name__}: {exc}); "
                                    "it was not forwarded to the engine")
            return json_reply(status, dialect.error(status, why))

    async def _route(self, request: Request, reverse: bool) -> Reply | CallInFlight | None:
        path = request.path.split("?", 1)[0].rstrip("/")
        if path.endswith("/messages/count_tokens"):
            return await self.count_tokens(request, AnthropicDialect(), "input_tokens")
        if google_route(path) and path.endswith(":countTokens"):
            return await self.count_tokens(request, GoogleDialect(), "totalTokens")
        dialect = dialect_for(request.path)
        if dialect is None:  # forward mode: traffic that is not a model call passes through untouched
            return await self.control.handle(request) if reverse else None
        if (method := request.method) != "POST":
            return json_reply(405, dialect.error(405, f"{method} {path}: a model call is a POST"))
        session = self.store.sessions.get(session_key(request) or "")
        if session is None:
            return json_reply(401, dialect.error(401, "unknown API key: it must be the id of a capture session "
                                                      "(POST /sessions)"))
        try:
            asked = fastjson.loads(request.get_content() or b"")
        except (ValueError, UnicodeDecodeError) as exc:
            return json_reply(400, dialect.error(400, f"request body is not valid JSON: {exc}"))
        try:
            if not isinstance(asked, dict):
                raise ValueError("the body must be a JSON object")
            # what it repeats is freed now, not when the call ends
            session.last_request = share_request(asked, session.last_request, session.shared)
            chat = dialect.to_chat(asked)
        except (ValueError, TypeError, AttributeError) as exc:
            return json_reply(400, dialect.error(400, f"invalid {dialect.name} request: {exc}"))
        stream = dialect.wants_stream(asked)
        if self.several and self.pool.is_lost(session.upstream) and not session.started_calls:
            with contextlib.suppress(NoEngine):  # lost before its first call: nothing to move, another takes it
                self.store.move(session, self.pool.pick())
        if self.several and self.pool.is_lost(session.upstream):  # mid-rollout: never moved, it ends here
            return self.stop_reply(dialect, asked, session, "The engine was lost; stopping.", stream,
                                   f"{ENGINE_LOST}: {self.pool.get(session.upstream).why}")
        if session.max_model_calls is not None and session.started_calls >= session.max_model_calls:
            return self.stop_reply(dialect, asked, session, BUDGET_STOP, stream,
                                   f"model-call budget of {session.max_model_calls} used up")
        try:
            sent, requested, sent_params = prepare_chat_request(chat, session.policy,
                                                                session.sampling_model or session.model)
        except (PolicyRefusal, TypeError, ValueError) as exc:
            return json_reply(400, dialect.error(400, str(exc)))
        call = CallInFlight(self.store, session, dialect, asked, sent, requested, sent_params, stream,
                            session.policy_version, request.headers.get("x-session-id"), fastjson.dumps(sent))
        self._count(call)  # last: nothing after it may fail, or the call would stay counted in flight
        return call

    def _count(self, call: CallInFlight) -> None:
        call.session.started_calls += 1
        in_flight = self.store.in_flight
        in_flight[call.sent["model"]] = in_flight.get(call.sent["model"], 0) + 1
        self.pool.call_started(call.session.upstream)

    def release(self, call: CallInFlight) -> None:
        """The call is over (answered or failed): it no longer holds its model (adapter) in use."""
        if not call.released:
            call.released = True
            self.store.in_flight[call.sent["model"]] -= 1
            done = call.completion
            self.pool.call_ended(call.session.upstream, call.prompt_tokens or len(done.prompt_token_ids or []),
                                 len(done.token_ids),
                                 answered=call.finished and not call.failed)

    async def failed(self, call: CallInFlight) -> None:
        """No answer reached the agent: the engine could not be reached, or the agent went away."""
        self.release(call)
        if self.several:
            await self.check_engine(call.session.upstream, call.session)

    async def ended(self, call: CallInFlight, status: int = 200) -> None:
        """The agent has its whole answer: an engine's error (5xx, a broken stream) or a real one."""
        self.release(call)
        self.engine_answered(call, "the stream broke off" if call.failed else
                             f"the engine answered HTTP {status}" if status >= 500 else None)
        if self.several and (call.failed or status in (502, 503, 504)):
            await self.check_engine(call.session.upstream, call.session)  # died under the call?

    @staticmethod
    def engine_answered(call: CallInFlight, failure: str | None) -> None:
        """The session's latest call got its answer from the engine (None), or why not: kept on the session (a
        rollout that ends on it is unscorable) and said in the proxy's log."""
        call.session.engine_failure = failure
        if failure:
            print(f"capture proxy: session {call.session.id}: no answer from the engine: {failure}", file=sys.stderr,
                  flush=True)

    async def answer(self, call: CallInFlight, status: int, body: bytes) -> Reply:
        """Retry, capture and translate an answer that came in one piece; errors pass translated."""
        try:
            reply = await self._answer(call, status, body)
        except Exception as exc:  # an answer the proxy cannot read is not passed on unread
            reply = json_reply(502, call.dialect.error(
                502, f"the engine's answer could not be read ({type(exc).__name__}: {exc})"))
        await self.ended(call, reply.status)  # a finished call was journaled when it finished (store.py)
        return reply

    async def _answer(self, call: CallInFlight, status: int, body: bytes) -> Reply:
        for attempt in range(self.retries):
            if status not in RETRY_STATUS:
                break
            await asyncio.sleep(0.2 * 2 ** attempt)
            try:
                retried = await self.http.post(call.url, content=call.body,
                                               headers={"content-type": "application/json"})
            except httpx.HTTPError:
                continue
            status, body = retried.status_code, retried.content
        if status == 200:
            if call.stream:
                return Reply(200, b"".join(call.feed(body) + call.feed(b"")), "text/event-stream")
            answer, prompt_ids = call.read(body)
            call._alias(answer)
            call.completion = Completion.from_json(answer)
            if prompt_ids is not None:
                call.completion.prompt_token_ids = prompt_ids
                if call.asked.get("return_token_ids"):  # the agent asked for them itself
                    answer["prompt_token_ids"] = prompt_ids
            call.finish()
            return Reply(200, fastjson.dumps(call.dialect.from_chat(answer, call.asked)))
        text = body.decode("utf-8", "replace")
        if status == 400 and "context length" in text.lower():
            return self.stop_reply(call.dialect, call.asked, call.session, CONTEXT_STOP, call.stream,
                                   f"the prompt does not fit the engine: {text[:300]}")
        try:
            message = json.loads(text).get("error", {}).get("message") or text
        except (ValueError, AttributeError):
            message = text
        return json_reply(status, call.dialect.error(status, message))

    async def count_tokens(self, request: Request, dialect, field: str) -> Reply:
        """Anthropic's and Google's token counts, answered by the engine's own tokenizer and never recorded
        (`field`: the answer's one field)."""
        if request.method != "POST":
            return json_reply(405, dialect.error(405, f"{request.method} count_tokens: it is a POST"))
        session = self.store.sessions.get(session_key(request) or "")
        if session is None:
            return json_reply(401, dialect.error(401, "unknown API key"))
        try:
            asked = json.loads(request.get_content() or b"")
            if not isinstance(asked, dict):
                raise ValueError("the body must be a JSON object")
            chat = dialect.to_chat(asked)
            if not chat["messages"]:
                raise ValueError("'messages' is empty: there is nothing to count")
            payload = {"model": session.model, "messages": chat["messages"], "add_generation_prompt": True}
            if chat.get("tools"):
                payload["tools"] = chat["tools"]
        except (ValueError, TypeError, AttributeError, KeyError, UnicodeDecodeError) as exc:
            return json_reply(400, dialect.error(400, f"invalid count_tokens request: {exc}"))
        try:
            answer = await self.http.post(f"{session.upstream}/tokenize", json=payload)
            counted = answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            return json_reply(502, dialect.error(502, f"the engine could not be asked to count tokens: {exc}"))
        if 400 <= answer.status_code < 500:  # the engine refused what the agent sent (a bad message, ...)
            message = (counted.get("error") or {}).get("message") if isinstance(counted, dict) else None
            return json_reply(400, dialect.error(400, f"invalid count_tokens request: {message or counted}"))
        if answer.status_code != 200 or not isinstance(counted, dict) or "count" not in counted:
            return json_reply(502, dialect.error(502, f"the engine could not count tokens "
                                                      f"({answer.status_code}): {str(counted)[:300]}"))
        return json_reply(200, {field: counted["count"]})

    def stop_reply(self, dialect, asked: dict, session: Session, text: str, stream: bool, why: str) -> Reply:
        """A clean stop in the agent's dialect: not a captured call, but the session notes why it stopped."""
        self.store.stop(session, why)
        return Reply(200, dialect.stop_answer(asked, session.model, text, stream),
                     dialect.stream_content_type if stream else "application/json")
