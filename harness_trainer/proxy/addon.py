"""mitmproxy's hooks over the capture logic (core.py), for agents that keep their built-in endpoint and are given
HTTPS_PROXY and the proxy's CA (the forward listener). Base-URL agents are served by front.py, without mitmproxy.

  request          `Capture.route`: a reply is written, a model call re-addressed to the session's engine (a
                   streamed one through relay.py), other traffic passed through untouched
  responseheaders  a streamed 200 answer is passed on chunk by chunk through `CallInFlight.feed`
  response         `Capture.answer` for anything else; `Capture.ended` after a stream
  error            `Capture.failed`
"""

from __future__ import annotations

from mitmproxy import http

from harness_trainer.proxy.core import Capture
from harness_trainer.proxy.inflight import CallInFlight
from harness_trainer.proxy.relay import UPSTREAM_HEADER, StreamRelay
from harness_trainer.proxy.wire import Reply


def mitm_response(reply: Reply) -> http.Response:
    return http.Response.make(reply.status, reply.body, {"content-type": reply.content_type, **reply.headers})


class CaptureAddon:
    def __init__(self, capture: Capture):
        self.capture = capture
        # When an engine dies mid-stream mitmproxy closes the agent's connection before any hook can write: the
        # relay ends its own stream with an error event instead (relay.py).
        self.relay = StreamRelay()

    async def running(self) -> None:
        await self.relay.start()

    async def done(self) -> None:
        await self.relay.stop()

    async def request(self, flow: http.HTTPFlow) -> None:
        reverse = type(flow.client_conn.proxy_mode).__name__ == "ReverseMode"
        result = await self.capture.route(flow.request, reverse=reverse)
        if isinstance(result, Reply):
            flow.response = mitm_response(result)
        elif result is not None:
            self._forward(flow, result)

    def _forward(self, flow: http.HTTPFlow, call: CallInFlight) -> None:
        flow.metadata["capture"] = call
        if call.stream:  # through the relay, so a stream the engine breaks still ends in an error event
            flow.request.url = f"http://127.0.0.1:{self.relay.port}/v1/chat/completions"
            flow.request.headers[UPSTREAM_HEADER] = call.session.upstream
        else:
            flow.request.url = call.url
        for header in ("authorization", "x-api-key", "x-goog-api-key", "accept-encoding"):
            flow.request.headers.pop(header, None)
        flow.request.headers["content-type"] = "application/json"
        flow.request.content = call.body

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        call: CallInFlight | None = flow.metadata.get("capture")
        if call and call.stream and flow.response.status_code == 200:
            flow.response.stream = call.feed
            flow.response.headers["content-type"] = call.dialect.stream_content_type

    async def response(self, flow: http.HTTPFlow) -> None:
        call: CallInFlight | None = flow.metadata.get("capture")
        if call is None:
            return
        if call.finished:  # a streamed answer, finished in `CallInFlight.feed`
            await self.capture.ended(call, flow.response.status_code)
            return
        response = flow.response
        flow.response = mitm_response(await self.capture.answer(call, response.status_code, response.content or b""))

    async def error(self, flow: http.HTTPFlow) -> None:
        call: CallInFlight | None = flow.metadata.get("capture")
        if call is not None:
            await self.capture.failed(call)
