"""How the run viewer's data side grows with the run: the index over many rollouts, one rollout with a long trace.

Writes synthetic run folders in the real formats (rollouts.jsonl records as rollouts/records.py's record_line writes
them,
traces.jsonl as OpenEnv TrainingTraces, each turn's prompt = the previous turn's prompt + completion + a tool
answer, as an agent's history grows) and measures, side by side in one run:

  index    RunFolder() over N and 2N rollouts: time, Python memory at the peak and held afterwards
  rollout  one rollout whose context reaches L and 2L tokens: time to open it (its turns' graph), time for one
           piece of tokens, and what the page receives (bytes), which must not grow with L

    python bench/viewer.py [--rollouts 500] [--turns 8] [--context 4000] [--long 50000]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness_trainer.commands.viewer.runs import Decoder, RunFolder  # noqa: E402


def _trace(episode: str, turns: int, context: int, rng: random.Random) -> dict:
    step = max(1, context // turns)
    sampled = max(1, step // 4)
    prompt, out = [rng.randrange(4096) for _ in range(step - sampled)], []
    for k in range(turns):
        completion = [rng.randrange(4096) for _ in range(sampled)]
        out.append({"node_id": f"{episode}:{k}", "prompt_token_ids": list(prompt), "completion_token_ids": completion,
                    "per_token_logps": [round(-rng.random() * 5, 4) for _ in completion],
                    "loss_mask": [0] * len(prompt) + [1] * len(completion), "request": {}, "response": {},
                    "metadata": {"index": k, "policy_version": k // 3, "episode_id": episode}})
        prompt = prompt + completion + [rng.randrange(4096) for _ in range(step - sampled)]
    return {"schema_version": 1, "turns": out}


def write_run(folder: Path, rollouts: int, turns: int, context: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    with (folder / "rollouts.jsonl").open("w") as records, (folder / "traces.jsonl").open("w") as traces:
        for n in range(rollouts):
            episode = f"s{n}-v0-task-{n % 37}-{n % 8}"
            trace = _trace(episode, turns, context, rng)
            traces.write(json.dumps(trace, separators=(",", ":")) + "\n")
            messages = [{"role": "user", "content": "word " * (context // turns)} for _ in range(turns)]
            records.write(json.dumps({
                "task": f"task-{n % 37}", "episode_id": episode, "status": "ok", "reason": "",
                "outcome": {"env_reward": float(n % 2), "completion": messages, "tool_call_count": turns,
                            "tool_failure_count": 0, "tool_calls_by_name": {"bash": turns}, "timed_out": False},
                "invalid_tool_calls": 0, "seconds": 1.0, "policy_versions": [0], "turns": turns,
                "sampled_tokens": sum(len(t["completion_token_ids"]) for t in trace["turns"]), "calls": []}) + "\n")
    return folder


def measure_index(folder: Path) -> dict:
    seconds = []
    for _ in range(2):  # the best of two (the files are fresh in the page cache either way)
        t = time.perf_counter()
        RunFolder(folder, Decoder(None))
        seconds.append(time.perf_counter() - t)
    tracemalloc.start()  # memory apart from time: tracing slows Python down
    run = RunFolder(folder, Decoder(None))
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    seconds = min(seconds)
    size = sum((folder / name).stat().st_size for name in ("rollouts.jsonl", "traces.jsonl"))
    return {"rows": len(run.rows), "MB on disk": size / 2**20, "index s": seconds, "peak MiB": peak / 2**20,
            "held MiB": held / 2**20}


def measure_rollout(folder: Path) -> dict:
    run = RunFolder(folder, Decoder(None))
    opened = []
    for _ in range(3):  # the best of three, each from disk (the parsed trace is cached: dropped first)
        run._traces.clear()
        t = time.perf_counter()
        doc = run.rollout(0)
        opened.append(time.perf_counter() - t)
    opened = min(opened)
    last = doc["turns"][-1]
    times = []
    for _ in range(5):  # a whole piece (the first) of the last turn; the median of five
        t = time.perf_counter()
        piece = run.tokens(0, last["j"], 0)
        times.append(time.perf_counter() - t)
    tokens = sorted(times)[2]
    return {"context tokens": last["prompt_tokens"] + last["completion_tokens"], "open s": opened,
            "rollout KB": len(json.dumps(doc)) / 1024, "piece s": tokens, "piece KB": len(json.dumps(piece)) / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=500, help="N: rollouts in the smaller index run")
    parser.add_argument("--turns", type=int, default=8, help="turns per rollout")
    parser.add_argument("--context", type=int, default=4000, help="final context tokens of each indexed rollout")
    parser.add_argument("--long", type=int, default=50000, help="L: final context of the long rollout")
    parser.add_argument("--long-turns", type=int, default=30, help="turns of the long rollout")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = []
        for n in (args.rollouts, 2 * args.rollouts):
            rows.append(measure_index(write_run(root / f"index-{n}", n, args.turns, args.context)))
        print(f"index: {args.turns} turns of up to {args.context} tokens per rollout")
        for r in rows:
            print("  " + "  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
        print("  x2 rollouts -> " +
              "  ".join(f"{k} x{rows[1][k] / rows[0][k]:.2f}" for k in ("index s", "peak MiB", "held MiB")))
        longs = []
        for length in (args.long, 2 * args.long):
            longs.append(measure_rollout(write_run(root / f"long-{length}", 1, args.long_turns, length)))
        print(f"one rollout of {args.long_turns} turns")
        for r in longs:
            print("  " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
        print("  x2 context -> " + "  ".join(f"{k} x{longs[1][k] / longs[0][k]:.2f}"
                                             for k in ("open s", "rollout KB", "piece s", "piece KB")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
