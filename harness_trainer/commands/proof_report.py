"""The learning proof's report: each row's win rate with its 95% interval, the gain over SFT with its interval,
the table and the stage times (commands/proof.py runs the stages)."""

from __future__ import annotations

import math

from harness_trainer.commands.evaluate import EvalSummary


def wilson(wins: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a win rate: p~ = (w + z^2/2) / (n + z^2), half-width
    z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n). Unlike p +- z sqrt(p(1-p)/n) it stays in [0, 1] and is not
    empty at 0 or n wins, which a proof's rows often are."""
    if n == 0:
        return 0.0, 1.0
    p = wins / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def gain_interval(after: EvalSummary, before: EvalSummary) -> tuple[float, float, float]:
    """The gain in win rate and its 95% interval (Newcombe's method 10: the two rows' Wilson intervals combined),
    for independent evals: d = p1 - p0, [d - sqrt((p1-l1)^2 + (u0-p0)^2), d + sqrt((u1-p1)^2 + (p0-l0)^2)]."""
    p1, p0 = after.wins / max(after.rollouts, 1), before.wins / max(before.rollouts, 1)
    (l1, u1), (l0, u0) = wilson(after.wins, after.rollouts), wilson(before.wins, before.rollouts)
    d = p1 - p0
    return d, d - math.hypot(p1 - l1, u0 - p0), d + math.hypot(u1 - p1, p0 - l0)


def table(rows: list[tuple[str, EvalSummary]], times: dict[str, float] | None = None) -> str:
    """The proof's table; times: row name -> seconds of the stage that made the row's model and its eval."""
    lines = ["| model | wins (held-out) | win rate [95% CI] | tries per win | invalid tool calls | model calls: agent "
             "/ auxiliary | stage time |", "|---|---|---|---|---|---|---|"]
    for name, s in rows:
        tpw = f"{s.tries_per_win:.2f}" if s.tries_per_win else "-"
        low, high = wilson(s.wins, s.rollouts)
        spent = (times or {}).get(name)
        lines.append(f"| {name} | {s.wins}/{s.rollouts} | {s.wins / max(s.rollouts, 1):.0%} [{low:.0%}, {high:.0%}] | "
                     f"{tpw} | {s.invalid_tool_calls} | {s.agent_calls} / {s.auxiliary_calls} | "
                     f"{f'{spent / 60:.1f} min' if spent is not None else '-'} |")
    return "\n".join(lines)


def stage_times(timings: dict) -> str:
    return "stage times: " + ", ".join(f"{k.removesuffix('_s')} {v / 60:.1f} min" for k, v in timings.items())


def gains(rows: list[tuple[str, EvalSummary]]) -> dict:
    """Each GRPO row's gain over SFT in points of held-out win rate, with its 95% interval."""
    sft = next(s for name, s in rows if name == "SFT")
    return {name: [round(100 * x, 1) for x in gain_interval(s, sft)] for name, s in rows if name.startswith("SFT +")}


def _gain_line(name: str, found: dict) -> str:
    d, low, high = found[name]
    method = "distillation" if "distillation" in name else "GRPO"
    return f"\n{method} over SFT: {d:+.1f} points (95% CI {low:+.1f} to {high:+.1f})"


def spread(rows: list[tuple[str, EvalSummary]]) -> str:
    """The gain over SFT (one run: with its interval; several: their mean and range), in points."""
    found = gains(rows)
    grpo = [name for name in found if "distillation" not in name]
    lines = "".join(_gain_line(name, found) for name in found if "distillation" in name)
    if len(grpo) <= 1:
        return "".join(_gain_line(name, found) for name in grpo) + lines
    values = [found[name][0] for name in grpo]
    return (f"\nGRPO over SFT: mean {sum(values) / len(values):+.1f} points, min {min(values):+.1f}, "
            f"max {max(values):+.1f} ({len(values)} runs)") + lines
