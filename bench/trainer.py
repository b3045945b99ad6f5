"""Trainer benchmark on captured multi-turn traces (mini-swe-agent, oracle policy, groups of G rollouts per
task, through the real proxy), side by side in one run:

  * tokens run through the model ÷ unique tokens: prefix-shared packing vs one row per chain/fork (TRL's
    scheme: every fork re-feeds its whole context; every rollout of a group re-feeds the shared prompt)
  * step time (pack + mask + forward + backward of the tree) ÷ a raw forward+backward of a plain causal
    sequence of the same number of tokens

    .venv/bin/python bench/trainer.py [--traces FILE --group G] [--vllm-url URL]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from harness_trainer.traces.files import read_traces
from harness_trainer.training.grpo import LossConfig, policy_loss
from harness_trainer.training.packing import chains_from_trace, pack
from harness_trainer.training.tree_forward import tree_logprobs


def collect(args) -> str:
    from harness_trainer.commands.evaluate import EvalConfig, evaluate

    out = tempfile.mkdtemp(prefix="bench-trainer-")
    evaluate(EvalConfig(dataset="builtin:bugfix", policy="oracle", num_generations=args.group,
                        max_concurrent_rollouts=4,
                        vllm_url=args.vllm_url, output_dir=out))
    return f"{out}/traces.jsonl"


def async_vs_sync(engine_url: str, steps: int = 8) -> None:
    """Rollouts per minute while training, one group in flight (sync: rollouts wait for each step) vs three."""
    import shlex
    import sys
    from functools import partial
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_trainer import SAY, say_task  # the few-line agent program and its task

    from harness_trainer.agents.command import CommandHarness
    from harness_trainer.models.tiny import ensure_tiny_model
    from harness_trainer.proxy.client import ProxyServer
    from harness_trainer.rollouts.session import LocalSessionFactory
    from harness_trainer.rollouts.tasks import load_task
    from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

    root = Path(tempfile.mkdtemp(prefix="bench-async-"))
    task = load_task(say_task(root))
    rates = {}
    with ProxyServer(engine_url, model="tiny") as proxy:
        for name, in_flight in (("sync", 1), ("async", 3)):
            factory = partial(LocalSessionFactory, proxy=proxy.client, harness=CommandHarness(
                f"python3 -c {shlex.quote(SAY)} {{instruction}}"), output_dir=root / name)
            trainer = HarnessAsyncGRPOTrainer(str(ensure_tiny_model()), factory, AsyncGRPOConfig(
                output_dir=str(root / name / "run"), vllm_server_base_url=engine_url, num_generations=8,
                max_concurrent_rollouts=8 * in_flight, max_staleness=in_flight, max_steps=steps, save_steps=1000,
                learning_rate=1e-4), [task])
            started = time.perf_counter()
            history = trainer.train()
            rollouts = sum(h.get("rollouts", 0) for h in history)
            rates[name] = rollouts / ((time.perf_counter() - started) / 60)
    print(f"rollouts/min while training: sync (1 group in flight) {rates['sync']:.0f}, async (3 groups) "
          f"{rates['async']:.0f}: {rates['async'] / rates['sync']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default=None, help="a traces.jsonl (default: collect with the oracle)")
    parser.add_argument("--group", type=int, default=4, help="rollouts per task (G)")
    parser.add_argument("--vllm-url", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    traces = read_traces(args.traces or collect(args))

    from transformers import AutoModelForCausalLM

    from harness_trainer.models.tiny import ensure_tiny_model

    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), attn_implementation="eager")
    # a step = one group: G consecutive traces (they share system prompt and task)
    groups = [traces[i:i + args.group] for i in range(0, len(traces), args.group)]
    fed_tree, fed_rows, tree_times, raw_times = 0, 0, [], []
    for group in groups:
        seen: set = set()
        chains = [c for i, t in enumerate(group) for c in chains_from_trace(t, i, seen)]
        tree = pack(chains)
        fed_tree += len(tree)
        fed_rows += tree.chain_tokens
        total = int(tree.trained.sum())
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            tree = pack(chains)
            logp = tree_logprobs(model, tree)
            loss, _ = policy_loss(logp, tree.behaviour[tree.trained], torch.ones_like(logp),
                                  LossConfig(ratio_to="behaviour"),
                                  total_tokens=total)
            loss.backward()
            tree_times.append(time.perf_counter() - t0)
            model.zero_grad()
            t0 = time.perf_counter()
            out = model(input_ids=tree.ids[None]).logits
            out.float().logsumexp(-1).mean().backward()
            raw_times.append(time.perf_counter() - t0)
            model.zero_grad()
    unique = fed_tree  # the trie holds each distinct (prefix, token) once: the unique tokens
    print(f"{len(traces)} traces in {len(groups)} groups of {args.group}; unique tokens {unique}")
    print(f"tokens fed ÷ unique: prefix-shared {fed_tree / unique:.2f}, one row per chain {fed_rows / unique:.2f}")
    if args.vllm_url:
        async_vs_sync(args.vllm_url)
    print(f"step time ÷ raw forward+backward on the same tokens: "
          f"{statistics.median(tree_times) / statistics.median(raw_times):.2f} "
          f"(median {statistics.median(tree_times) * 1e3:.0f} ms vs {statistics.median(raw_times) * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
