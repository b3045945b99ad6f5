"""The GPU path, checked end to end on one device in minutes: each check's pass/fail and time, as a table.

    python bench/device_check.py              # on a GPU host (one H100/H200: about 6 minutes)
    python bench/device_check.py --dry-run    # the same script on the CPU: the tiny model, reload for the GPU syncs
    python bench/device_check.py --plan       # print the checks and exit

The checks (each a real `harness-train` run in its own process, so one failing does not stop the others):

    tree          the trainer's step on the prefix tree (tree-attention kernels on the GPU) against naive rows,
                  float32 and bfloat16 (bench/gpu_check.py), on Qwen2.5-0.5B's shape
    grpo-ipc      2 GRPO steps, engine and trainer colocated on GPU 0 (the engine held to its memory share),
                  weights by CUDA IPC; then the probe (vLLM's logprobs = the trainer's) after each sync
    grpo-nccl     the same by NCCL: engine and trainer on two GPUs, or, with one, both on GPU 0 in two
                  processes (NCCL may refuse two ranks on one device: then the check says so)
    lora          2 GRPO steps with a LoRA adapter hot-loaded into GPU vLLM by name (its punica kernels)

The model: the embedded tokenizer with Qwen2.5-0.5B's layers (24 x 896, 14 heads, 2 KV heads), random weights,
built by harness_trainer.models.tiny; the task: the white-box MultiEnv example (no agent, no sandbox), so what is
measured is the engine, the syncs and the trainer. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

SHAPE_05B = dict(layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864)
EXAMPLE = "harness_trainer.examples.multi_env:"


def checks(gpus: int, dry_run: bool) -> list[tuple[str, list[str], str]]:
    """(name, extra `harness-train` flags, what it stands for) per GRPO check; the tree check is in-process."""
    if dry_run:  # the CPU has no CUDA IPC or NCCL: the reload sync stands in, the rest of the path is the same
        return [("grpo-ipc", ["--weight-sync-backend", "reload"], "reload stands in for ipc (no CUDA)"),
                ("grpo-nccl", ["--weight-sync-backend", "reload"], "reload stands in for nccl (no CUDA)"),
                ("lora", ["--use-peft"], "")]
    nccl = ["--engine-gpus", "0", "--trainer-gpus", "1"] if gpus > 1 else \
        ["--engine-gpus", "0", "--trainer-gpus", "0", "--weight-sync-backend", "nccl"]
    return [("grpo-ipc", ["--engine-gpus", "0", "--trainer-gpus", "0", "--weight-sync-backend", "ipc"], ""),
            ("grpo-nccl", nccl, "two GPUs" if gpus > 1 else "one GPU, two processes"),
            ("lora", ["--engine-gpus", "0", "--trainer-gpus", "0", "--use-peft"], "")]


def run_grpo(name: str, flags: list[str], model: Path, out: Path, timeout_s: float) -> tuple[bool, str]:
    """Two steps through the CLI; passes when both are logged, synced (version 3) and probed within tolerance."""
    command = [sys.executable, "-m", "harness_trainer.commands.cli", "--model", str(model),
               "--environment", EXAMPLE + "MultiEnv", "--reward-funcs", f"{EXAMPLE}wordle_reward,{EXAMPLE}echo_reward",
               "--dataset", str(ROOT / "harness_trainer" / "examples" / "multi_env.jsonl"),
               "--max-steps", "2", "--num-generations", "4", "--max-concurrent-rollouts", "4", "--save-steps", "2",
               "--max-completion-tokens", "32", "--report-to", "none", "--output-dir", str(out / name), *flags]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout_s:.0f} s"
    (out / f"{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        last = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
        if "Duplicate GPU" in done.stderr or "same device" in done.stderr.lower():
            return False, "NCCL refuses two ranks on one GPU: needs a second GPU"
        return False, f"exit {done.returncode}: {last[0][:200]}"
    steps = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    gaps = [s.get("probe_gap") for s in steps]
    syncs = [s.get("weight_sync_time_s") for s in steps]
    ok = len(steps) == 2 and steps[-1]["version"] == 3 and all(g is not None for g in gaps)
    return ok, (f"probe gap {max(g for g in gaps if g is not None):.1e}, sync {max(syncs):.2f} s"
                if ok else f"steps {len(steps)}, versions {[s['version'] for s in steps]}")


def run_tree(dry_run: bool) -> tuple[bool, str]:
    import io
    from contextlib import redirect_stdout

    import gpu_check

    buffer = io.StringIO()
    with redirect_stdout(buffer):
        ok = gpu_check.main(["--device", "cpu" if dry_run else "cuda", "--models", "tiny" if dry_run else "qwen2-0.5b",
                             "--generations", "4" if dry_run else "8"]) == 0
    rows = [line for line in buffer.getvalue().splitlines() if line.startswith("| ") and "model |" not in line]
    return ok, "; ".join(" ".join(r.split("|")[2].split()) + ": cosine " + r.split("|")[7].strip() for r in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, the tiny model, reload for ipc/nccl")
    parser.add_argument("--plan", action="store_true", help="print the checks and exit")
    parser.add_argument("--output-dir", default="runs/device-check")
    parser.add_argument("--check-timeout", type=float, default=200.0, help="seconds per GRPO check")
    parser.add_argument("--only", default=None, help="comma-separated check names")
    args = parser.parse_args(argv)

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus and not args.dry_run and not args.plan:
        print("device_check: no CUDA device here; run with --dry-run for the CPU rehearsal", file=sys.stderr)
        return 2
    planned = [("tree", [], "tree vs naive rows")] + checks(gpus, args.dry_run)
    wanted = set(args.only.split(",")) if args.only else {name for name, _, _ in planned}
    if args.plan:
        for name, flags, note in planned:
            print(f"{name:10} {' '.join(flags) or '(in process)'}  {note}")
        return 0
    from harness_trainer.models.tiny import TinyModelSpec, ensure_tiny_model

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    device = torch.cuda.get_device_name() if gpus else "CPU (dry run)"
    model = ensure_tiny_model(TinyModelSpec() if args.dry_run else TinyModelSpec(**SHAPE_05B))
    print(f"device: {device} x {max(gpus, 1)}, torch {torch.__version__}, model {model.name} "
          f"(built in {time.perf_counter() - started:.0f} s)", flush=True)
    print("| check | result | time | detail |\n|---|---|---|---|", flush=True)
    results = []
    for name, flags, note in planned:
        if name not in wanted:
            continue
        began = time.perf_counter()
        try:
            ok, detail = run_tree(args.dry_run) if name == "tree" else \
                run_grpo(name, flags, model, out, args.check_timeout)
        except Exception as exc:  # a check that crashes is a failed check, the others still run
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        results.append(ok)
        print(f"| {name} | {'pass' if ok else 'FAIL'} | {time.perf_counter() - began:.0f} s | "
              f"{detail}{' (' + note + ')' if note else ''} |", flush=True)
    print(f"total {time.perf_counter() - started:.0f} s; logs in {out}")
    return 0 if all(results) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
