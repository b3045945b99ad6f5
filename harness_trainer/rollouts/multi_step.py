"""A multi-step task's rollout (steps.py has the format and the rules): in the session's one sandbox, step by
step, the step's files and setup, the agent with the step's instruction (a fresh run, its turns into the same
capture session), the step's verifier; a step below its min_reward ends the trial. Run on the session's agent
thread, so the rollout pool waits for it as for any agent; the session's verify() then only adds the steps up.

A step whose files cannot be set up, whose setup.sh fails, or whose verifier writes no reward makes the rollout
unscorable, naming the step (Harbor would drop that step from the mean: a reward made of the steps that
happened to score is not the trial's).
"""

from __future__ import annotations

import shlex

from harness_trainer._exceptions import SandboxError
from harness_trainer.agents.base import AgentReport, AgentRun
from harness_trainer.rollouts.steps import Step, trial_rewards
from harness_trainer.rollouts.verifier import SOLUTION_EXIT, SOLUTION_LOG, solution_failed, training_reward, verify


def run_steps(session) -> None:
    """Every step of session.task in session.sandbox, in order; each verified step's result in session.steps
    (a LocalSession: its factory, capture, sandbox, report and error)."""
    f, task, box = session.factory, session.task, session.sandbox
    total, timed_out = AgentReport(), None
    for step in task.steps:
        if session.cancelled or session.error:
            break
        if problem := _set_up(session, step):
            session.error = problem
            break
        command, env = f.harness.prepare(AgentRun(
            instruction=step.instruction, base_url=f.agent_base_url(session.capture, task),
            api_key=session.capture["api_key"], model=session.capture["model"], step_limit=f.step_limit,
            timeout_s=step_timeout(step, f.agent_timeout_s), workdir=box.workdir))
        session.run_agent(command, {**task.environment.env, **env}, step_timeout(step, f.agent_timeout_s))
        _add(total, session.report)
        timed_out = timed_out or (session.result if session.result.timed_out else None)
        if session.error or session.cancelled:
            break
        result = verify(box, task, f.reward_key, step)  # after a timed-out agent too, as Harbor does
        session.steps.append({"step": step.name, "rewards": result.rewards, "detail": result.detail,
                              "output": result.stdout[-2000:], "solution": result.solution})
        if not result.rewards:
            session.error = f"step {step.name}: {result.detail}"
        elif stop := step.below(result.rewards):
            session.steps[-1]["stopped"] = stop
            break
    session.report, session.result = total, timed_out or session.result


def step_timeout(step: Step, cap: float | None) -> float:
    return min(step.agent_timeout_s, cap or step.agent_timeout_s)


def steps_timeout(steps: tuple[Step, ...], cap: float | None) -> float:
    """The longest a multi-step rollout may take: every step's agent and verifier, one after the other."""
    return sum(step_timeout(step, cap) + step.verifier_timeout_s for step in steps)


def _set_up(session, step: Step) -> str:
    """The step's workdir/ copied into the working folder and its setup.sh run there; the oracle's solution for
    this step at /solution. Returns why it failed ("" when it did not)."""
    box, task = session.sandbox, session.task
    try:
        if (step.path / "workdir").is_dir():
            box.upload(step.path / "workdir", box.workdir)
            if (step.path / "workdir" / "setup.sh").is_file():
                setup = box.exec(f"bash {shlex.quote(box.workdir.rstrip('/') + '/setup.sh')}", 600)
                if setup.returncode != 0:
                    return f"step {step.name}: its setup.sh exited {setup.returncode}: {setup.stderr[-300:]}"
        if session.factory.upload_solution and (solve := step.solution(task.path)):
            box.clear("/solution")
            box.upload(solve.parent, "/solution")
            box.exec(f"rm -f {SOLUTION_LOG} {SOLUTION_EXIT}", 60)  # the last step's report is not this one's
    except (SandboxError, OSError) as exc:
        return f"step {step.name}: its files could not be set up: {exc}"
    return ""


def _add(total: AgentReport, report: AgentReport) -> None:
    total.completion += report.completion
    for name, count in report.tool_calls_by_name.items():
        total.tool_calls_by_name[name] = total.tool_calls_by_name.get(name, 0) + count
    total.tool_failure_count += report.tool_failure_count
    total.invalid_tool_calls += report.invalid_tool_calls
    total.exit_status = report.exit_status
    total.failure = total.failure or report.failure


def steps_verified(session) -> tuple[float | None, bool, dict]:
    """The trial's training reward, done, and its verifier metrics from the steps that ran (steps.trial_rewards):
    a VerifyResult's fields."""
    task, steps = session.task, session.steps
    rewards = trial_rewards([s["rewards"] for s in steps], task.reward_strategy)
    reward, detail = training_reward(rewards, session.factory.reward_key, "steps") if rewards else (None, "no step")
    said = f"{len(steps)} of {len(task.steps)} steps ({task.reward_strategy}): {detail}"
    output = "\n".join(f"[{s['step']}] {s['output']}" for s in steps)
    return reward, True, {"verifier": said + "".join(f"; {s['stopped']}" for s in steps if s.get("stopped")),
                    "verifier_output": output, "verifier_rewards": rewards, "steps": steps,
                    "solution": next((s["solution"] for s in steps if solution_failed(s["solution"])),  # failed first
                                     steps[-1]["solution"] if steps else "")}
