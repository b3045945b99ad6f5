"""The FSDP2 step as its input doubles: one process against two sharded ranks, side by side, on the CPU (gloo).

    .venv/bin/python bench/fsdp.py [--scales 0.125 0.25]

One trainer step (`trainer.policy.step`: pack, micro-batched tree forward/backward, the trust region's measuring
forward,
AdamW) on a G = 8 group shaped like opencode's (bench/scale.py: a shared prompt, then turns of 100 sampled and 400
tool tokens), at each scale and twice that, for: `one` (a single process) and `fsdp` (2 ranks under torchrun,
`--distributed fsdp`, each packing half the rollouts). Printed: unique tokens, step time, peak RSS per rank, and
each figure's ratio when the input doubles (linear: ~2x time, memory growing by the activations only).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STEP = textwrap.dedent("""
    import json, resource, sys, time
    sys.path[:0] = [sys.argv[4], sys.argv[4] + "/bench"]
    import torch
    from scale import group
    from harness_trainer.models.tiny import ensure_tiny_model
    from harness_trainer.rollouts.session import HarnessRolloutOutcome, RolloutRecord
    from harness_trainer.rollouts.tasks import Task
    from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

    scale, distributed, out = float(sys.argv[1]), sys.argv[2], sys.argv[3]
    traces = group(scale)
    records = [RolloutRecord("t", f"e{i}", HarnessRolloutOutcome(float(i % 2), [], [], 0, 0, {}, False), "ok",
                             training_trace={"turns": [vars(t) for t in trace.turns]}, policy_versions=[0])
               for i, trace in enumerate(traces)]
    trainer = HarnessAsyncGRPOTrainer(str(ensure_tiny_model()), lambda sampling: None, AsyncGRPOConfig(
        output_dir=out, distributed=distributed, max_tokens_per_microbatch=8192), [Task.__new__(Task)])
    started = time.perf_counter()
    metrics = trainer.policy.step(trainer.score([records]), 0)
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    with open(f"{out}/rank{trainer.rank}.json", "w") as f:
        json.dump({"seconds": seconds, "rss_gib": rss, "tree_tokens": metrics.get("tree_tokens", 0)}, f)
    if trainer.world_size > 1:
        from harness_trainer.training.distributed import end_process

        end_process(0)  # a rank ends here, not in the interpreter's finalization (training/distributed.py)
""")


def run(script: Path, scale: float, mode: str) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"fsdp-{mode}-"))
    ranks = 2 if mode == "fsdp" else 1
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"] if ranks > 1 else \
        [sys.executable]
    subprocess.run([*launcher, str(script), str(scale), "fsdp" if ranks > 1 else "ddp", str(out), str(ROOT)],
                   check=True, cwd=ROOT, capture_output=True)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    return {"seconds": max(r["seconds"] for r in results), "rss_gib": max(r["rss_gib"] for r in results),
            "tokens": sum(r["tree_tokens"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scales", type=float, nargs="+", default=[0.125, 0.25])
    args = parser.parse_args()
    script = Path(tempfile.mkdtemp()) / "step.py"
    script.write_text(STEP)
    print("| scale | path | tree tokens (all ranks) | step time | peak RSS (largest rank) |\n|---|---|---|---|---|")
    rows: dict = {}
    for scale in args.scales:
        for mode in ("one", "fsdp"):
            r = rows[scale, mode] = run(script, scale, mode)
            print(f"| {scale} | {mode} | {r['tokens']:,} | {r['seconds']:.1f} s | {r['rss_gib']:.2f} GiB |", flush=True)
    for small, large in zip(args.scales, args.scales[1:]):
        for mode in ("one", "fsdp"):
            a, b = rows[small, mode], rows[large, mode]
            print(f"{mode}: x{large / small:g} input -> tokens x{b['tokens'] / max(a['tokens'], 1):.2f}, time "
                  f"x{b['seconds'] / a['seconds']:.2f}, peak RSS x{b['rss_gib'] / a['rss_gib']:.2f}")


if __name__ == "__main__":
    main()
