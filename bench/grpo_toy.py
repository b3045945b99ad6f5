"""The proof's GRPO stage, offline and fast: same prompts, same trainer step, sampling without agents.

Why: one real GRPO stage of the proof (mini-swe-agent, sandboxes, vLLM) takes ~10 minutes; finding why a
recipe collapses needs many seeds and variants. This loop keeps what decides learning and drops the rest:

    prompts      the first turn's exact prompt ids of real captures (a proof's solver/ and eval-sft/ traces)
    sampling     the model itself, temperature 0.7, 64 tokens, behaviour logprobs recorded as vLLM would
    two turns    as mini-swe-agent's rollouts: the command, its tool output (the exact ids of a captured
                 output of the same kind: empty for a redirection, the echoed text for the slip), then the
                 second call (`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`); a malformed first call ends it
    reward       1 when the first tool call is exactly `echo WORD > FILE` and the second redirects nothing (an
                 `echo COMPLETE... > FILE` overwrites the answer, and the real verifier then scores 0)
    the step     the trainer's own policy.step itself (advantages, packing, loss, schedule, optimizer)
    staleness    a group is trained `--delay` steps after it was sampled (the proof keeps 2 groups in flight)

    python bench/grpo_toy.py --proof runs/demo --seeds 0 1 2 3 4 --variant old --variant new

prints, per variant, the held-out first-command win rate of the SFT model and after GRPO for each seed, the
collapses (held-out win rate or format below the SFT model's by 20 points), and per-step traces with --verbose.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from harness_trainer.rollouts.session import HarnessRolloutOutcome, RolloutRecord
from harness_trainer.rollouts.tasks import Task
from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

TEMPERATURE, MAX_TOKENS, G = 0.7, 64, 8
# name -> AsyncGRPOConfig fields; "old" is the trainer and recipe before issue 12 (no trust region that binds);
# "halving" the trust region before issue 29 (ratio bound, the step halved down to 1/64 and taken there even if
# still outside), "ratio" that bound with today's search, "new" today's defaults (probability bound + search)
OLD = dict(learning_rate=3e-4, behaviour_clip=False, max_step_kl=None, step_clip=None)
VARIANTS = {
    "old": OLD,
    "old-lr1e-4": OLD | dict(learning_rate=1e-4),
    "clip": OLD | dict(behaviour_clip=True),
    "warmup": OLD | dict(warmup_ratio=0.25, lr_scheduler_type="constant_with_warmup"),
    "gps2": OLD | dict(groups_per_step=2),
    "kl": OLD | dict(max_step_kl=0.01),
    "kl+clip": OLD | dict(max_step_kl=0.01, behaviour_clip=True),
    "new": dict(learning_rate=3e-4),  # the trainer's defaults: step_clip 0.2 (probability), behaviour_clip
    "new+kl": dict(learning_rate=3e-4, max_step_kl=0.01),  # the defaults before the random-model run
    "ratio": dict(learning_rate=3e-4, step_clip_mode="ratio"),
    "halving": dict(learning_rate=3e-4, step_clip_mode="ratio", halving=True),
    "new-gps2": dict(learning_rate=3e-4, groups_per_step=2, warmup_ratio=0.1, lr_scheduler_type="constant_with_warmup"),
}
# TRL's loss types and vLLM IS modes (issue 43), each from today's defaults ("new" = dapo + token_truncate 2.0)
NEW = VARIANTS["new"]
VARIANTS |= {f"loss-{t}": NEW | dict(loss_type=t) for t in ("grpo", "dr_grpo", "sapo")}
VARIANTS |= {
    "loss-cispo": NEW | dict(loss_type="cispo", epsilon_high=5.0),  # TRL's recommended cap for cispo
    "loss-luspo": NEW | dict(loss_type="luspo", importance_sampling_level="sequence"),
    "loss-gspo": NEW | dict(importance_sampling_level="sequence"),  # dapo with GSPO's sequence ratio
    **{f"is-{m}": NEW | dict(vllm_importance_sampling_mode=m) for m in ("token_mask", "sequence_truncate",
                                                                         "sequence_mask")},
    "is-trl-default": NEW | dict(vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=3.0),
    "is-off": NEW | dict(vllm_importance_sampling_correction=False),
}


def halving_bound_step(params, before, measure, room, min_scale=1 / 64):
    """The step bound before issue 29, for comparison: halve until inside or at 1/64, and take it there."""
    scale, change = 1.0, measure()
    first = change
    while room(change) < 1 and scale > min_scale:
        scale /= 2
        with torch.no_grad():
            for p, b in zip(params, before):
                p.sub_(b).mul_(0.5).add_(b)
        change = measure()
    return ({"step_scale": scale, "step_skipped": 0, "step_outside": int(room(change) < 1)}
            | {f"step_{k}": v for k, v in change.items()} | {f"step_{k}_unbounded": v for k, v in first.items()})


def load_prompts(folder: Path) -> dict[str, list[int]]:
    """task name -> the first turn's prompt ids, from a folder's traces.jsonl (one task, one prompt)."""
    prompts = {}
    for line in (folder / "traces.jsonl").read_text().splitlines():
        first = json.loads(line)["turns"][0]
        task = first["metadata"]["episode_id"].rsplit("-", 1)[0]
        prompts.setdefault(task, first["prompt_token_ids"])
    return prompts


def load_outputs(folder: Path, tok) -> dict[tuple[str, bool], list[int]]:
    """(task, redirected) -> the ids between the first completion and the second call: the tool output."""
    outputs = {}
    for line in (folder / "traces.jsonl").read_text().splitlines():
        turns = json.loads(line)["turns"]
        if len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        task = first["metadata"]["episode_id"].rsplit("-", 1)[0]
        redirected = " > " in tok.decode(first["completion_token_ids"])
        outputs.setdefault((task, redirected), second["prompt_token_ids"][len(first["prompt_token_ids"]) +
                                                                          len(first["completion_token_ids"]):])
    return outputs


def target(task: str) -> str:
    _, _, _, word, stem = task.split("-", 4)
    return f"echo {word} > {stem}.txt"


CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def command_of(text: str) -> str | None:
    match = CALL.search(text)
    try:
        return json.loads(match.group(1))["arguments"]["command"] if match else None
    except (ValueError, KeyError, TypeError):
        return None


def judge(text: str, task: str) -> tuple[float, bool]:
    """(reward, well formed): the first tool call's command against the solution."""
    command = command_of(text)
    return float(command is not None and command.strip() == target(task)), command is not None


@torch.no_grad()
def sample(model, prompt: list[int], n: int, eos: int, gen: torch.Generator) -> list[tuple[list[int], list[float]]]:
    """n completions of one prompt with their behaviour logprobs (processed: at the sampling temperature)."""
    model.eval()
    ids = torch.tensor([prompt] * n)
    out = model(input_ids=ids, use_cache=True)
    cache, logits = out.past_key_values, out.logits[:, -1]
    tokens, logps, done = [[] for _ in range(n)], [[] for _ in range(n)], [False] * n
    for _ in range(MAX_TOKENS):
        logp = torch.log_softmax(logits.float() / TEMPERATURE, -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
        for i in range(n):
            if not done[i]:
                tokens[i].append(int(nxt[i]))
                logps[i].append(float(logp[i, nxt[i]]))
                done[i] = int(nxt[i]) == eos
        if all(done):
            break
        out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
    return list(zip(tokens, logps))


def evaluate(model, tok, prompts: dict[str, list[int]], n: int, eos: int, seed: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(seed)
    wins = formed = 0
    for task, prompt in prompts.items():
        for ids, _ in sample(model, prompt, n, eos, gen):
            reward, ok = judge(tok.decode(ids), task)
            wins, formed = wins + reward, formed + ok
    total = n * len(prompts)
    return wins / total, formed / total


def run(model_dir: Path, train: dict, outputs: dict, heldout: dict, fields: dict, seed: int, steps: int,
        delay: int, eval_n: int, verbose: bool) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    fields = dict(fields)
    import harness_trainer.training.step as step_module
    from harness_trainer.training.trust_region import bound_step

    step_module.bound_step = halving_bound_step if fields.pop("halving", False) else bound_step
    with tempfile.TemporaryDirectory() as out:
        trainer = HarnessAsyncGRPOTrainer(str(model_dir), lambda sampling: None, AsyncGRPOConfig(
            output_dir=out, num_generations=G, max_steps=steps, temperature=TEMPERATURE, seed=seed, **fields),
            [Task.__new__(Task)])
        gps = trainer.args.groups_per_step
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        names = sorted(train)
        queue, history = [], []
        for step in range(steps + delay):
            if step < steps:  # this step's groups, sampled by the current policy (its version = step)
                groups = []
                for _ in range(gps):
                    task = rng.choice(names)
                    records = []
                    for g, (ids, logps) in enumerate(sample(trainer.model, train[task], G, eos, gen)):
                        text = tok.decode(ids)
                        reward, formed = judge(text, task)
                        prompt, turns = train[task], []
                        while True:
                            turns.append({"node_id": f"{task}-{step}-{g}:{len(turns)}", "prompt_token_ids": prompt,
                                          "completion_token_ids": ids, "per_token_logps": logps,
                                          "loss_mask": [0] * len(prompt) + [1] * len(ids),
                                          "metadata": {"policy_version": step}})
                            if len(turns) == 2:
                                second = command_of(tok.decode(ids))
                                reward = reward if second is not None and ">" not in second else 0.0
                                break
                            if not formed:
                                break
                            output = outputs[(task, " > " in command_of(text))]
                            prompt = prompt + ids + output
                            ids, logps = sample(trainer.model, prompt, 1, eos, gen)[0]
                        records.append(RolloutRecord(task, f"{task}-{g}", HarnessRolloutOutcome(
                            reward, [], [], 0, 0, {}, False), "ok", training_trace={"turns": turns},
                            policy_versions=[step]))
                    groups.append(records)
                queue.append(groups)
            if step >= delay:
                metrics = trainer.policy.step(trainer.score(queue.pop(0)), trainer.step)
                trainer.step += 1
                trainer.history.append(metrics)
                history.append(metrics)
                if verbose:
                    keys = ("reward_mean", "entropy", "behaviour_kl_k3", "behaviour_clip_frac", "step_kl_unbounded",
                            "step_ratio_min_unbounded", "step_ratio_max_unbounded", "step_scale", "lr",
                            "completion_tokens_mean", "trained_tokens")
                    print("   ", trainer.step, {k: round(metrics[k], 4) for k in keys if metrics.get(k) is not None},
                          flush=True)
        win, formed = evaluate(trainer.model, tok, heldout, eval_n, eos, seed + 1000)
    return {"win": win, "formed": formed, "rewards": [h.get("reward_mean") for h in history],
            "entropy": [h.get("entropy") for h in history],
            "scale": [h.get("step_scale", 1.0) for h in history if "loss" in h],
            "skipped": sum(h.get("step_skipped", 0) for h in history),
            "outside": sum(h.get("step_outside", 0) for h in history),
            "measures": sum(h.get("step_measures", 0) for h in history)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--proof", required=True, help="a proof's output folder (sft/, solver/, eval-sft/)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS), help="repeatable (default: old)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--delay", type=int, default=1, help="steps between sampling a group and training on it")
    parser.add_argument("--eval-n", type=int, default=8, help="samples per held-out task")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    proof = Path(args.proof)
    model_dir = proof / "sft" / "final" if (proof / "sft" / "final").exists() else proof / "sft"
    train, heldout = load_prompts(proof / "solver"), load_prompts(proof / "eval-sft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    outputs = load_outputs(proof / "solver", tok)
    sft = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    base_win, base_formed = evaluate(sft, tok, heldout, args.eval_n, eos, 1000)
    print(f"SFT model: held-out first-command wins {base_win:.0%}, well formed {base_formed:.0%}", flush=True)
    for name in args.variant or ["old"]:
        results = []
        for seed in args.seeds:
            r = run(model_dir, train, outputs, heldout, VARIANTS[name], seed, args.steps, args.delay, args.eval_n,
                    args.verbose)
            results.append(r)
            rewards = " ".join("-" if x is None else f"{x:.2f}" for x in r["rewards"])
            print(f"  {name} seed {seed}: wins {r['win']:.0%} ({100 * (r['win'] - base_win):+.0f}), well formed "
                  f"{r['formed']:.0%}; rewards {rewards}", flush=True)
        gains = [100 * (r["win"] - base_win) for r in results]
        reach = [next((i + 1 for i, x in enumerate(r["rewards"]) if x is not None and x >= 0.75), None)
                 for r in results]
        collapsed = sum(r["win"] < base_win - 0.2 or r["formed"] < base_formed - 0.2 for r in results)
        scales = [x for r in results for x in r["scale"]]
        print(f"{name}: gain mean {statistics.mean(gains):+.1f} points, min {min(gains):+.1f}, max {max(gains):+.1f}; "
              f"collapsed {collapsed}/{len(results)}; step taken: median {statistics.median(scales):.2f}, "
              f"skipped {sum(r['skipped'] for r in results)}, taken outside the bound "
              f"{sum(r['outside'] for r in results)}, of {len(scales)} steps; first step with reward >= 0.75: "
              f"{' '.join('-' if x is None else str(x) for x in reach)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
