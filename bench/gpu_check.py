"""The trainer's step on a GPU: prefix-shared packing against naive one-row-per-chain rows, on CUDA.

    python bench/gpu_check.py [--device cuda] [--models tiny,qwen2-0.5b]

For each model config (randomly initialised: no hub here) and dtype it builds one GRPO group of G multi-turn
rollouts that share a system prompt and task, then computes the policy loss and its gradients both ways:

    tree   packing.pack -> tree_forward.tree_logprobs  (the tree in depth-first order, tree attention, positions =
    depth)
    naive  rows.chain_logprobs per chain     (one causal row per chain)

and checks they agree (fp32: to rounding; bf16: cosine of the gradients), then takes one AdamW step on the
tree loss. Prints tokens fed, time and peak memory of both paths, side by side. Needs torch + transformers only.
Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from types import SimpleNamespace

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from harness_trainer.training.grpo import LossConfig, policy_loss
from harness_trainer.training.packing import chain_logprobs, chains_from_trace, pack
from harness_trainer.training.tree_forward import tree_logprobs

CONFIGS = {  # the embedded default's shape, and Qwen2.5-0.5B's
    "tiny": dict(vocab_size=4160, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1),
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2),
}
RUNS = [("tiny", torch.float32), ("qwen2-0.5b", torch.float32), ("qwen2-0.5b", torch.bfloat16)]
# agreement required of tree vs naive: max |logprob difference|, |loss difference| / |loss|, and the cosine of
# the flattened gradients (bf16 carries ~3 significant digits: a logprob near -12 is rounded to 1/16)
TOLERANCE = {torch.float32: (1e-3, 1e-4, 0.9999), torch.bfloat16: (0.5, 3e-2, 0.99)}


def group(vocab: int, g: int, rng: random.Random, system: int = 600, task: int = 40, turns: int = 3):
    """G rollouts as traces (duck-typed TrainingTraces): shared system + task, then per turn a completion and
    a tool output of random lengths. Every completion token is trained (loss mask 1)."""
    tokens = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    shared = tokens(system) + tokens(task)
    traces = []
    for r in range(g):
        context, trace = list(shared), []
        for k in range(turns):
            completion = tokens(rng.randint(40, 120))
            trace.append(SimpleNamespace(
                node_id=f"r{r}:{k}", prompt_token_ids=list(context), completion_token_ids=completion,
                loss_mask=[0] * len(context) + [1] * len(completion), per_token_logps=[0.0] * len(completion),
                metadata={"policy_version": 0}))
            context += completion + tokens(rng.randint(30, 80))
        traces.append(SimpleNamespace(turns=trace))
    return traces


def timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return out, time.perf_counter() - start, peak


def check(name: str, dtype: torch.dtype, device: torch.device, g: int, seed: int = 0) -> bool:
    torch.manual_seed(seed)
    config = Qwen2Config(**CONFIGS[name], max_position_embeddings=4096, tie_word_embeddings=False)
    with device:
        model = Qwen2ForCausalLM(config).to(dtype)
    params = [p for p in model.parameters()]
    rng = random.Random(seed)
    traces = group(config.vocab_size, g, rng)
    seen: set = set()
    chains = [c for i, t in enumerate(traces) for c in chains_from_trace(t, i, seen)]
    advantages = [rng.choice([-1, 1]) * rng.uniform(0.2, 1.0) for _ in traces]  # every rollout has a gradient
    total = sum(sum(c.trained) for c in chains)
    cfg = LossConfig(ratio_to="behaviour")
    with torch.no_grad():  # behaviour logprobs near the policy's (ratios 0.7..1.4: both sides of the clip)
        per_chain = [chain_logprobs(model, c).float() for c in chains]
        naive_logp = torch.cat([lp for lp, c in zip(per_chain, chains) if any(c.trained)])
        for chain, logp in zip(chains, per_chain):
            values = iter(logp.tolist())
            chain.behaviour = [next(values) + rng.uniform(-0.3, 0.3) if t else 0.0 for t in chain.trained]

    def naive():
        model.zero_grad()
        loss = torch.zeros((), device=device)
        for chain in chains:
            logp = chain_logprobs(model, chain)
            behaviour = torch.tensor([b for b, t in zip(chain.behaviour, chain.trained) if t], device=device)
            adv = torch.full((len(logp),), advantages[chain.rollout], device=device)
            loss = loss + policy_loss(logp, behaviour, adv, cfg, total_tokens=total)[0]
        loss.backward()
        return float(loss.detach()), [p.grad.float().clone() for p in params]

    tree = pack(chains)

    def shared():
        model.zero_grad()
        logp = tree_logprobs(model, tree)
        trained = tree.trained
        adv = torch.tensor(advantages, device=device)[tree.rollout[trained].to(device)]
        loss = policy_loss(logp, tree.behaviour[trained].to(device), adv, cfg, total_tokens=total)[0]
        loss.backward()
        return float(loss.detach()), [p.grad.float().clone() for p in params]

    naive(), shared()  # warm-up (kernels, allocator) before timing either
    (loss_n, grads_n), t_n, mem_n = timed(naive, device)
    (loss_t, grads_t), t_t, mem_t = timed(shared, device)
    with torch.no_grad():  # the logprobs themselves, compared as multisets (the two orders differ)
        tree_logp = tree_logprobs(model, tree).float()
        logp_diff = float((tree_logp.sort().values - naive_logp.sort().values).abs().max())
    flat_n, flat_t = (torch.cat([x.double().flatten() for x in g]) for g in (grads_n, grads_t))
    cosine = float(torch.nn.functional.cosine_similarity(flat_n, flat_t, dim=0))
    loss_rel = abs(loss_t - loss_n) / max(abs(loss_n), 1e-12)
    # one AdamW step on the tree loss: every weight finite afterwards, and the loss moved
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    shared()
    optimizer.step()
    finite = all(bool(torch.isfinite(p).all()) for p in params)
    loss_after, _ = shared()
    max_logp_diff, max_loss_rel, min_cosine = TOLERANCE[dtype]
    ok = (logp_diff <= max_logp_diff and loss_rel <= max_loss_rel and cosine >= min_cosine and finite
          and loss_after != loss_t)
    n_params = sum(p.numel() for p in params) / 1e6
    print(f"| {name} ({n_params:.0f}M) | {str(dtype).removeprefix('torch.')} | {total} | {len(tree)} / "
          f"{tree.chain_tokens} = {len(tree) / tree.chain_tokens:.2f} | {logp_diff:.1e} | {loss_rel:.1e} | "
          f"{cosine:.6f} | "
          f"{t_t * 1e3:.0f} / {t_n * 1e3:.0f} ms = {t_t / t_n:.2f} | {mem_t:.2f} / {mem_n:.2f} GiB | "
          f"{'ok' if ok else 'FAILED'} |", flush=True)
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    parser.add_argument("--generations", type=int, default=8, help="rollouts in the group (default: 8)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| model | dtype | trained tokens | tokens fed tree / naive | max logprob diff | loss rel. diff | "
          "grad cosine | "
          "fwd+bwd time tree / naive | peak memory tree / naive | check |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    wanted = args.models.split(",")
    results = []
    for name, dtype in RUNS:
        if name in wanted:
            results.append(check(name, dtype, device, args.generations))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
