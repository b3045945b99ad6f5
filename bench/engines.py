"""Two engines behind one capture proxy: what pinning each rollout to its engine buys, side by side in one run.

  * prefix-cache hit rate of multi-turn rollouts (each call resends the whole, growing history, as agents do):
    pinned (the proxy's rule: a session's calls stay on its engine) vs round-robin (call k of a rollout on
    engine k mod 2, through two proxy sessions, one on each engine), from vLLM's own counters
  * rollout throughput (rollouts a minute) with one engine vs two behind the proxy

Both engines serve the embedded tiny model from this machine's CPU cores, so the throughput row measures the
proxy's spreading, not more hardware: on 2 cores two CPU engines share the same cores.

    .venv/bin/python bench/engines.py [--rollouts 16] [--turns 8]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from harness_trainer.models.tiny import ensure_tiny_model
from harness_trainer.proxy.client import ProxyServer
from harness_trainer.proxy.engines import prometheus_total
from harness_trainer.serving.engine import EngineConfig, VLLMServer

SYSTEM = "You are a coding agent. " * 40  # a long shared head, as agents' system prompts are


def cache_counts(urls: list[str]) -> tuple[float, float]:
    """(tokens found in the prefix cache, tokens looked up) summed over the engines."""
    hits = queries = 0.0
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        hits += prometheus_total(text, "vllm:prefix_cache_hits") or 0.0
        queries += prometheus_total(text, "vllm:prefix_cache_queries") or 0.0
    return hits, queries


def call(session: dict, messages: list[dict], max_tokens: int) -> str:
    answer = httpx.post(session["base_url"] + "/chat/completions", timeout=300,
                        headers={"authorization": f"Bearer {session['api_key']}"},
                        json={"messages": messages, "max_tokens": max_tokens})
    answer.raise_for_status()
    return answer.json()["choices"][0]["message"]["content"] or "ok"


def rollout(sessions: list[dict], index: int, turns: int, max_tokens: int) -> None:
    """One multi-turn rollout; call k goes through sessions[k % len(sessions)]."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task {index}: fix the bug."}]
    for k in range(turns):
        text = call(sessions[k % len(sessions)], messages, max_tokens)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Step {k}: go on."}]


def run(proxy: ProxyServer, urls: list[str], rollouts: int, turns: int, max_tokens: int, pinned: bool,
        concurrency: int) -> dict:
    hits0, queries0 = cache_counts(urls)
    started = time.perf_counter()

    def one(i: int) -> None:
        if pinned:
            sessions = [proxy.client.create_session()]
        else:  # one session on each engine, the rollout's calls alternating between them
            sessions = [proxy.client.create_session(upstream=url) for url in urls]
        rollout(sessions, i, turns, max_tokens)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(rollouts)))
    seconds = time.perf_counter() - started
    hits, queries = cache_counts(urls)
    return {"hit_rate": (hits - hits0) / max(queries - queries0, 1), "rollouts_per_min": 60 * rollouts / seconds,
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    model, logs = ensure_tiny_model(), Path(tempfile.mkdtemp(prefix="bench-engines-"))
    engines = [VLLMServer(EngineConfig(model=str(model), served_model_name="tiny", max_model_len=8192,
                                       log_path=logs / f"vllm{i}.log")) for i in range(2)]
    for engine in engines:
        engine.start()
    try:
        urls = [e.url for e in engines]
        settings = (args.rollouts, args.turns, args.max_tokens)
        with ProxyServer(urls, log_path=logs / "proxy2.log") as two:
            rows = {"2 engines, pinned": run(two, urls, *settings, pinned=True, concurrency=args.concurrency),
                    "2 engines, round-robin": run(two, urls, *settings, pinned=False, concurrency=args.concurrency)}
        with ProxyServer(urls[:1], log_path=logs / "proxy1.log") as one:
            rows["1 engine"] = run(one, urls[:1], *settings, pinned=True, concurrency=args.concurrency)
    finally:
        for engine in engines:
            engine.stop()
    print(f"{args.rollouts} rollouts of {args.turns} turns, {args.concurrency} at once, tiny model on CPU")
    print("| routing | prefix-cache hit rate | rollouts / min | seconds |\n|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['hit_rate']:.1%} | {row['rollouts_per_min']:.1f} | {row['seconds']:.0f} |")
    pinned, spread = rows["2 engines, pinned"], rows["2 engines, round-robin"]
    print(f"\npinned / round-robin hit rate: {pinned['hit_rate'] / max(spread['hit_rate'], 1e-9):.2f}x; "
          f"2 engines / 1 engine throughput: {pinned['rollouts_per_min'] / rows['1 engine']['rollouts_per_min']:.2f}x")


if __name__ == "__main__":
    main()
