"""Every call answered at 1,024 sessions: N sessions x T turns through one proxy (with its journal, as runs start
it), each call held ~2 s by bench/stub_engine.py, as a new user's load test would send them.

    python bench/many_sessions.py [--sessions 1024] [--turns 5] [--generation-s 2] [--runs 3]

Counts, per run, the calls answered, the ones whose connection closed with no answer, and every other failure;
each answer must carry its own session's and turn's marker (a mix-up between sessions would show). "direct" is
the same load sent to the stub alone: the load generator's own ceiling (one Python process, httpx).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from harness_trainer.proxy.client import ProxyServer
from harness_trainer.serving.process import free_port

HERE = Path(__file__).resolve().parent


async def post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, key: str,
               body: bytes) -> tuple[int, bytes]:
    """One call on the session's own kept connection: httpx's pool at 1,024 connections was itself the ceiling
    (5,120 calls of 2 s took 175 s sent straight to the stub), so each agent speaks HTTP/1.1 on its own socket."""
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s\r\nauthorization: Bearer %s\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (host.encode(), key.encode(), len(body), body))
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return int(head.split(b" ")[1]), await reader.readexactly(length)


async def load(url: str, keys: list[str], turns: int) -> collections.Counter:
    outcomes: collections.Counter = collections.Counter()
    host, port = url.split("//")[1].split(":")

    async def agent(key: str) -> None:
        try:
            reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 24)
        except OSError as exc:
            outcomes[f"could not connect: {exc}"] += 1
            return
        messages = [{"role": "system", "content": "You are a coding agent."}]
        try:
            for turn in range(turns):
                marker = f"{key}-{turn}"
                messages.append({"role": "user", "content": f"step [[{marker}]]"})
                body = orjson.dumps({"model": "tiny", "messages": messages, "max_tokens": 32})
                try:
                    status, answer = await post(reader, writer, host, key, body)
                except (asyncio.IncompleteReadError, ConnectionError):
                    outcomes["closed without an answer"] += 1
                    return
                if status != 200:
                    outcomes[f"HTTP {status}: {answer[:120]!r}"] += 1
                    return
                content = orjson.loads(answer)["choices"][0]["message"]["content"]
                if content != f"ok {marker}":
                    outcomes["another's answer"] += 1
                    return
                outcomes["answered"] += 1
                messages.append({"role": "assistant", "content": content})
        finally:
            writer.close()

    await asyncio.gather(*(agent(key) for key in keys))
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--generation-s", type=float, default=2.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    stub = subprocess.Popen([sys.executable, str(HERE / "stub_engine.py"), str(port), str(args.generation_s)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                httpx.get(f"{url}/health", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        start = time.perf_counter()
        direct = asyncio.run(load(url, [f"direct-{k}" for k in range(args.sessions)], args.turns))
        print(f"direct: {dict(direct)} in {time.perf_counter() - start:.1f} s", flush=True)
        failed = 0
        for run in range(args.runs):
            journal = Path(tempfile.mkdtemp(prefix="bench-journal-"))
            try:
                with ProxyServer(url, model="tiny", journal=journal) as proxy:
                    keys = [proxy.client.create_session(id=f"s{run}-{k}")["api_key"] for k in range(args.sessions)]
                    start = time.perf_counter()
                    outcomes = asyncio.run(load(proxy.url, keys, args.turns))
                    print(f"run {run + 1}, through the proxy: {dict(outcomes)} in {time.perf_counter() - start:.1f} s",
                          flush=True)
                    failed += sum(v for k, v in outcomes.items() if k != "answered")
            finally:
                shutil.rmtree(journal, ignore_errors=True)
        print(f"{args.runs} runs of {args.sessions} sessions x {args.turns} turns: "
              f"{failed} calls not answered as they should be")
    finally:
        stub.kill()
        stub.wait()


if __name__ == "__main__":
    main()
