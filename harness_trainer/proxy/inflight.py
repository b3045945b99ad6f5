"""One model call in flight: what the agent asked, what the engine is sent, and its answer as it arrives.

A streamed answer is fed in as the engine's raw SSE bytes come (`feed`): ids and logprobs accumulate, each event
is rewritten for the agent's dialect, an engine error mid-stream becomes the dialect's error event, and the call
is recorded (journaled) before the agent receives the answer's last byte: `finish` runs before the chunk
that ends it is passed on.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field

from harness_trainer import fastjson
from harness_trainer.proxy.capture import Completion, SSEDecoder, event_data
from harness_trainer.proxy.session import Call, Session, compact
from harness_trainer.proxy.store import SessionStore


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
    body: bytes = b""  # `sent` as the engine is sent it
    started: float = field(default_factory=time.time)
    completion: Completion = field(default_factory=Completion)
    decoder: SSEDecoder = field(default_factory=SSEDecoder)
    translator: object = None
    finished: bool = False
    failed: bool = False  # an error event was sent: no success ending may follow
    released: bool = False  # no longer counted in flight
    prompt_tokens: int = 0  # the prompt's length, once the call is recorded
    ids_text: tuple[int, int] | None = None  # its prompt ids' text as the engine wrote it (fastjson.IdsText)

    def read(self, data: bytes) -> tuple[object, object]:
        """An engine answer (or stream chunk) read, its prompt ids as an array; read knowing the session's last
        prompt, which this one most often starts with (fastjson.IdsText)."""
        obj, ids, text = fastjson.loads_ids(data, self.session.ids_text)
        self.ids_text = text or self.ids_text
        return obj, ids

    @property
    def url(self) -> str:
        return f"{self.session.upstream}/v1/chat/completions"

    def feed(self, data: bytes) -> list[bytes]:
        """The engine's raw SSE bytes in (b"" = end), the agent's chunks out (mitmproxy's stream callable too).

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
            chunk, prompt_ids = None, None
            with contextlib.suppress(json.JSONDecodeError):
                chunk, prompt_ids = self.read(payload.encode()) if payload else (None, None)
            if prompt_ids is not None:  # an array at once: a list would be held the whole answer long
                self.completion.prompt_token_ids = prompt_ids
                if self.asked.get("return_token_ids"):
                    chunk["prompt_token_ids"] = prompt_ids
            if isinstance(chunk, dict) and chunk.get("error") and not self.failed:  # the engine failed mid-stream
                error = chunk["error"]
                out.append(self._fail(f"the engine failed mid-answer: "
                                      f"{error.get('message') if isinstance(error, dict) else error}"))
                continue
            if isinstance(chunk, dict) and self._alias(chunk):
                raw = b"data: " + fastjson.dumps(chunk)
            if isinstance(chunk, dict):
                if chunk.get("prompt_token_ids"):  # read as usual (not vLLM's compact JSON): an array at once
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
            prompt_suffix=c.prompt_token_ids or [], completion_token_ids=c.token_ids,
            per_token_logps=c.logprobs, message=c.message(), finish_reason=c.finish_reason,
            problem=c.problem(), harness_session_id=self.harness_session_id,
            started=self.started, finished=time.time()))
        if self.ids_text and call.prompt_tokens:  # the session's next answer is read knowing this prompt
            self.session.ids_text = fastjson.IdsText(*self.ids_text, ids=lambda: call.prompt_token_ids)
        # the flow outlives this: the whole prompt is not kept beside the call's suffix
        self.prompt_tokens, c.prompt_token_ids = call.prompt_tokens, None
