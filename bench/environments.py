"""The white-box loop's own cost as episodes grow: environments.py driving long episodes through the real capture
proxy to a stub upstream (it answers every call at once with a tool call, in vLLM's shape, so what is measured is
the loop, the proxy and the HTTP between them, not a model), side by side at 16, 32 and 64 turns.

Each turn: one model call (the whole history sent, as every chat agent does), one tool call whose answer is
~400 tokens (1,600 characters). Reported per episode length: seconds per turn for the whole rollout, the loop's
own time per turn (the episode outside its HTTP calls), request bytes per turn, the read-back after the episode
(trace and rollout graph from the proxy), the episode's peak Python memory (tracemalloc, a separate pass), and
the group scoring time at G = 8 and 16.

    .venv/bin/python bench/environments.py [--turns 16 32 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness_trainer.proxy.client import ProxyServer  # noqa: E402
from harness_trainer.rollouts.environments import EnvironmentSession, EnvironmentSessionFactory, load_rows  # noqa: E402
from harness_trainer.rollouts.rewards import score_group  # noqa: E402
from harness_trainer.rollouts.session import run_rollout  # noqa: E402
from harness_trainer.serving.process import ManagedProcess, free_port  # noqa: E402

TOOL_OUTPUT = "x" * 1600  # ~400 tokens


class Long:
    """Answers every call with 1,600 characters; the reward is how many calls it got."""

    def __init__(self):
        self.calls = 0

    def reset(self, **kwargs) -> None:
        self.calls = 0

    def step(self, message: str) -> str:
        """Do a step.

        Args:
            message: anything
        """
        self.calls += 1
        return f"{self.calls}: {TOOL_OUTPUT}"


def reward_calls(environments, **kwargs):
    return [float(env.calls) for env in environments]


def stub_app():
    """vLLM's answer shape with a tool call; prompt ids one per 4 characters of the request's text."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    call = {"id": "call_1", "type": "function", "function": {"name": "step", "arguments": '{"message": "go"}'}}
    ids = list(range(100, 120))

    async def chat(request):
        body = await request.json()
        chars = sum(len(json.dumps(m)) for m in body["messages"])
        prompt = [7] * (chars // 4)
        content = [{"token": f"token_id:{i}", "logprob": -0.5, "top_logprobs": []} for i in ids]
        return JSONResponse({
            "id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "tiny",
            "prompt_token_ids": prompt,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                         "logprobs": {"content": content}, "finish_reason": "tool_calls", "token_ids": ids}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                      "total_tokens": len(prompt) + len(ids)}})

    async def health(request):
        return JSONResponse({})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)])


class Stub:
    """The stub in its own process: the loop's memory and time are then the loop's alone."""

    def __enter__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.managed = ManagedProcess("stub upstream", [sys.executable, __file__, "--serve-stub", str(self.port)],
                                      env=dict(os.environ), log_path=Path(tempfile.mkdtemp()) / "stub.log",
                                      health_url=f"{self.url}/health")
        self.managed.start(30)
        return self

    def __exit__(self, *exc):
        self.managed.stop()


class Timed(EnvironmentSessionFactory):
    """Counts the time and bytes of its sessions' model calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.http_s, self.sent = 0.0, 0
        original = self.http.post

        def post(url, json=None, **kw):
            started = time.perf_counter()
            try:
                self.sent += len(httpx.Request("POST", url, json=json).content)  # the bench's, not the loop's
                return original(url, json=json, **kw)
            finally:
                self.http_s += time.perf_counter() - started

        self.http.post = post


def timed_run(self) -> None:
    """EnvironmentSession._run (the episode, in its thread) with its duration and, when asked, its peak memory."""
    if self.factory.trace_memory:
        tracemalloc.start()
    started = time.perf_counter()
    try:
        RUN(self)
    finally:
        self.factory.run_s = time.perf_counter() - started
        if self.factory.trace_memory:
            self.factory.peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()


RUN, EnvironmentSession._run = EnvironmentSession._run, timed_run


def episode(proxy, turns: int, trace_memory: bool) -> dict:
    factory = Timed({"training": True, "temperature": 1.0, "max_tokens_cap": 64}, proxy=proxy.client,
                    environment_factory=Long, max_tool_calling_iterations=turns - 1, max_completion_length=10**9)
    factory.trace_memory, factory.peak = trace_memory, 0
    task = load_rows([{"prompt": "Go."}])[0]
    started = time.perf_counter()
    record = run_rollout(factory, task)
    seconds = time.perf_counter() - started
    assert record.status == "ok" and len(record.training_trace["turns"]) == turns, record.reason
    return {"s_per_turn": seconds / turns, "loop_ms_per_turn": (factory.run_s - factory.http_s) / turns * 1e3,
            "readback_s": seconds - factory.run_s, "kb_per_turn": factory.sent / turns / 1024,
            "peak_mib": factory.peak / 2**20}


def scoring(g: int) -> float:
    from harness_trainer.rollouts.session import HarnessRolloutOutcome, RolloutRecord

    records = []
    for i in range(g):
        env = Long()
        env.calls = i
        records.append(RolloutRecord("t", f"e{i}", HarnessRolloutOutcome(None, [], [], 0, 0, {}, False), "ok",
                                     environment=env))
    started = time.perf_counter()
    for _ in range(1000):
        score_group(records, [reward_calls], None, {"prompt": [{"role": "user", "content": "Go."}]})
    return (time.perf_counter() - started) / 1000 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve-stub", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_stub:
        import uvicorn

        uvicorn.run(stub_app(), host="127.0.0.1", port=args.serve_stub, log_level="error", access_log=False)
        return
    rows = {t: [] for t in args.turns}
    with Stub() as stub, ProxyServer(stub.url, model="tiny") as proxy:
        episode(proxy, 4, False)  # warm up
        for _ in range(args.repeats):  # interleaved, so drift on a noisy machine hits every size alike
            for turns in args.turns:
                rows[turns].append(episode(proxy, turns, False))
        peaks = {turns: episode(proxy, turns, True)["peak_mib"] for turns in args.turns}  # tracemalloc is slow
    print("| turns | s / turn, whole rollout | the loop's own ms / turn | request kB / turn | read-back s "
          "(trace, graph) | the loop's peak MiB |")
    print("|---|---|---|---|---|---|")
    base = None
    for turns, runs in rows.items():
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"peak_mib": peaks[turns]}
        base = base or median
        ratio = {k: median[k] / base[k] if base[k] else 0 for k in median}
        print(f"| {turns} | {median['s_per_turn']:.4f} (x{ratio['s_per_turn']:.2f}) | "
              f"{median['loop_ms_per_turn']:.2f} (x{ratio['loop_ms_per_turn']:.2f}) | "
              f"{median['kb_per_turn']:.1f} (x{ratio['kb_per_turn']:.2f}) | "
              f"{median['readback_s']:.3f} (x{ratio['readback_s']:.2f}) | "
              f"{median['peak_mib']:.2f} (x{ratio['peak_mib']:.2f}) |")
    g8, g16 = scoring(8), scoring(16)
    print(f"\nscore_group: G=8 {g8:.1f} us, G=16 {g16:.1f} us (x{g16 / g8:.2f})")


if __name__ == "__main__":
    main()
