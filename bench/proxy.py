"""Capture-proxy benchmark: this project's proxy beside OpenEnv's capture proxy, in one run, measured so that
neither the load generator nor the upstream is the bottleneck (docs/benchmarks.md, "The capture proxy"):

  * the proxy alone on one core (`pin`), nginx and wrk on the other; nginx answers a fixed vLLM-shaped completion
    (its prompt ids as long as the request's conversation) in tens of microseconds; wrk is compiled
  * this proxy as runs start it, with its journal ("ours"), and without ("ours, no journal": no run does that)
  * added latency: p50 / p99 of one connection calling in a loop over the 64 sessions' keys, minus nginx's own
    (direct, same run)
  * throughput: requests/s at 64 sessions on 64 connections, for 1 KB and 200 KB request bodies; direct beside
  * streamed time to first content chunk, proxied / direct (a Python stub streaming a token every 4 ms, one
    call at a time, so the stub is idle between tokens)
  * --memory N: the proxy's memory per rollout as calls and conversations double (N rollouts each)
  * --profile: where a call's time goes on the proxy's core, by body size (py-spy: JSON, HTTP, capture, ...)

    .venv/bin/python bench/proxy.py [--quick] [--sizes 1024 204800] [--seconds 8] [--profile [BYTES ...]] [--memory N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from wrk import Nginx, cores, pin, request_body, wrk

from harness_trainer.proxy.client import ProxyServer
from harness_trainer.serving.process import ManagedProcess, free_port

SESSIONS = 64
MESSAGES = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix the bug."}]
# ---- a streaming upstream (stub: one call at a time, idle between its tokens) --------------------------

def stub_app(tokens: int, token_delay_s: float):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    prompt = list(range(1, 60))

    async def chat(request):
        raw = await request.body()
        body = json.loads(raw)
        n = min(tokens, body.get("max_tokens") or tokens)
        ids = list(range(100, 100 + n))
        # the answer spells the last message, so an answer delivered to the wrong session can be seen
        last = str((body.get("messages") or [{}])[-1].get("content") or "x")
        text = [last[k % len(last)] for k in range(n)]
        content = [{"token": f"token_id:{i}", "logprob": -0.5, "bytes": [120], "top_logprobs": []} for i in ids]
        if not body.get("stream"):  # OpenEnv's proxy asks for the whole answer and replays it as a stream
            await asyncio.sleep(token_delay_s * n)  # the same generation time as the stream
            return JSONResponse({
                "id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "tiny",
                "prompt_token_ids": list(range(1, max(60, len(raw) // 4))),  # ~4 bytes of JSON a token
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


def journaled(upstream: str) -> ProxyServer:
    """This proxy as a run starts it: with a journal (in a folder of its own, kept until the bench ends)."""
    return ProxyServer(upstream, model="tiny", journal=tempfile.mkdtemp(prefix="bench-journal-"),
                       startup_timeout_s=60)


def ours_session(proxy: ProxyServer) -> tuple[str, str]:
    s = proxy.client.create_session(policy={"max_tokens_cap": 8192})
    return s["base_url"], s["api_key"]


# ---- measurements ------------------------------------------------------------------------------------------

def hop(name: str, url: str, new_session) -> dict:
    return {"name": name, "url": url, "new_session": new_session}


def run_wrk(target: dict, body: dict, connections: int, seconds: float, cpus: set[int]) -> dict:
    """Fresh sessions for every run (a proxy keeps every call it captured: a run must not inherit another's); each
    request under the next of SESSIONS keys, on one connection as on many (a session's calls, as a run makes them,
    are one among many: one key would measure a session whose every call finds the last one's state at hand)."""
    keys = [target["new_session"]() for _ in range(SESSIONS)]
    return wrk(target["url"], "/v1/chat/completions", keys, body, connections=connections, seconds=seconds,
               cpus=cpus)


def measure_size(size: int, seconds: float, rounds: int, proxy_cpus: set[int], other: set[int]) -> list[dict]:
    """Every target at one body size, interleaved over `rounds` (drift hits each alike); the median round."""
    body = request_body(size)
    prompt_tokens = max(60, len(json.dumps(body)) // 4)  # ~4 bytes of JSON per token: the engine's prompt ids
    journal = Path(tempfile.mkdtemp(prefix="bench-journal-"))
    with Nginx(prompt_tokens, other) as upstream, \
            ProxyServer(upstream.url, model="tiny", journal=journal, startup_timeout_s=60) as ours, \
            ProxyServer(upstream.url, model="tiny", startup_timeout_s=60) as bare, OpenEnvProxy(upstream.url) as env:
        for server in (ours, bare, env):
            pin(server.managed.process.pid, proxy_cpus)
        targets = [hop("direct", upstream.url, lambda: "none"),
                   hop("ours", ours.url, lambda: ours_session(ours)[1]),
                   hop("ours, no journal", bare.url, lambda: ours_session(bare)[1]),
                   hop("openenv", env.url, lambda: env.new_session()[1])]
        runs: dict[str, dict[str, list[dict]]] = {t["name"]: {"latency": [], "load": []} for t in targets}
        for target in targets:  # warm-up: connections, caches, the first session
            run_wrk(target, body, 1, 1, other)
        for _ in range(rounds):
            for target in targets:
                runs[target["name"]]["latency"].append(run_wrk(target, body, 1, seconds / 2, other))
                runs[target["name"]]["load"].append(run_wrk(target, body, SESSIONS, seconds, other))
    shutil.rmtree(journal, ignore_errors=True)
    rows = []
    for name, kinds in runs.items():
        latency = sorted(kinds["latency"], key=lambda r: r["p50_ms"])[len(kinds["latency"]) // 2]
        load = sorted(kinds["load"], key=lambda r: r["rps"])[len(kinds["load"]) // 2]
        errors = sum(r["errors"] for k in kinds.values() for r in k)
        rows.append({"size": len(json.dumps(body)), "answer_tokens": prompt_tokens, "target": name,
                     "p50_ms": latency["p50_ms"], "p99_ms": latency["p99_ms"], "rps_1": latency["rps"],
                     "rps_64": load["rps"], "p50_ms_64": load["p50_ms"], "errors": errors})
    return rows


def print_rows(rows: list[dict]) -> None:
    direct = {r["size"]: r for r in rows if r["target"] == "direct"}
    openenv = {r["size"]: r for r in rows if r["target"] == "openenv"}
    print(f"\n{'body':>8} {'target':16} {'p50 ms':>7} {'p99 ms':>7} {'added p50':>9} {'added p99':>9} "
          f"{'req/s 1':>8} {'req/s 64':>9} {'vs openenv':>10} {'errors':>6}")
    for r in rows:
        d, o = direct[r["size"]], openenv[r["size"]]
        added = (" " * 19 if r["target"] == "direct"
                 else f"{r['p50_ms'] - d['p50_ms']:9.2f} {r['p99_ms'] - d['p99_ms']:9.2f}")
        print(f"{r['size'] / 1024:6.0f}KB {r['target']:16} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f} {added} "
              f"{r['rps_1']:8.0f} {r['rps_64']:9.0f} {r['rps_64'] / o['rps_64']:9.2f}x {r['errors']:6d}")


async def first_chunk(client: httpx.AsyncClient, base: str, key: str, tokens: int) -> float:
    started = time.perf_counter()
    async with client.stream("POST", f"{base}/chat/completions", headers={"authorization": f"Bearer {key}"},
                             json={"model": "tiny", "messages": MESSAGES, "max_tokens": tokens,
                                   "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content":""' not in line.replace(" ", "") \
                    and '"content":"' in line.replace(" ", ""):
                return time.perf_counter() - started
    raise SystemExit(f"{base}: a stream ended without content")


def measure_streams(calls: int, proxy_cpus: set[int], other: set[int]) -> dict[str, float]:
    """Median time to the first content chunk, one call at a time, per target."""
    stub = start_stub(tokens=48, token_delay_s=0.004)
    pin(stub.process.pid, other)
    try:
        with journaled(stub.url) as ours, OpenEnvProxy(stub.url) as env:
            pin(ours.managed.process.pid, proxy_cpus)
            pin(env.managed.process.pid, proxy_cpus)
            targets = {"direct": (f"{stub.url}/v1", "none"), "ours": ours_session(ours), "openenv": env.new_session()}

            async def run() -> dict[str, list[float]]:
                times: dict[str, list[float]] = {name: [] for name in targets}
                async with httpx.AsyncClient(timeout=60) as client:
                    for k in range(calls + 2):  # interleaved; the first two rounds warm up
                        for name, (base, key) in targets.items():
                            t = await first_chunk(client, base, key, 48)
                            if k >= 2:
                                times[name].append(t)
                return times
            times = asyncio.run(run())
    finally:
        stub.stop()
    return {name: statistics.median(ts) for name, ts in times.items()}


# ---- what a rollout costs the proxy in memory -----------------------------------------------------------------

def conversation(turns: int, final_bytes: int, salt: str) -> list[list[dict]]:
    """The messages of each call of one rollout: a tool result per turn, growing to `final_bytes`."""
    grow = final_bytes // turns
    messages = [{"role": "system", "content": f"You are a coding agent ({salt})."}]
    calls = []
    for k in range(turns):
        messages = messages + [{"role": "user", "content": f"{salt} turn {k}: " + "out " * (grow // 4)}]
        calls.append(messages)
        messages = messages + [{"role": "assistant", "content": f"ran command {k}"}]
    return calls


def measure_memory(rollouts: int, turns: int, final_bytes: int, proxy_cpus: set[int], other: set[int]) -> dict:
    """The proxy's RSS growth per rollout of `turns` calls whose conversation grows to `final_bytes`, the
    engine answering with as many prompt ids as the conversation has tokens (~4 bytes each)."""
    stub = start_stub(tokens=32, token_delay_s=0)
    pin(stub.process.pid, other)
    try:
        with journaled(stub.url) as ours, httpx.Client(timeout=120) as client:
            pin(ours.managed.process.pid, proxy_cpus)
            proxy = psutil.Process(ours.managed.process.pid)
            before = 0
            for r in range(rollouts + 1):  # the first rollout is not counted: it lifts the heap to the largest
                base, key = ours_session(ours)  # call's transient peak, which later calls reuse
                for messages in conversation(turns, final_bytes, f"rollout {r}"):
                    client.post(f"{base}/chat/completions", headers={"authorization": f"Bearer {key}"},
                                json={"model": "tiny", "messages": messages, "max_tokens": 32}).raise_for_status()
                before = before or proxy.memory_info().rss
            grown = proxy.memory_info().rss - before
    finally:
        stub.stop()
    return {"turns": turns, "final_kb": final_bytes / 1024, "per_rollout_mb": grown / rollouts / 2 ** 20}


# ---- where a call's time goes (py-spy on the proxy, at saturation) -----------------------------------------

GROUPS = (("JSON", ("json/", "fastjson.py", "orjson")),
          ("HTTP front", ("proxy/front.py", "proxy/upstream.py", "proxy/wire.py")), ("capture", ("harness_trainer/",)),
          ("mitmproxy", ("mitmproxy/",)), ("asyncio + sockets", ("asyncio/", "selectors.py", "socket.py")))


def group_of(frame: str) -> str:
    return next((name for name, marks in GROUPS if any(m in frame for m in marks)), "other")


def profile_size(size: int, seconds: float, proxy_cpus: set[int], other: set[int]) -> dict:
    """ms per call in each group: py-spy's self time shares times the call's cost at saturation (1 / req/s)."""
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        raise SystemExit("py-spy is not installed: run `make setup BENCH=1`")
    body = request_body(size)
    with Nginx(max(60, len(json.dumps(body)) // 4), other) as upstream, \
            journaled(upstream.url) as ours, \
            tempfile.TemporaryDirectory() as tmp:
        pin(ours.managed.process.pid, proxy_cpus)
        target = hop("ours", ours.url, lambda: ours_session(ours)[1])
        run_wrk(target, body, 1, 1, other)
        recorder = subprocess.Popen([str(spy), "record", "-p", str(ours.managed.process.pid), "-d", str(int(seconds)),
                                     "-r", "250", "-f", "raw", "-o", f"{tmp}/raw", "--nonblocking"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        load = run_wrk(target, body, SESSIONS, seconds, other)
        recorder.wait(60)
        counts: dict[str, int] = {}
        for line in Path(f"{tmp}/raw").read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            leaf = stack.rsplit(";", 1)[-1]
            counts[group_of(leaf)] = counts.get(group_of(leaf), 0) + int(n)
    total = sum(counts.values()) or 1
    per_call_ms = 1e3 / load["rps"]
    return {"size": len(json.dumps(body)), "rps": load["rps"], "per_call_ms": per_call_ms,
            **{name: per_call_ms * counts.get(name, 0) / total for name, _ in (*GROUPS, ("other", ()))}}


def print_profile(rows: list[dict]) -> None:
    names = [name for name, _ in GROUPS] + ["other"]
    print(f"\nwhere a call's time goes on the proxy's core (ms per call, 64 sessions):\n{'body':>8} {'req/s':>7} "
          f"{'per call':>8} " + " ".join(f"{n:>17}" for n in names))
    for r in rows:
        print(f"{r['size'] / 1024:6.0f}KB {r['rps']:7.0f} {r['per_call_ms']:8.2f} "
              + " ".join(f"{r[n]:17.2f}" for n in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round of 2 s runs, 20 streams")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 200 * 1024], help="request bodies (bytes)")
    parser.add_argument("--seconds", type=float, default=8.0, help="each throughput run (latency: half)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument("--profile", type=int, nargs="*", metavar="BYTES",
                        help="only where a call's time goes, at these body sizes (default 1 KB to 400 KB)")
    parser.add_argument("--memory", type=int, metavar="ROLLOUTS",
                        help="only the memory a rollout costs the proxy, over this many rollouts")
    parser.add_argument("--serve-stub", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_stub:
        return serve_stub(int(args.serve_stub[0]), int(args.serve_stub[1]), float(args.serve_stub[2]))
    seconds, rounds, streams = (2.0, 1, 20) if args.quick else (args.seconds, args.rounds, 60)
    proxy_cpus, other = cores()
    os.sched_setaffinity(0, other)  # this process (sessions, the stream client) stays off the proxy's core
    if args.memory:
        for turns, final_kb in ((15, 200), (30, 200), (30, 400)):
            m = measure_memory(args.memory, turns, final_kb * 1024, proxy_cpus, other)
            print(f"memory: {m['turns']} calls growing to {m['final_kb']:.0f} KB: {m['per_rollout_mb']:.1f} MB "
                  f"per rollout held by the proxy ({args.memory} rollouts)")
        return None
    if args.profile is not None:
        sizes = args.profile or [1024, 25 * 1024, 100 * 1024, 200 * 1024, 400 * 1024]
        return print_profile([profile_size(size, seconds, proxy_cpus, other) for size in sizes])
    print(f"proxy on cpu {sorted(proxy_cpus)}; nginx, wrk and this process on {sorted(other)}")
    rows = [row for size in args.sizes for row in measure_size(size, seconds, rounds, proxy_cpus, other)]
    print_rows(rows)
    ttft = measure_streams(streams, proxy_cpus, other)
    print(f"\nstreamed, first content chunk (median of {streams}): "
          + ", ".join(f"{name} {t * 1e3:.1f} ms" for name, t in ttft.items())
          + f"; ratio to direct: ours {ttft['ours'] / ttft['direct']:.2f}, "
          f"openenv {ttft['openenv'] / ttft['direct']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "first_chunk_s": ttft}, indent=1))


if __name__ == "__main__":
    main()
