"""One training step at real model size on one GPU: a randomly initialised Qwen2-1.5B-shaped model in bfloat16
with gradient checkpointing, on G = 8 rollouts of 32k tokens each (a 12k shared prompt, then 40 turns of 100
sampled and 400 tool tokens), through the trainer's own path (packing.pack -> tree_forward.tree_backward in
micro-batches -> AdamW). First the exactness of that path against naive rows on a small case (bench/gpu_check.py,
float32 and bfloat16), then the step: peak memory, time, tokens.

    python bench/gpu_scale.py                       # on the GPU: the real sizes
    python bench/gpu_scale.py --shape tiny --scale 0.05 --device cpu     # the same script, small, on CPU

Exit status 1 if a check fails. Needs torch + transformers only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import gpu_check  # noqa: E402
from scale import group  # noqa: E402

from harness_trainer.training.grpo import LossConfig, policy_loss  # noqa: E402
from harness_trainer.training.packing import chains_from_trace, pack  # noqa: E402
from harness_trainer.training.tree_forward import plan_ranges, tree_backward  # noqa: E402

SHAPES = {
    "qwen2-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2),
    "tiny": gpu_check.CONFIGS["tiny"],
}


def scale_step(shape: str, scale: float, budget: int, device: torch.device, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=65536, tie_word_embeddings=False)
    with device:
        model = Qwen2ForCausalLM(config).to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    # 40 turns of 500 tokens after a 12k prompt: 32k tokens a rollout at scale 1
    traces = group(scale, vocab=config.vocab_size, turns=max(1, round(40 * scale)))
    seen: set = set()
    chains = [c for i, t in enumerate(traces) for c in chains_from_trace(t, i, seen)]
    tree = pack(chains)
    total = int(tree.trained.sum())
    behaviour = tree.behaviour[tree.trained].to(device)
    adv = torch.tensor([0.5, -0.5] * 4, device=device)[tree.rollout[tree.trained].to(device)]

    def loss_fn(logp, index):
        return policy_loss(logp, behaviour[index], adv[index], LossConfig(), total, proximal=logp.detach())[0]

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    logp, _ = tree_backward(model, tree, loss_fn, max_tokens=budget)
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters()) and bool(torch.isfinite(logp).all())
    return {"params_b": sum(p.numel() for p in model.parameters()) / 1e9, "rollout_tokens": len(chains[0].ids),
            "unique": len(tree), "rows": tree.chain_tokens, "trained": total,
            "microbatches": len(plan_ranges(tree, budget)), "seconds": seconds, "peak_gib": peak, "ok": finite}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="qwen2-1.5b", choices=SHAPES)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the 12k prompt and 40 turns")
    parser.add_argument("--budget", type=int, default=32_768, help="max tokens per micro-batch")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--skip-exactness", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    ok = True
    if not args.skip_exactness:
        print("exactness against naive rows (one causal row per chain):")
        ok = gpu_check.main(["--device", args.device, "--models", "tiny" if args.shape == "tiny" else
                             "tiny,qwen2-0.5b"]) == 0
    r = scale_step(args.shape, args.scale, args.budget, device, getattr(torch, args.dtype))
    print(f"\n| model | dtype | rollouts x tokens | unique tokens (rows) | trained | micro-batches | step time | "
          f"peak GPU memory | check |\n|---|---|---|---|---|---|---|---|---|\n"
          f"| {args.shape} ({r['params_b']:.2f}B) | {args.dtype} | 8 x {r['rollout_tokens']:,} | {r['unique']:,} "
          f"({r['rows']:,}) | {r['trained']:,} | {r['microbatches']} x <= {args.budget:,} | {r['seconds']:.1f} s | "
          f"{r['peak_gib']:.1f} GiB | {'ok' if r['ok'] else 'FAILED'} |")
    return 0 if ok and r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
