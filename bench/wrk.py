"""A load generator and an upstream that are never the bottleneck, for benches of an HTTP hop (the proxy).

  Nginx   one worker answering a fixed vLLM-shaped chat completion (token ids, logprobs, prompt ids) from
          memory in tens of microseconds: the proxy under test, not the upstream, sets the pace.
  wrk     compiled, one thread, the request formatted once (bench/wrk_post.lua): it is not the load generator
          that is measured either. Every figure is printed beside the same load sent to nginx directly.
  pin     the measured process, its threads and its children on their own cores (`taskset` for processes
          already running), and the rest elsewhere: on 2 cores, the proxy on one and nginx + wrk on the other.

Both come from Debian's packages (`nginx-light`, `wrk`): `make setup BENCH=1` installs them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import psutil

HERE = Path(__file__).resolve().parent
COMPLETION_TOKENS = 32


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` and of its descendants onto `cpus` (threads created later inherit it)."""
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        for thread in process.threads():
            os.sched_setaffinity(thread.id, cpus)


def cores() -> tuple[set[int], set[int]]:
    """(the measured process's cores, everyone else's): the first core alone, and the rest."""
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        raise SystemExit("this bench needs 2 cores: one for the process measured, one for nginx and wrk")
    return {available[0]}, set(available[1:])


def completion(prompt_tokens: int) -> dict:
    """What vLLM answers a chat call asked for token ids and logprobs: the proxies parse all of it."""
    ids = list(range(100, 100 + COMPLETION_TOKENS))
    return {
        "id": "chatcmpl-fixed", "object": "chat.completion", "created": 0, "model": "tiny",
        "prompt_token_ids": [(7 * k) % 50000 + 1 for k in range(prompt_tokens)],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * COMPLETION_TOKENS},
                     "logprobs": {"content": [{"token": f"token_id:{i}", "logprob": -0.5, "bytes": [120],
                                               "top_logprobs": []} for i in ids]},
                     "finish_reason": "stop", "token_ids": ids}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": COMPLETION_TOKENS,
                  "total_tokens": prompt_tokens + COMPLETION_TOKENS}}


def request_body(size_bytes: int) -> dict:
    """A chat request whose conversation is about `size_bytes` of JSON, grown as an agent's history grows."""
    turn = "Ran `pytest -q`: 3 failed, 12 passed. The failure is in parse_args, line 41. " * 4
    messages = [{"role": "system", "content": "You are a coding agent."}]
    while len(json.dumps(messages)) < size_bytes:
        messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": turn})
    return {"model": "tiny", "messages": messages, "max_tokens": COMPLETION_TOKENS}


class Nginx:
    """nginx answering POST /v1/chat/completions with `completion(prompt_tokens)` at once, plus /health."""

    def __init__(self, prompt_tokens: int, cpus: set[int]):
        if not shutil.which("nginx"):
            raise SystemExit("nginx is not installed: run `make setup BENCH=1` (Debian's nginx-light)")
        self.dir = Path(tempfile.mkdtemp(prefix="bench-nginx-"))
        self.dir.chmod(0o755)  # run as root, nginx's worker is another user: it must read the answer
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cpus = cpus
        (self.dir / "answer.json").write_text(json.dumps(completion(prompt_tokens), separators=(",", ":")))
        temp = " ".join(f"{kind}_temp_path {self.dir}/{kind};" for kind in ("client_body", "proxy", "fastcgi",
                                                                             "uwsgi", "scgi"))
        (self.dir / "nginx.conf").write_text(f"""
worker_processes 1;
daemon off;
pid {self.dir}/nginx.pid;
error_log {self.dir}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  {temp}
  client_max_body_size 64m;
  client_body_buffer_size 4m;
  keepalive_requests 100000000;
  default_type application/json;
  open_file_cache max=16;
  server {{
    listen 127.0.0.1:{self.port} backlog=4096;
    # nginx serves a file only to GET: error_page re-enters as GET (the body read and dropped first)
    location = /v1/chat/completions {{ error_page 405 =200 /answer.json; return 405; }}
    location = /answer.json {{ internal; root {self.dir}; }}
    location = /v1/models {{ return 200 '{{"object":"list","data":[{{"id":"tiny","object":"model"}}]}}'; }}
    location = /health {{ return 200 '{{}}'; }}
  }}
}}
""")

    def __enter__(self) -> Nginx:
        self.process = subprocess.Popen(["taskset", "-c", _cpu_list(self.cpus), "nginx", "-c",
                                         str(self.dir / "nginx.conf"), "-p", str(self.dir)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.05)
        self.process.kill()
        raise SystemExit(f"nginx did not start: {self.process.stderr.read().decode()[-2000:]}")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def wrk(url: str, path: str, keys: list[str], body: dict, *, connections: int, seconds: float,
        cpus: set[int]) -> dict:
    """One wrk run: requests/s, p50/p99 latency (ms) and errors (connect, read, write, timeout, non-2xx)."""
    with tempfile.TemporaryDirectory(prefix="bench-wrk-") as tmp:
        keys_file, body_file = Path(tmp) / "keys", Path(tmp) / "body.json"
        keys_file.write_text("\n".join(keys) + "\n")
        body_file.write_text(json.dumps(body))
        command = ["taskset", "-c", _cpu_list(cpus), "wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s",
                   "--timeout", "30s", "--script", str(HERE / "wrk_post.lua"), url, "--", str(keys_file),
                   str(body_file), path]
        out = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
    found = re.search(r"RESULT requests=(\d+) duration_us=(\d+) p50_us=([\d.]+) p99_us=([\d.]+) errors=(\d+)",
                      out.stdout)
    if not found:
        raise SystemExit(f"wrk failed ({out.returncode}): {out.stdout[-1000:]} {out.stderr[-1000:]}")
    requests, duration_us, p50, p99, errors = found.groups()
    return {"rps": int(requests) / (int(duration_us) / 1e6), "p50_ms": float(p50) / 1e3,
            "p99_ms": float(p99) / 1e3, "errors": int(errors), "requests": int(requests)}


def _cpu_list(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
