"""One training step at the scale of real agent traces: memory and time as the tokens grow, side by side.

    .venv/bin/python bench/scale.py [--sizes 0.25 0.5 1] [--paths tree tree-mb naive dense]

A group of G = 8 rollouts shaped like opencode's: a 12k-token shared system prompt and task, then 32 turns of
100 sampled tokens and a 400-token tool output each (about 140k unique tokens, 225k as one row per chain), at
a fraction of that size (prompt and turns both scaled). One step = forward, backward and an AdamW step of the
embedded tiny model on CPU, each path in its own process (peak RSS is per process):

    tree     packing.pack -> tree_forward.tree_backward, the whole tree as one micro-batch
    tree-mb  the same in micro-batches of --budget tokens (the trainer's max_tokens_per_microbatch)
    naive    one plain causal row per chain through the model's own sdpa attention, logprobs at trained
             positions only, backward chain by chain: the memory-efficient way that shares no prefix
    dense    the previous tree path: an [N, N] mask and eager attention, full-vocabulary logits (it runs out of
             memory early; run under an address-space limit so it fails instead of the machine)

Also: the bookkeeping (chains_from_trace + pack) at 100 and 200 turns against the previous all-pairs parent
search, and the tokens TRL's one-row-per-turn scheme would feed.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness_trainer.training.grpo import LossConfig, policy_loss  # noqa: E402
from harness_trainer.training.packing import _parents, chains_from_trace, pack  # noqa: E402
from harness_trainer.training.tree_forward import chunked_logprobs, tree_backward  # noqa: E402

G, PROMPT, TURNS, COMPLETION, TOOL = 8, 12_000, 32, 100, 400


def group(scale: float, vocab: int = 4096, seed: int = 0, g: int = G, turns: int | None = None):
    """G traces (duck-typed TrainingTraces) sharing a prompt; each turn's prompt extends the previous exactly."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    shared, turns = tokens(int(PROMPT * scale)), turns or max(1, round(TURNS * scale))
    traces = []
    for r in range(g):
        context, trace = list(shared), []
        for k in range(turns):
            completion = tokens(COMPLETION)
            trace.append(SimpleNamespace(
                node_id=f"r{r}:{k}", prompt_token_ids=list(context), completion_token_ids=completion,
                loss_mask=[0] * len(context) + [1] * len(completion),
                per_token_logps=[-1.0] * len(completion), metadata={"policy_version": 0}))
            context += completion + tokens(TOOL)
        traces.append(SimpleNamespace(turns=trace))
    return traces


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def model():
    from transformers import AutoModelForCausalLM

    from harness_trainer.models.tiny import ensure_tiny_model

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32)


def step(path: str, scale: float, budget: int) -> dict:
    """One step on one path; runs in a child process."""
    torch.set_num_threads(torch.get_num_threads())
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    traces = group(scale)
    base = rss_gib()
    started = time.perf_counter()
    seen: set = set()
    chains = [c for i, t in enumerate(traces) for c in chains_from_trace(t, i, seen)]
    total = sum(sum(c.trained) for c in chains)
    adv = torch.tensor([0.5, -0.5] * (G // 2))
    cfg = LossConfig()
    out = {"row_tokens": sum(len(c.ids) for c in chains), "trained": total}
    if path in ("tree", "tree-mb"):
        tree = pack(chains)
        out["tree_tokens"] = len(tree)
        behaviour, rollouts = tree.behaviour[tree.trained], tree.rollout[tree.trained]

        def loss_fn(logp, index):
            return policy_loss(logp, behaviour[index], adv[rollouts[index]], cfg, total, proximal=logp.detach())[0]

        tree_backward(m, tree, loss_fn, max_tokens=budget if path == "tree-mb" else None)
    elif path == "naive":
        m.config._attn_implementation = "sdpa"
        for chain in chains:
            ids = torch.tensor(chain.ids)
            trained = torch.tensor(chain.trained)
            hidden = m.get_decoder()(input_ids=ids[None], use_cache=False).last_hidden_state[0]
            targets = torch.nonzero(trained).squeeze(-1)
            logp = chunked_logprobs(hidden[targets - 1], m.get_output_embeddings(), ids[targets])
            behaviour = torch.tensor(chain.behaviour)[trained]
            a = adv[chain.rollout].expand(len(logp))
            policy_loss(logp, behaviour, a, cfg, total, proximal=logp.detach())[0].backward()
    elif path == "dense":
        resource.setrlimit(resource.RLIMIT_AS, (20 * 2**30, resource.RLIM_INFINITY))
        m.config._attn_implementation = "eager"
        tree = pack(chains)
        out["tree_tokens"] = len(tree)
        try:
            n = len(tree)
            allowed = torch.zeros(n, n, dtype=torch.bool)
            parent = tree.parent.tolist()
            for i in range(n):
                if parent[i] >= 0:
                    allowed[i] = allowed[parent[i]]
                allowed[i, i] = True
            mask = torch.zeros(n, n).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
            del allowed
            logits = m(input_ids=tree.ids[None], position_ids=tree.depth[None], attention_mask=mask).logits[0]
            targets = torch.nonzero(tree.trained).squeeze(-1)
            logp = torch.log_softmax(logits[tree.parent[targets]], -1).gather(-1, tree.ids[targets][:, None])[:, 0]
            rollouts = tree.rollout[tree.trained]
            policy_loss(logp, tree.behaviour[tree.trained], adv[rollouts], cfg, total,
                        proximal=logp.detach())[0].backward()
        except (RuntimeError, MemoryError) as exc:
            return out | {"error": f"out of memory ({str(exc).splitlines()[0][:60]})", "base_gib": base}
    opt.step()
    return out | {"time_s": time.perf_counter() - started, "peak_gib": rss_gib(), "base_gib": base}


def bookkeeping() -> list[str]:
    """chains_from_trace + pack at 100 and 200 turns (one rollout, 2k prompt, 500 tokens a turn), and the
    previous all-pairs parent search on the same turns."""
    def pairwise(turns):
        full = {t.node_id: t.prompt_token_ids + t.completion_token_ids for t in turns}
        for t in turns:
            best = -1
            for other in turns:
                seq = full[other.node_id]
                if other is not t and best < len(seq) <= len(t.prompt_token_ids) \
                        and t.prompt_token_ids[:len(seq)] == seq:
                    best = len(seq)

    lines, times = [], {}
    for turns in (100, 200):
        trace = group(2_000 / PROMPT, g=1, turns=turns)[0]
        started = time.perf_counter()
        _parents(trace.turns)
        parents_s = time.perf_counter() - started
        started = time.perf_counter()
        tree = pack(chains_from_trace(trace, 0))
        ours = time.perf_counter() - started
        started = time.perf_counter()
        pairwise(trace.turns)
        theirs = time.perf_counter() - started
        times[turns] = (parents_s, ours, theirs)
        lines.append(f"| {turns} | {len(tree):,} | {sum(len(t.prompt_token_ids) for t in trace.turns):,} | "
                     f"{parents_s:.2f} s | {ours:.2f} s | {theirs:.2f} s |")
    lines.append(f"200 / 100 turns: parents x{times[200][0] / times[100][0]:.1f}, chains + pack "
                 f"x{times[200][1] / times[100][1]:.1f}, all-pairs parents x{times[200][2] / times[100][2]:.1f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0])
    parser.add_argument("--paths", nargs="+", default=["tree", "tree-mb", "naive", "dense"])
    parser.add_argument("--budget", type=int, default=16_384)
    parser.add_argument("--child", nargs=2, metavar=("PATH", "SCALE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(step(args.child[0], float(args.child[1]), args.budget)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; G = {G}, budget {args.budget:,} tokens\n")
    print("| size | path | unique tokens | tokens fed | peak RSS | step RSS | step RSS / token fed | time |")
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for scale in args.sizes:
        for path in args.paths:
            if path == "dense" and any("error" in r for (p, s), r in results.items() if p == "dense" and s < scale):
                print(f"| {scale:g} | dense | | | | | | not run: out of memory at a smaller size |")
                continue
            run = subprocess.run([sys.executable, __file__, "--child", path, str(scale), "--budget", str(args.budget)],
                                 capture_output=True, text=True)
            try:
                r = json.loads(run.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                r = {"error": f"exit {run.returncode}: {(run.stderr.strip().splitlines() or [''])[-1][:80]}"}
            results[(path, scale)] = r
            fed = r.get("tree_tokens", r.get("row_tokens", 0)) if path != "naive" else r.get("row_tokens", 0)
            if "error" in r:
                print(f"| {scale:g} | {path} | {r.get('tree_tokens', '')} | | | | | {r['error']} |")
                continue
            step_gib = r["peak_gib"] - r["base_gib"]
            print(f"| {scale:g} | {path} | {r.get('tree_tokens', '')} | {fed:,} | {r['peak_gib']:.2f} GiB | "
                  f"{step_gib:.2f} GiB | {step_gib * 2**30 / fed / 1024:.1f} KiB | {r['time_s']:.1f} s |", flush=True)
    print()
    quarter = 0.25 if 0.25 in args.sizes else args.sizes[0]  # the range: 1/4 to the full size
    for path in ("tree", "tree-mb"):
        small, big = results.get((path, quarter)), results.get((path, args.sizes[-1]))
        if small and big and "error" not in small and "error" not in big:
            per = lambda r: (r["peak_gib"] - r["base_gib"]) / r["tree_tokens"]  # noqa: E731
            print(f"{path}: step memory per token, {args.sizes[-1]:g} vs {quarter:g}: x{per(big) / per(small):.2f}")
        naive = results.get(("naive", args.sizes[-1]))
        if big and naive and "error" not in big and "error" not in naive:
            print(f"{path} vs naive rows at size {args.sizes[-1]:g}: time x{big['time_s'] / naive['time_s']:.2f}, "
                  f"peak RSS x{big['peak_gib'] / naive['peak_gib']:.2f}")
    full = group(1.0)
    per_turn = sum(len(t.prompt_token_ids) + len(t.completion_token_ids) for tr in full for t in tr.turns)
    print(f"\nTRL's one row per turn at full size: {per_turn:,} tokens fed")
    print("\n| turns | unique tokens | prompt tokens in the trace | parents | chains + pack (parents included) | "
          "all-pairs parents (before) |\n|---|---|---|---|---|---|")
    print("\n".join(bookkeeping()))


if __name__ == "__main__":
    main()
