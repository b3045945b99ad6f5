"""The rollout side at the scale of real runs: N rollouts in flight at once, every part real but the model.

    .venv/bin/python bench/rollouts_at_scale.py --rollouts 1024 [--calls 8] [--final-kb 200] [--generation-s 2]
                                                [--minutes 10] [--settle-minutes 0] [--group 16] [--no-journal]
                                                [--sandbox docker] [--sigkill-after SECONDS]

Each rollout is a scripted agent (bench/scripted_agent.py: CALLS model calls, the conversation growing to FINAL_KB,
odd calls streamed, a shell command between calls) run by the `command` harness in its own bubblewrap jail with
its forwarder, through the capture proxy (journaled, as a training run's is) to a stub engine that answers like
vLLM after GENERATION_S (bench/stub_engine.py), scored by the task's verifier in a jail of its own, collected by
the rollout pool in groups of GROUP, written as a training run writes them. With --minutes, groups are launched
as others end, keeping N in flight, for that long.

Reported: rollouts/min; the latency each call added to the generation time (agent-measured, p50/p99); CPU and
peak memory of the proxy, the forwarders, the jails and this process (the pool and the trials' socket bridges);
threads and open file descriptors; every turn captured exactly once in the right session (0 lost, 0 mixed, 0
duplicated: each user message carries [[session key:turn]]); memory over time; what the run left behind
(containers, bridge folders, jails and forwarders: none is right). `--sandbox docker`: each rollout in a container
of its own (the task has no image: images.DEFAULT_IMAGE), the containers' processes and Docker's daemons measured
too. `--sigkill-after S`: the run is a child SIGKILLed after S seconds, and what it leaves is watched until gone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from harness_trainer.agents.command import CommandHarness
from harness_trainer.proxy.client import ProxyServer
from harness_trainer.rollouts.pool import RolloutPool
from harness_trainer.rollouts.session import LocalSessionFactory
from harness_trainer.rollouts.tasks import load_dataset
from harness_trainer.rollouts.trace_reader import CHECKER
from harness_trainer.sandboxes.images import LABEL
from harness_trainer.serving.process import ManagedProcess, free_port

HERE = Path(__file__).resolve().parent
MARK = re.compile(r"^\[\[([^\]:]+):(\d+)\]\]")
TEST = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /app/answer.txt 2>/dev/null)" = "{word}" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""


def make_tasks(root: Path, n: int) -> list:
    for i in range(n):
        task, word = root / f"scale-{i:04d}", f"w{i:04d}"
        (task / "tests").mkdir(parents=True)
        (task / "environment" / "app").mkdir(parents=True)
        (task / "instruction.md").write_text(f"Write the word {word} into answer.txt.\n")
        (task / "task.toml").write_text("[agent]\ntimeout_sec = 3600\n\n[verifier]\ntimeout_sec = 600\n")
        (task / "tests" / "test.sh").write_text(TEST.format(word=word))
        (task / "tests" / "test.sh").chmod(0o755)
        shutil.copy(HERE / "scripted_agent.py", task / "environment" / "app" / "scripted_agent.py")
    return load_dataset(str(root))


def pss(process: psutil.Process) -> int:
    return process.memory_full_info().pss


class Sampler:
    """Every few seconds: memory (PSS) by part, this process's threads, the proxy's and this process's descriptors."""

    def __init__(self, proxy_pid: int, stub_pid: int, every_s: float = 5.0):
        self.proxy, self.stub = psutil.Process(proxy_pid), psutil.Process(stub_pid)
        self.me, self.every_s, self.samples = psutil.Process(), every_s, []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                self.samples.append(self.sample())
            except psutil.Error:
                continue

    def sample(self) -> dict:
        """PSS, not RSS: a page shared by N processes (the Python binary of every forwarder) counts 1/N each."""
        fixed = {self.proxy.pid, self.stub.pid, *(p.pid for p in self.proxy.children(recursive=True))}
        rss = {"proxy": pss(self.proxy), "forwarders": 0, "jails": 0, "pool": pss(self.me), "containers": 0,
               "docker": 0}
        for process in psutil.process_iter(["name"]):  # a container's processes live under Docker's shim
            try:
                if process.info["name"].startswith("containerd-shim"):
                    rss["containers"] += sum(pss(p) for p in (process, *process.children(recursive=True)))
                elif process.info["name"] in ("dockerd", "containerd"):
                    rss["docker"] += pss(process)
            except psutil.Error:
                continue
        jails = 0
        for process in self.me.children(recursive=True):
            if process.pid in fixed:
                continue
            try:
                program = " ".join(Path(word).name for word in process.cmdline()[:4])  # compiled or Python's
                part = "forwarders" if "forwarder" in program else "jails"
                if "trace_check" in " ".join(process.cmdline()):  # OpenEnv's validator, the pool's own process
                    part = "pool"
                rss[part] += pss(process)
                jails += process.name() == "bwrap"
            except psutil.Error:
                continue
        return {"t": time.time(), "rss": rss, "bwrap": jails, "threads": self.me.num_threads(),
                "fds_pool": self.me.num_fds(), "fds_proxy": self.proxy.num_fds()}

    def stop(self) -> dict:
        self.stopped.set()
        self.thread.join()
        cpu = {"proxy": sum(self.proxy.cpu_times()[:2]), "stub": sum(self.stub.cpu_times()[:2])}
        children = resource.getrusage(resource.RUSAGE_CHILDREN)  # reaped: the jails and what ran in them
        me = resource.getrusage(resource.RUSAGE_SELF)
        cpu.update(jails=children.ru_utime + children.ru_stime, pool=me.ru_utime + me.ru_stime)
        if CHECKER.pid:  # the pool's trace checker, not reaped until the run ends
            cpu.update(checker=sum(psutil.Process(CHECKER.pid).cpu_times()[:2]))
        return cpu


def check(record, calls: int, keys: dict[str, str], latencies: list[float], trials: Path, generation_s: float) -> dict:
    """Lost, duplicated and mixed turns of one rollout (from its trace), and its calls' added latencies."""
    found = {"lost": calls, "duplicated": 0, "mixed": 0, "failed": 0}
    if record.status != "ok" or record.outcome.env_reward != 1.0 or not record.training_trace:
        found["failed"] = 1
        return found
    seen = []
    for turn in record.training_trace["turns"]:
        last = [m for m in turn["request"]["messages"] if m.get("role") == "user"][-1]["content"]
        key, k = MARK.match(last).groups()
        seen.append(int(k))
        if keys.setdefault(key, record.episode_id) != record.episode_id:
            found["mixed"] += 1
    own = {k for k, episode in keys.items() if episode == record.episode_id}
    found["mixed"] += len(own) > 1
    found.update(lost=calls - len(set(seen)), duplicated=len(seen) - len(set(seen)))
    path = trials / record.episode_id / "logs" / "agent" / "latencies.json"
    if path.exists():
        latencies += [t - generation_s for t in json.loads(path.read_text())]
    return found


def run(args, tasks, factory, out: Path) -> tuple[dict, list[float], float]:
    """Keep args.rollouts in flight (groups of args.group) until args.minutes pass, or one wave without it.
    totals["steady"]: when the first group was collected (from then on rollouts end as others start) and
    totals["kept"]: when the last group was launched (after that the rollouts in flight only fall)."""
    totals = {"lost": 0, "duplicated": 0, "mixed": 0, "failed": 0, "rollouts": 0, "steady": 0.0, "kept": 0.0}
    keys: dict[str, str] = {}
    latencies: list[float] = []
    reasons: list[str] = []  # the first failures, printed: their trials' logs stay under out/trials
    groups = args.rollouts // args.group
    with RolloutPool(factory, out, workers=args.rollouts) as pool:
        started = time.time()
        for g in range(groups):
            pool.launch(tasks[g % len(tasks)], args.group, f"g{g:05d}")
        launched = groups
        for group in pool.as_completed():
            totals["steady"] = totals["steady"] or time.time()
            for record in group.records:
                for name, n in check(record, args.calls, keys, latencies, out / "trials", args.generation_s).items():
                    totals[name] += n
                totals["rollouts"] += 1
                if record.status == "ok" and record.outcome.env_reward == 1.0:  # a failed trial keeps its logs
                    shutil.rmtree(out / "trials" / record.episode_id, ignore_errors=True)  # disk: a run keeps them
                elif len(reasons) < 20:
                    reasons.append(f"{record.episode_id} {record.status}: {record.reason} "
                                   f"(agent exit {record.agent_exit})")
            if args.minutes and time.time() - started < args.minutes * 60:
                pool.launch(tasks[launched % len(tasks)], args.group, f"g{launched:05d}")
                launched, totals["kept"] = launched + 1, time.time()
        elapsed = time.time() - started
    for line in reasons:
        print(f"failed: {line} (logs under {out / 'trials'})", file=sys.stderr)
    return totals, latencies, elapsed


def start_stub(generation_s: float, log: Path, capacity: int | None = None) -> ManagedProcess:
    port = free_port()
    argv = [sys.executable, str(HERE / "stub_engine.py"), str(port), str(generation_s)] + ([str(capacity)] if capacity
                                                                                          else [])
    stub = ManagedProcess("stub engine", argv,
                          env={"PATH": "/usr/bin:/bin"}, log_path=log, health_url=f"http://127.0.0.1:{port}/health")
    stub.start(60)
    stub.url = f"http://127.0.0.1:{port}"
    return stub


def report(args, totals: dict, latencies: list[float], elapsed: float, sampler: Sampler, cpu: dict) -> dict:
    samples = sampler.samples
    peak = {part: max(s["rss"][part] for s in samples) / 2 ** 20 for part in samples[0]["rss"]}  # PSS, MB
    lat = sorted(latencies) or [float("nan")]
    # Growth from the first minute of the steady state (the first wave has ended: rollouts finish as others
    # start, traces are fetched and verified) to its last minute (the last launch; then the run winds down).
    # Before that the first wave is only growing its conversations and nothing has ended: a first minute taken
    # there counts the ramp as growth.
    # --settle-minutes: the pool's PSS climbs for minutes after the first group is collected while finished
    # rollouts wait for their groups' stragglers (a plateau, not growth); the window may start after it.
    since, until = totals.pop("steady") + args.settle_minutes * 60, totals.pop("kept") or float("inf")
    steady = [s for s in samples if since <= s["t"] <= until] or samples
    first = [s for s in steady if s["t"] - steady[0]["t"] < 60]
    last = [s for s in steady if steady[-1]["t"] - s["t"] < 60]
    total = lambda ss: statistics.mean(sum(s["rss"].values()) for s in ss) / 2 ** 20  # noqa: E731
    n = max(1, totals["rollouts"])
    result = {
        "rollouts": totals["rollouts"], "in_flight": args.rollouts, "minutes": elapsed / 60,
        "rollouts_per_min": totals["rollouts"] / (elapsed / 60), "calls": len(latencies),
        "added_p50_ms": lat[len(lat) // 2] * 1e3, "added_p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3,
        "peak_pss_mb": peak, "peak_pss_per_rollout_mb": {k: v / args.rollouts for k, v in peak.items()},
        "cpu_s_per_rollout": {k: v / n for k, v in cpu.items()}, "cpu_s": cpu,
        "peak_threads": max(s["threads"] for s in samples), "peak_fds_pool": max(s["fds_pool"] for s in samples),
        "peak_fds_proxy": max(s["fds_proxy"] for s in samples), "peak_jails": max(s["bwrap"] for s in samples),
        "pss_first_minute_mb": total(first), "pss_last_minute_mb": total(last), **totals}
    result["memory_growth"] = result["pss_last_minute_mb"] / result["pss_first_minute_mb"] - 1
    result["settle_minutes"] = args.settle_minutes
    part = lambda ss, name: statistics.mean(s["rss"][name] for s in ss)  # noqa: E731
    result["memory_growth_by_part"] = {name: part(last, name) / part(first, name) - 1 if part(first, name) else None
                                       for name in samples[0]["rss"]}  # None: a part this run has none of
    minutes = {}  # the whole run, ramp included: PSS by part, each minute's mean (MB)
    for s in samples:
        minutes.setdefault(int((s["t"] - samples[0]["t"]) // 60), []).append(s)
    result["pss_by_minute_mb"] = {m: {name: round(part(ss, name) / 2 ** 20) for name in ss[0]["rss"]}
                                  for m, ss in minutes.items()}
    return result


def leftovers(pid: int, out: Path) -> dict:
    """What run `pid` (its files under `out`) left: containers, bridge folders, jails and forwarders."""
    listed = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={LABEL}={pid}"], capture_output=True,
                            text=True).stdout.split() if shutil.which("docker") else []
    folders = list(Path(tempfile.gettempdir()).glob(f"harness-trial-{pid}-*"))
    processes = 0
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        processes += process.pid != os.getpid() and (f"--watch {pid}" in line or f"{out}/run/" in line)
    return {"containers": len(listed), "bridge_folders": len(folders), "jails_and_forwarders": processes}


def killed_run(args, argv: list[str]) -> dict:
    """The run as a child, SIGKILLed after args.sigkill_after seconds; then what it left, until nothing is."""
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    child = subprocess.Popen([sys.executable, __file__, *argv, "--out", str(out)], stdout=subprocess.DEVNULL)
    time.sleep(args.sigkill_after)
    child.kill()
    child.wait()
    killed, seen = time.time(), []  # (seconds since the kill, what was left then)
    while (left := leftovers(child.pid, out)) and any(left.values()) and time.time() - killed < 180:
        seen.append((round(time.time() - killed, 1), left))
        time.sleep(1)
    return {"killed_after_s": args.sigkill_after, "in_flight_at_kill": seen[0][1] if seen else left,
            "left_after": left, "seconds_to_nothing": round(time.time() - killed, 1),
            "last_seen_s_by_part": {part: max((t for t, was in seen if was[part]), default=0.0) for part in left}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=1024, help="in flight at once")
    parser.add_argument("--group", type=int, default=16, help="rollouts per group (G)")
    parser.add_argument("--calls", type=int, default=8, help="model calls per rollout")
    parser.add_argument("--final-kb", type=int, default=200, help="the conversation's size at the last call")
    parser.add_argument("--generation-s", type=float, default=2.0, help="the stub engine's time per answer")
    parser.add_argument("--minutes", type=float, default=0, help="keep the rollouts in flight this long")
    parser.add_argument("--settle-minutes", type=float, default=0,
                        help="memory growth measured from this long after the first group is collected")
    parser.add_argument("--no-journal", action="store_true", help="the proxy without its journal")
    parser.add_argument("--out", type=Path, default=None, help="where the run's files go (a temporary folder)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--sandbox", choices=("local", "docker"), default="local", help="bubblewrap or containers")
    parser.add_argument("--sigkill-after", type=float, default=0, help="SIGKILL the run this many seconds in")
    args = parser.parse_args()
    if args.sigkill_after:
        at = sys.argv.index("--sigkill-after")
        argv = sys.argv[1:at] + sys.argv[at + 2:]
        print(json.dumps(killed_run(args, argv), indent=1))
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    tasks = make_tasks(out / "tasks", 64)
    python = Path(sys.base_prefix) / "bin" / "python3"
    harness = CommandHarness(f"{python} -S -I /app/scripted_agent.py {args.calls} {args.final_kb} /app/answer.txt "
                             "{instruction}")
    stub = start_stub(args.generation_s, out / "stub.log")
    try:
        with ProxyServer(stub.url, model="tiny", journal=None if args.no_journal else out / "journal",
                         log_path=out / "proxy.log", startup_timeout_s=60) as proxy:
            factory = LocalSessionFactory(None, proxy=proxy.client, harness=harness, output_dir=out / "run",
                                          step_limit=args.calls, max_model_calls=args.calls + 4,
                                          sandbox=args.sandbox)
            sampler = Sampler(proxy.managed.process.pid, stub.process.pid)
            totals, latencies, elapsed = run(args, tasks, factory, out / "run")
            result = report(args, totals, latencies, elapsed, sampler, sampler.stop())
    finally:
        stub.stop()
    result["left_after_end"] = leftovers(os.getpid(), out)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
