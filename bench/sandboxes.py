"""A trial's own cost, bubblewrap beside a container, measured interleaved in one run: start (with the proxy
forwarder that isolates its network), one `true`, stop (the container removed). The container's image is
cached (a task of harbor_corpus.py, built once before the timing). Then how the data path grows as its input
doubles: a model call's body (a whole conversation: 100k tokens are ~400 KB of JSON) through the trial's
forwarder beside the same call made directly on the host, and the build context's digest (read per image
lookup unless its files' sizes and times are unchanged) as the context doubles.

Last, rollouts per minute of the tiny model (its own samples, not an oracle) through mini-swe-agent in each
sandbox, the same toy tasks, batches of 8 at once, interleaved, after two rounds of each not counted (`--rounds
0` skips it: it starts an engine). A trial's cost is measured for a container cold (its own `docker run`) and
one taking a spare (sandboxes/spares.py: started ahead for a kind of trial that recurs); the rounds, past the two
not counted, are a run's steady state, where a container trial takes a spare.

    .venv/bin/python bench/sandboxes.py [--trials 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import http.server
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harbor_corpus import build_task  # noqa: E402

from harness_trainer.rollouts.tasks import load_task  # noqa: E402
from harness_trainer.sandboxes.bubblewrap import LocalSandbox  # noqa: E402
from harness_trainer.sandboxes.containers import DockerSandbox  # noqa: E402
from harness_trainer.sandboxes.forwarder import SocketBridge  # noqa: E402
from harness_trainer.sandboxes.images import _cached_digest, context_digest, image_for  # noqa: E402
from harness_trainer.sandboxes.spares import Spares  # noqa: E402


def trial(make) -> dict[str, float]:
    times, started = {}, time.perf_counter()
    box = make()
    box.start()
    times["start"] = time.perf_counter() - started
    mark = time.perf_counter()
    box.exec("true", 30)
    times["exec"] = time.perf_counter() - mark
    mark = time.perf_counter()
    box.stop()
    times["stop"] = time.perf_counter() - mark
    times["total"] = time.perf_counter() - started
    times["spare"] = getattr(box, "origin", None) is not None  # a container started ahead
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of rollouts per sandbox (0: none)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    task = load_task(build_task(root / "tasks"))
    image = image_for(task.name, task.environment)  # built (or reused) before the timing
    bridge = SocketBridge(None, "127.0.0.1", 9)  # warms the import as the runs do
    bridge.close()
    # A cold container: each trial a kind of its own (its own run folder), so no spare is ever started for it.
    # A spare: one run folder, so the kind is hot from the second trial on and each trial takes the spare that
    # the one before asked for as it ended (started in the background while the other kinds ran).
    spares = Spares()  # a run's sandbox provider owns these; here the bench does (removals in the background too)
    kinds = {"bubblewrap": lambda i: LocalSandbox(root / f"local-{i}", proxy=("127.0.0.1", 18181)),
             "container": lambda i: DockerSandbox(root / f"cold-{i}" / "trial", image, task.environment,
                                                  proxy=("127.0.0.1", 18181), spares=spares),
             "container, spare": lambda i: DockerSandbox(root / "spare" / f"trial-{i}", image, task.environment,
                                                         proxy=("127.0.0.1", 18181), spares=spares)}
    results = {name: [] for name in kinds}
    for i in range(args.trials + 2):  # interleaved: the machine's noise falls on all alike
        for name, make in kinds.items():
            results[name].append(trial(partial(make, i)))
    results = {name: runs[2:] for name, runs in results.items()}  # the spare kind is hot from the third on
    spares.close()
    took = sum(r["spare"] for r in results["container, spare"])
    print(f"{'sandbox':<17} {'start s':>8} {'exec s':>8} {'stop s':>8} {'total s':>8}   (medians of {args.trials}; "
          f"{took} of {args.trials} took a spare)")
    medians = {}
    for name, runs in results.items():
        medians[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        m = medians[name]
        print(f"{name:<17} {m['start']:>8.3f} {m['exec']:>8.3f} {m['stop']:>8.3f} {m['total']:>8.3f}")
    for name in ("container", "container, spare"):
        print(f"{name} / bubblewrap, total per trial: {medians[name]['total'] / medians['bubblewrap']['total']:.1f}x")
    data_path(root)
    if args.rounds:
        rollouts_per_minute(args.rounds, root)


CALLS = """
import json, sys, time, urllib.request
port, sizes, n = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
out = {}
for size in sizes:
    body = b"x" * size
    times = []
    for _ in range(n):
        started = time.perf_counter()
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/", body)).read()
        times.append(time.perf_counter() - started)
    out[size] = sorted(times)[n // 2]
print(json.dumps(out))
"""


class Echo(http.server.BaseHTTPRequestHandler):
    """Stands in for the proxy: reads the body, answers with as many bytes (a long streamed answer's size)."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def data_path(root: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port, sizes = server.server_address[1], [100_000 * 2 ** k for k in range(5)]
    args = [str(port), json.dumps(sizes), "9"]
    direct = json.loads(subprocess.run([sys.executable, "-c", CALLS, *args], capture_output=True, text=True,
                                       check=True).stdout)
    box = LocalSandbox(root / "path", proxy=("127.0.0.1", port))
    box.start()
    (root / "path" / "app" / "calls.py").write_text(CALLS)
    jailed = json.loads(box.exec("python3 calls.py " + " ".join(f"'{a}'" for a in args), 300).stdout)
    peaks = {}  # the forwarder's peak RSS after calls of one size only (each exec: a fresh jail and forwarder)
    for size in (sizes[0], sizes[-1]):
        shown = box.exec(f"python3 calls.py {port} '[{size}]' 9 >/dev/null; "
                         "grep VmHWM /proc/$(pgrep -f /run/forwarder | head -n 1)/status", 120).stdout.split()
        peaks[size] = int(shown[1]) if len(shown) > 1 else None
    box.stop()
    server.shutdown()
    print(f"\n{'body (and answer)':<18} {'direct s':>9} {'forwarded s':>12} {'ratio':>6}   (medians of 9)")
    for size in sizes:
        d, f = direct[str(size)], jailed[str(size)]
        print(f"{size / 1000:>8.0f} KB          {d:>9.4f} {f:>12.4f} {f / d:>6.2f}")
    print("forwarder peak RSS: " +
          ", ".join(f"{kb} KB after {size / 1000:.0f} KB bodies" for size, kb in peaks.items()))
    print(f"\n{'context':<10} {'digest s':>9} {'cached s':>9}")
    context = root / "context"
    for k in range(4):
        context.mkdir(exist_ok=True)
        (context / f"data-{k}.bin").write_bytes(b"d" * (16 << 20) * (2 ** k if k == 0 else 2 ** (k - 1)))
        total = sum(p.stat().st_size for p in context.iterdir()) >> 20
        started = time.perf_counter()
        context_digest(context)
        full = time.perf_counter() - started
        _cached_digest(context)
        started = time.perf_counter()
        _cached_digest(context)
        print(f"{total:>6} MB   {full:>9.3f} {time.perf_counter() - started:>9.5f}")


def rollouts_per_minute(rounds: int, root: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from harness_trainer.models.tiny import ensure_tiny_model
    from harness_trainer.proxy.client import ProxyServer
    from harness_trainer.rollouts.session import LocalSessionFactory, run_rollout
    from harness_trainer.rollouts.tasks import load_dataset
    from harness_trainer.serving.engine import EngineConfig, VLLMServer

    tasks = load_dataset("builtin:toy-heldout")[:8]
    seconds = {"bubblewrap": 0.0, "container": 0.0}
    done = dict.fromkeys(seconds, 0)
    with VLLMServer(EngineConfig(model=str(ensure_tiny_model()), max_model_len=8192)) as engine, \
            ProxyServer(engine.url, model="tiny") as proxy:
        factories = {name: LocalSessionFactory({"max_tokens_cap": 32}, proxy=proxy.client, harness="mini-swe-agent",
                                               agent_config="compact", sandbox=kind, step_limit=3,
                                               output_dir=root / f"rollouts-{name}")
                     for name, kind in (("bubblewrap", "local"), ("container", "docker"))}
        # Two rounds of each first, not counted: containers are hot from the second (their trials come back after
        # others ended) and have spares from the third on, as in a run's steady state; bubblewrap warms its caches.
        for round in range(rounds + 2):
            for name, factory in factories.items():
                started = time.perf_counter()
                with ThreadPoolExecutor(len(tasks)) as pool:
                    records = list(pool.map(partial(run_rollout, factory), tasks))
                if round >= 2:
                    seconds[name] += time.perf_counter() - started
                    done[name] += len(records)
                assert all(r.status in ("ok", "timeout") for r in records), [(r.status, r.reason) for r in records]
        for factory in factories.values():
            factory.close()  # each made its sandbox provider from the kind's name: its spares go
    rates = {name: done[name] / seconds[name] * 60 for name in seconds}
    print(f"\nrollouts/min of the tiny model through mini-swe-agent (compact), {rounds} rounds of {len(tasks)} "
          "at once:")
    for name, rate in rates.items():
        print(f"{name:<12} {rate:6.1f}")
    print(f"container / bubblewrap: {rates['container'] / rates['bubblewrap']:.2f}x")


if __name__ == "__main__":
    main()
