"""What the capture costs as rollouts grow long: journal bytes, the proxy's memory and the time to fetch every
trace, each divided by the rollouts' unique tokens (4 bytes an id, 8 a logprob: what must be kept at least).
Memory is the proxy's RSS growth over the rollouts, after a warm-up rollout of 3 turns.

    python bench/long_rollouts.py [--turns 15 30 60 120] [--sessions 8] [--tokens-per-turn 2000]
                                  [--concurrency 64] [--out FILE.json]

Each size is its own proxy (the configuration runs use: `ProxyServer` with its journal) in front of
bench/template_engine.py, which renders the conversation as a chat template does, so every turn's prompt extends
the last. Each rollout's agent sends its whole conversation every turn and adds ~tokens-per-turn tokens of tool
output of its own. "direct" is the same rollouts sent to the engine alone: the load generator's and the engine's
own time, beside the proxied time. A figure whose ratio grows with the turns grows faster than the tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import template_engine as engine_module

from harness_trainer.proxy.client import ProxyServer
from harness_trainer.serving.process import free_port

HERE = Path(__file__).resolve().parent


class Engine:
    def __enter__(self) -> Engine:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([sys.executable, str(HERE / "template_engine.py"), str(self.port)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.url}/health", timeout=1)
                return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise SystemExit("the template engine did not start")

    def __exit__(self, *exc) -> None:
        self.process.kill()
        self.process.wait()


async def rollouts(url: str, keys: list[str], turns: int, tool_bytes: int, concurrency: int) -> dict:
    """Every rollout to `turns` turns; returns the unique tokens they hold (prompt ids of the last turn plus its
    completion, per rollout) and the completion tokens (each with a logprob)."""
    gate = asyncio.Semaphore(concurrency)
    totals = {"unique_ids": 0, "logprobs": 0, "calls": 0}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def one(key: str) -> None:
            async with gate:
                messages = engine_module.first_messages(key)
                for turn in range(turns):
                    answer = await http.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                             json={"model": "tiny", "messages": messages,
                                                   "tools": engine_module.TOOLS})
                    answer.raise_for_status()
                    body = answer.json()
                    reply = body["choices"][0]["message"]["content"]
                    if reply != f"turn {turn} of [[{key}]]":
                        raise SystemExit(f"session {key} got another's answer: {reply!r}")
                    totals["calls"] += 1
                    totals["logprobs"] += body["usage"]["completion_tokens"]
                    if turn == turns - 1:
                        totals["unique_ids"] += body["usage"]["total_tokens"]
                    messages += [{"role": "assistant", "content": reply},
                                 engine_module.tool_output(key, turn, tool_bytes)]

        await asyncio.gather(*(one(key) for key in keys))
    return totals


def measure(url: str, sessions: int, turns: int, tool_bytes: int, concurrency: int) -> dict:
    journal = Path(tempfile.mkdtemp(prefix="bench-journal-"))
    try:
        with ProxyServer(url, journal=journal) as proxy:
            process = psutil.Process(proxy.managed.process.pid)
            # a warm-up rollout first: what the proxy allocates once (its first calls' buffers, the journal's fsync
            # thread) is not what the rollouts hold
            warm = proxy.client.create_session(id=f"warm-{turns}")["id"]
            asyncio.run(rollouts(proxy.url, [warm], 3, tool_bytes, 1))
            keys = [proxy.client.create_session(id=f"r{k}-{turns}")["id"] for k in range(sessions)]
            rss0 = process.memory_info().rss
            start = time.perf_counter()
            totals = asyncio.run(rollouts(proxy.url, keys, turns, tool_bytes, concurrency))
            seconds = time.perf_counter() - start
            grown = process.memory_info().rss - rss0
            fetched = {}
            for form, compact in (("compact", True), ("whole", False)):
                t0, size = time.perf_counter(), 0
                for key in keys:
                    size += len(proxy.client.trace_json(key, compact=compact))
                fetched[form] = (time.perf_counter() - t0, size)
        journal_bytes = sum(p.stat().st_size for p in journal.glob("*.jsonl"))
    finally:
        shutil.rmtree(journal, ignore_errors=True)
    unique = 4 * totals["unique_ids"] + 8 * totals["logprobs"]
    return {"sessions": sessions, "turns": turns, "calls": totals["calls"], "unique_ids": totals["unique_ids"],
            "unique_bytes": unique, "journal_bytes": journal_bytes, "journal_x": journal_bytes / unique,
            "memory_bytes": grown, "memory_x": grown / unique, "rollouts_s": seconds,
            "fetch_compact_s": fetched["compact"][0], "compact_bytes": fetched["compact"][1],
            "compact_x": fetched["compact"][1] / unique, "fetch_whole_s": fetched["whole"][0],
            "whole_bytes": fetched["whole"][1], "whole_x": fetched["whole"][1] / unique,
            "fetch_compact_us_per_kid": 1e6 * fetched["compact"][0] / (totals["unique_ids"] / 1000)}


def direct(url: str, sessions: int, turns: int, tool_bytes: int, concurrency: int) -> float:
    start = time.perf_counter()
    asyncio.run(rollouts(url, [f"d{k}-{turns}" for k in range(sessions)], turns, tool_bytes, concurrency))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, nargs="+", default=[15, 30, 60, 120])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--tokens-per-turn", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tool_bytes = 4 * args.tokens_per_turn  # hex text: ~4 bytes a token in the template's ids
    rows = []
    print("| rollouts x turns | unique tokens | journal | proxy memory | compact trace | whole trace | "
          "fetch every trace (compact) | rollouts' time (direct) |")
    print("|---|---|---|---|---|---|---|---|")
    with Engine() as engine:
        for turns in args.turns:
            row = measure(engine.url, args.sessions, turns, tool_bytes, args.concurrency)
            row["direct_s"] = direct(engine.url, args.sessions, turns, tool_bytes, args.concurrency)
            rows.append(row)
            print(f"| {row['sessions']:,} x {turns} | {row['unique_ids']:,} | {row['journal_bytes'] / 1e6:.1f} MB = "
                  f"{row['journal_x']:.2f}x | {row['memory_bytes'] / 1e6:.1f} MB = {row['memory_x']:.2f}x | "
                  f"{row['compact_x']:.2f}x | {row['whole_x']:.1f}x | {row['fetch_compact_s']:.2f} s "
                  f"({row['fetch_compact_us_per_kid']:.0f} us / 1k tokens) | {row['rollouts_s']:.1f} s "
                  f"({row['direct_s']:.1f} s) |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
