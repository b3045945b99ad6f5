"""What the distillation teacher's scoring costs as rollouts grow, and what scoring by chains saves.

A rollout of T turns, each adding a tool output and a completion to one growing context (an agent's usual
shape), is scored two ways by the same vLLM engine (the embedded tiny model, prompt logprobs):

    chains     what training/distill.py sends: the rollout's root-to-leaf sequences (here one, the last turn's
               prompt + completion), every turn's completion scored inside it
    per turn   each turn's own prompt + completion, one sequence a turn (the quadratic alternative)

    python bench/teacher.py [--turns 5 10 20 40] [--turn-tokens 500]

prints tokens sent and seconds for both, per rollout size, side by side in one run, and checks that both give
the same logprobs for every completion token (vLLM computes a token's logprob from its prefix alone).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness_trainer.models.tiny import ensure_tiny_model  # noqa: E402
from harness_trainer.serving.engine import EngineConfig, VLLMServer  # noqa: E402
from harness_trainer.serving.teacher import Teacher  # noqa: E402


def rollout(turns: int, turn_tokens: int, vocab: int, rng: random.Random) -> tuple[list[int], list[tuple[int, int]]]:
    """One growing context: the final sequence and each turn's completion span (start, end) in it."""
    ids, spans = [rng.randrange(3, vocab) for _ in range(200)], []  # a system prompt and task
    for _ in range(turns):
        completion = turn_tokens // 4
        ids += [rng.randrange(3, vocab) for _ in range(turn_tokens - completion)]  # tool output, chat markers
        spans.append((len(ids), len(ids) + completion))
        ids += [rng.randrange(3, vocab) for _ in range(completion)]
    return ids, spans


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, nargs="+", default=[5, 10, 20, 40])
    parser.add_argument("--turn-tokens", type=int, default=500)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    with VLLMServer(EngineConfig(model=str(ensure_tiny_model()), log_path=Path("/tmp/bench-teacher-vllm.log"),
                                 max_model_len=32768)) as engine:
        teacher = Teacher(engine.url)
        teacher.logprobs([[1, 2, 3]])  # warm-up
        print("| turns | rollout tokens | chains: tokens sent, s | per turn: tokens sent, s | time per turn / chains "
              "| max logprob diff |")
        print("|---|---|---|---|---|---|")
        for turns in args.turns:
            ids, spans = rollout(turns, args.turn_tokens, 4000, rng)
            started = time.perf_counter()
            (whole,) = teacher.logprobs([ids])
            chains_s = time.perf_counter() - started
            sequences = [ids[:end] for _, end in spans]
            started = time.perf_counter()
            each = teacher.logprobs(sequences)
            per_turn_s = time.perf_counter() - started
            diff = max(abs(whole[k] - each[t][k]) for t, (start, end) in enumerate(spans) for k in range(start, end))
            sent = sum(map(len, sequences))
            print(f"| {turns} | {len(ids)} | {len(ids)}, {chains_s:.2f} | {sent}, {per_turn_s:.2f} | "
                  f"{per_turn_s / chains_s:.1f}x | {diff:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
