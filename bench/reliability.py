"""Reliability at length (make test-reliability; the fast subset is tests/reliability in make test):

  --fuzz N        N property-based requests (tests/reliability/fuzzing.py) at a proxy in front of the real vLLM:
                  proxy crashes, 5xx, errors without a message, hangs, calls answered but not captured, memory
  --load-minutes  S concurrent sessions (default 256) of multi-turn conversations, streamed and JSON turns
                  alternating, through the proxy to a stub upstream that streams like the engine (the stub spells
                  each request's last message, so an answer sent to the wrong session shows). Every 10 turns a
                  session's capture is checked against what its client received, turn by turn, then deleted.
                  Reported per minute: throughput, p50 / p99 latency added over the stub itself, proxy RSS.
                  Then the same load against OpenEnv's capture proxy, side by side.

    .venv/bin/python bench/reliability.py [--fuzz 10000] [--load-minutes 10] [--sessions 256] [--openenv-minutes M]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests" / "reliability")]

from proxy import OpenEnvProxy, start_stub  # noqa: E402  (bench/proxy.py)

from harness_trainer.models.tiny import ensure_tiny_model  # noqa: E402
from harness_trainer.proxy.client import ProxyServer  # noqa: E402
from harness_trainer.serving.engine import EngineConfig, VLLMServer  # noqa: E402

TURNS_PER_SESSION = 10


def fuzz(n: int, seed: int) -> dict:
    from fuzzing import run_fuzz

    with VLLMServer(EngineConfig(model=str(ensure_tiny_model()), served_model_name="tiny",
                                 max_model_len=32768)) as engine, ProxyServer(engine.url) as proxy:
        report = run_fuzz(proxy, n, seed)
    summary = report.summary()
    summary["findings_first"] = report.findings[:10]
    summary["capture_check"] = (f"{report.captured_answers} answered model calls, {report.recorded_calls} recorded "
                                f"(+ up to {report.cut_model_calls} the client cut)")
    return summary


# ---- load ----------------------------------------------------------------------------------------------------

class Load:
    def __init__(self, name: str, new_session, read_turns, delete, rss, baseline_s: float):
        self.name, self.new_session, self.read_turns, self.delete, self.rss = name, new_session, read_turns, delete, rss
        self.baseline_s = baseline_s  # the stub's own time for a call (direct, same load)
        self.latencies: list[tuple[float, float]] = []  # (finished at, seconds)
        self.turns = self.mixed_up = self.lost = self.checked_sessions = self.errors = self.compared = 0
        self.rss_samples: list[tuple[float, int]] = []

    async def conversation(self, client: httpx.AsyncClient, deadline: float, who: int) -> None:
        while time.monotonic() < deadline:
            base, key = self.new_session()
            received = []
            messages = [{"role": "system", "content": "You are a coding agent."}]
            for turn in range(TURNS_PER_SESSION):
                said = f"session {who} {key[-6:]} turn {turn}"
                messages.append({"role": "user", "content": said})
                started = time.perf_counter()
                try:
                    text = await call(client, base, key, messages, stream=turn % 2 == 1)
                except httpx.HTTPError:
                    self.errors += 1
                    break
                self.latencies.append((time.monotonic(), time.perf_counter() - started))
                self.turns += 1
                received.append(text)
                messages.append({"role": "assistant", "content": text})
            if self.read_turns is not None:
                n, texts = await asyncio.to_thread(self.read_turns, key)
                self.lost += max(0, len(received) - n)
                self.mixed_up += sum(texts[i] != text for i, text in enumerate(received) if i in texts)
                self.compared += sum(i in texts for i in range(len(received)))
                self.checked_sessions += 1
            await asyncio.to_thread(self.delete, key)

    async def run(self, sessions: int, minutes: float) -> None:
        limits = httpx.Limits(max_connections=sessions + 8, max_keepalive_connections=sessions + 8)
        deadline = time.monotonic() + minutes * 60
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            sampler = asyncio.create_task(self.sample_rss(deadline))
            await asyncio.gather(*(self.conversation(client, deadline, i) for i in range(sessions)))
            await sampler

    async def sample_rss(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            self.rss_samples.append((time.monotonic(), self.rss()))
            await asyncio.sleep(10)
        self.rss_samples.append((time.monotonic(), self.rss()))

    def report(self, started: float) -> dict:
        minutes = {}
        for at, seconds in self.latencies:
            minutes.setdefault(int((at - started) // 60), []).append(seconds)
        end, per_minute = self.latencies[-1][0] if self.latencies else started, []
        for minute, xs in sorted(minutes.items()):
            xs.sort()
            span = min(60.0, end - (started + 60 * minute)) or 60.0
            per_minute.append({"minute": minute + 1, "calls_per_s": round(len(xs) / span, 1),
                               "added_p50_ms": round((xs[len(xs) // 2] - self.baseline_s) * 1e3, 1),
                               "added_p99_ms": round((xs[int(0.99 * (len(xs) - 1))] - self.baseline_s) * 1e3, 1)})
        rss = [r for _, r in self.rss_samples if r]
        warm = rss[min(len(rss) - 1, 6)] if rss else 0  # after the first minute: imports, caches, pools
        all_s = sorted(s for _, s in self.latencies)
        return {"proxy": self.name, "turns": self.turns, "sessions_checked": self.checked_sessions,
                "turns_lost": self.lost, "turns_compared": self.compared, "turns_mixed_up": self.mixed_up,
                "errors": self.errors,
                "calls_per_s": round(self.turns / max(1e-9, self.latencies[-1][0] - started), 1) if all_s else 0,
                "added_p50_ms": round((all_s[len(all_s) // 2] - self.baseline_s) * 1e3, 1) if all_s else None,
                "added_p99_ms": round((all_s[int(0.99 * (len(all_s) - 1))] - self.baseline_s) * 1e3, 1)
                if all_s else None,
                "rss_mib_first_min": round(warm / 1024, 1), "rss_mib_end": round(rss[-1] / 1024, 1) if rss else None,
                "rss_growth_after_first_min": round(rss[-1] / warm - 1, 3) if warm else None,
                "per_minute": per_minute}


async def call(client: httpx.AsyncClient, base: str, key: str, messages: list, stream: bool) -> str:
    body = {"model": "tiny", "messages": messages, "max_tokens": 48, "stream": stream}
    headers = {"authorization": f"Bearer {key}"}
    if not stream:
        answer = await client.post(f"{base}/chat/completions", json=body, headers=headers)
        answer.raise_for_status()
        return answer.json()["choices"][0]["message"]["content"]
    text = []
    async with client.stream("POST", f"{base}/chat/completions", json=body, headers=headers) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices") or []:
                    text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def stub_baseline(stub_url: str, sessions: int) -> float:
    """Median seconds of a call straight to the stub, at the same concurrency (what the proxies add to)."""
    load = Load("direct", lambda: (f"{stub_url}/v1", "direct"), None, lambda key: None, lambda: 0, 0.0)
    asyncio.run(load.run(sessions, 0.5))
    return statistics.median(s for _, s in load.latencies) if load.latencies else 0.0


def load_ours(stub_url: str, sessions: int, minutes: float, baseline: float) -> dict:
    from fuzzing import rss_kib

    with ProxyServer(stub_url, model="tiny") as proxy:
        client = proxy.client

        def new_session():
            s = client.create_session(policy={"max_tokens_cap": 64})
            return s["base_url"], s["api_key"]

        def read_turns(key):
            calls = client.rollout(key)["calls"]
            return len(calls), {c["index"]: c["message"].get("content") or "" for c in calls}

        load = Load("ours", new_session, read_turns, client.delete, lambda: rss_kib(proxy.managed.process.pid),
                    baseline)
        started = time.monotonic()
        asyncio.run(load.run(sessions, minutes))
        return load.report(started)


def load_openenv(stub_url: str, sessions: int, minutes: float, baseline: float) -> dict:
    from fuzzing import rss_kib

    with OpenEnvProxy(stub_url) as proxy:
        admin = httpx.Client(base_url=proxy.url, headers={"authorization": "Bearer bench-admin"}, timeout=60)

        def read_turns(key):  # how many calls it holds; the text of those it exports (it leaves out retries)
            n = admin.get(f"/sessions/{key}").json()["n_turns"]
            entries = admin.get(f"/sessions/{key}/trace_entries").json().get("entries") or []
            return n, {e["metadata"]["index"]: (e["response"]["choices"][0]["message"] or {}).get("content") or ""
                       for e in entries}

        load = Load("openenv", proxy.new_session, read_turns, lambda key: admin.delete(f"/sessions/{key}"),
                    lambda: rss_kib(proxy.managed.process.pid), baseline)
        started = time.monotonic()
        asyncio.run(load.run(sessions, minutes))
        return load.report(started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fuzz", type=int, default=10000, help="fuzzed requests (0: skip)")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--load-minutes", type=float, default=10.0, help="minutes of load on our proxy (0: skip)")
    parser.add_argument("--openenv-minutes", type=float, default=None, help="minutes on OpenEnv's (default: same)")
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--out", default=None, help="also write the figures here (JSON)")
    args = parser.parse_args()
    results = {"date": time.strftime("%Y-%m-%d")}
    if args.fuzz:
        results["fuzz"] = fuzz(args.fuzz, args.seed)
        print("fuzz:", json.dumps(results["fuzz"], indent=1), flush=True)
    if args.load_minutes:
        stub = start_stub(tokens=48, token_delay_s=0.004)
        try:
            baseline = stub_baseline(stub.url, args.sessions)
            results["stub_call_s"] = round(baseline, 4)
            results["load_ours"] = load_ours(stub.url, args.sessions, args.load_minutes, baseline)
            print("load, ours:", json.dumps(results["load_ours"], indent=1), flush=True)
            theirs = args.load_minutes if args.openenv_minutes is None else args.openenv_minutes
            if theirs:
                results["load_openenv"] = load_openenv(stub.url, args.sessions, theirs, baseline)
                print("load, OpenEnv:", json.dumps(results["load_openenv"], indent=1), flush=True)
                ours, them = results["load_ours"], results["load_openenv"]
                print(f"ours/OpenEnv: throughput {ours['calls_per_s'] / max(them['calls_per_s'], 1e-9):.2f}x, "
                      f"added p50 {ours['added_p50_ms']} vs {them['added_p50_ms']} ms, "
                      f"p99 {ours['added_p99_ms']} vs {them['added_p99_ms']} ms")
        finally:
            stub.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
