"""A trial's own cost, bubblewrap beside a container, measured interleaved in one run: start (with the proxy
forwarder that isolates its network), one `true`, a verifier-sized exec, stop (the container removed). The
container's image is cached (a task of harbor_corpus.py, built once before the timing).

    .venv/bin/python bench/sandboxes.py [--trials 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harbor_corpus import build_task  # noqa: E402
from harness_trainer.agents.containers import DockerSandbox, image_for  # noqa: E402
from harness_trainer.agents.forwarder import SocketBridge  # noqa: E402
from harness_trainer.agents.sandbox import LocalSandbox  # noqa: E402
from harness_trainer.rollouts.tasks import load_task  # noqa: E402


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
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    task = load_task(build_task(root / "tasks"))
    image = image_for(task.name, task.environment)  # built (or reused) before the timing
    bridge = SocketBridge(None, "127.0.0.1", 9)  # warms the import as the runs do
    bridge.close()
    kinds = {"bubblewrap": lambda i: LocalSandbox(root / f"local-{i}", proxy=("127.0.0.1", 18181)),
             "container": lambda i: DockerSandbox(root / f"docker-{i}", image, task.environment,
                                                  proxy=("127.0.0.1", 18181))}
    results = {name: [] for name in kinds}
    for i in range(args.trials):  # interleaved: the machine's noise falls on both alike
        for name, make in kinds.items():
            results[name].append(trial(lambda: make(i)))
    print(f"{'sandbox':<12} {'start s':>8} {'exec s':>8} {'stop s':>8} {'total s':>8}   (medians of {args.trials})")
    medians = {}
    for name, runs in results.items():
        medians[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        m = medians[name]
        print(f"{name:<12} {m['start']:>8.3f} {m['exec']:>8.3f} {m['stop']:>8.3f} {m['total']:>8.3f}")
    print(f"container / bubblewrap, total per trial: {medians['container']['total'] / medians['bubblewrap']['total']:.1f}x")


if __name__ == "__main__":
    main()
