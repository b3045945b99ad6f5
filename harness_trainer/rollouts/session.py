"""One rollout = one task, one sandbox, one capture session, one unmodified agent, then the verifier.

The contract the trainer uses, shaped like OpenEnv's so its `HarborSessionFactory` fits too:
    factory = partial(LocalSessionFactory, proxy=..., harness="mini-swe-agent", ...)(sampling)
    session = factory.create(task, seed=0, episode_id="g3-r1")     # the agent starts
    exit_code = session.wait_for_completion(timeout_s)             # it finishes or is killed
    trace = session.fetch_training_trace()                         # OpenEnv TrainingTrace
    result = session.verify(transcript)                            # OpenEnv VerifyResult (env_reward)
    session.close()

`run_rollout` does all of it and classifies how it ended:
    ok             the agent ran, the verifier scored it
    cancelled      stopped by the trainer: its oldest turn became too stale. Not verified, not trained
    timeout        the agent was killed at its timeout: captured turns and the verifier's score are kept
    unscorable     sandbox / agent start / transport failure (or the agent's report of a model API error), no
                   agent turn, its engine lost or its last call failed there, or no score from the verifier: None
A capture that breaks the trace contract is no status: run_rollout raises CaptureContractError (training stops).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from openenv.core.harness.rollout import VerifyResult
from openenv.core.harness.training import TrainingTrace

from harness_trainer._exceptions import CaptureNotTrainable, ProxyError, SandboxError
from harness_trainer.agents.base import AgentReport, AgentRun, Harness, exit_reason
from harness_trainer.agents.registry import make_harness
from harness_trainer.proxy.capture import SamplingPolicy
from harness_trainer.proxy.client import ProxyClient
from harness_trainer.proxy.engines import ENGINE_FAILED, ENGINE_LOST
from harness_trainer.rollouts.captured import CapturedSession, sampling_policy
from harness_trainer.rollouts.multi_step import run_steps, steps_verified
from harness_trainer.rollouts.tasks import Task
from harness_trainer.rollouts.trace_reader import collect_trace
from harness_trainer.rollouts.verifier import VerifierResult, verify
from harness_trainer.sandboxes.base import ExecResult, Sandbox
from harness_trainer.sandboxes.registry import SandboxProvider, proxy_address


@dataclass
class HarnessRolloutOutcome:
    """Exactly the seed's fields: what a `rollout_reward_fn` sees."""
    env_reward: float | None
    completion: list[dict]
    trace: list[dict]
    tool_call_count: int
    tool_failure_count: int
    tool_calls_by_name: dict[str, int]
    timed_out: bool


@dataclass
class RolloutRecord:
    """Everything about one rollout, for the eval table, the trainer and the output folder."""
    task: str
    episode_id: str
    outcome: HarnessRolloutOutcome
    status: str  # ok | cancelled | timeout | unscorable
    reason: str = ""
    invalid_tool_calls: int = 0
    training_trace: dict | None = None  # OpenEnv wire form, when trainable
    verifier_detail: str = ""
    agent_exit: int | None = None
    seconds: float = 0.0
    policy_versions: list[int] = field(default_factory=list)
    verifier_output: str = ""  # the end of test.sh's stdout and stderr (/logs/verifier/test-stdout.txt)
    verifier_rewards: dict = field(default_factory=dict)  # every number the verifier wrote, by key
    calls: list[dict] = field(default_factory=list)  # every captured call, ids left out: the rollout graph
    reward: float | None = None  # what the trainer trained on: the sum of reward_terms (rewards.score_group)
    reward_terms: dict | None = None  # each reward function's value, by name; None until scored
    truncated: str = ""  # why a limit (time, model calls, context, tokens) cut it; "" when it ended on its own
    solution: str = ""  # the oracle's solve.sh, when it ran: its exit status and last output (verifier.py)
    steps: list[dict] = field(default_factory=list)  # a multi-step task's steps: name, rewards, detail (steps.py)
    environment: object = field(default=None, repr=False, compare=False)  # a white-box instance until scored

    @property
    def group_reward(self) -> float | None:
        """What its group's advantages see: the reward, or None for an unscorable rollout (left out, never 0)."""
        return None if self.status == "unscorable" else self.reward


class RolloutSession(Protocol):
    """What run_rollout needs of one rollout's session (LocalSession: an agent in a sandbox; EnvironmentSession:
    a white-box episode; a test's stub). Set by the session: `error` (why it cannot be scored), `cancelled`,
    `timed_out`, `report` (the agent's own account: AgentReport), `end_reason` (a limit that ended a white-box
    episode, else ""), `environment` (a white-box episode's instance, else None)."""
    episode_id: str
    error: str | None
    cancelled: bool
    report: AgentReport
    end_reason: str
    environment: object

    @property
    def timeout_s(self) -> float: ...
    @property
    def timed_out(self) -> bool: ...
    def wait_for_completion(self, timeout_s: float | None = None) -> int: ...
    def fetch_training_trace(self) -> TrainingTrace: ...
    def trace_json(self) -> bytes: ...
    def proxy_stops(self) -> list[str]: ...
    def first_version(self) -> int | None: ...
    def rollout_calls(self) -> list[dict]: ...
    def verify(self, transcript: list | None = None, final_state=None) -> VerifyResult: ...
    def cancel(self) -> None: ...
    def close(self) -> None: ...


class SessionFactory(Protocol):
    """Makes a run's rollout sessions; `sampling`: what every session's capture lets the agent choose. The trainer
    and eval call a `SamplingPolicy -> SessionFactory` (a partial of LocalSessionFactory or EnvironmentSessionFactory)
    once with their sampling policy."""
    sampling: SamplingPolicy

    def create(self, task, seed: int | None = None, episode_id: str | None = None) -> RolloutSession: ...
    def close(self) -> None: ...  # what its sessions shared; called by whoever called the factory's maker


def _truncation(session: RolloutSession, stops: list[str], wire: dict | None) -> str:
    """Why a limit ended the rollout before the agent did (mask_truncated_completions leaves it out of the loss)."""
    if session.end_reason:  # a white-box episode's limits
        return session.end_reason
    if session.timed_out:
        return f"time limit ({session.timeout_s:.0f} s)"
    if stops:  # the proxy's clean stops: the model-call budget, the context length
        return "; ".join(stops)
    last = wire["turns"][-1] if wire and wire["turns"] else None
    choices = ((last.get("response") or {}).get("choices") or [{}]) if last is not None else [{}]
    return "its last answer hit the token cap" if choices[0].get("finish_reason") == "length" else ""


class LocalSession(CapturedSession):
    def __init__(self, factory: LocalSessionFactory, task: Task, episode_id: str):
        self.factory, self.task, self.episode_id = factory, task, episode_id
        self.trial_dir = factory.output_dir / "trials" / episode_id
        self.sandbox: Sandbox | None = None
        self.capture: dict | None = None
        self.result: ExecResult | None = None
        self.report = AgentReport()
        self.error: str | None = None  # why it cannot be scored, if so
        self.cancelled = False
        self._thread: threading.Thread | None = None
        self.steps: list[dict] = []  # a multi-step task's verified steps (multi_step.py)

    def start(self) -> None:
        f = self.factory
        if not self.open_capture():
            return
        try:
            self.sandbox = f.make_sandbox(self.trial_dir, self.task)
            self.sandbox.start()
            if app := self.task.app_files():
                self.sandbox.upload(app, "/app")
            if f.upload_solution and self.task.solution:  # the oracle plays it from there, as Harbor's does
                self.sandbox.upload(self.task.solution.parent, "/solution")
            if self.task.steps:  # each step's agent run and verifier, on the agent thread
                self._thread = threading.Thread(target=run_steps, args=(self,), daemon=True)
                return self._thread.start()
            command, env = f.harness.prepare(AgentRun(
                instruction=self.task.instruction, base_url=f.agent_base_url(self.capture, self.task),
                api_key=self.capture["api_key"], model=self.capture["model"], step_limit=f.step_limit,
                timeout_s=self.timeout_s, workdir=self.sandbox.workdir))
            env = {**self.task.environment.env, **env}
        except (SandboxError, OSError) as exc:
            self.error = f"sandbox failed to start: {exc}"
            return
        self._thread = threading.Thread(target=self.run_agent, args=(command, env, self.timeout_s), daemon=True)
        self._thread.start()

    def run_agent(self, command: str, env: dict, timeout_s: float) -> None:
        self.result = self.sandbox.exec(command, timeout_s, env, user=self.task.environment.agent_user)
        if self.result.returncode in (126, 127) and not self.result.timed_out:
            self.error = f"the agent did not start (exit {self.result.returncode}): {self.result.stderr[-300:]}"
        try:
            self.report = self.factory.harness.collect(self.sandbox, self.result)
        except Exception as exc:
            self.report = AgentReport(exit_status=f"unreadable agent output: {exc}")
        if self.report.failure and not self.error and not self.cancelled:
            self.error = f"the agent stopped on a model API failure: {self.report.failure}"

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.result.returncode if self.result else -1

    @property
    def timed_out(self) -> bool:
        return bool(self.result and self.result.timed_out)

    def verify(self, transcript: list | None = None, final_state=None) -> VerifyResult:
        if self.sandbox is None or self.error:
            return VerifyResult(env_reward=None, done=True, metrics={"verifier": self.error or "no sandbox"})
        if self.task.steps:  # verified step by step already
            return VerifyResult(*steps_verified(self))
        result: VerifierResult = verify(self.sandbox, self.task, self.factory.reward_key)
        output = "\n".join(part for part in (result.stdout.strip(), result.stderr.strip()) if part)
        return VerifyResult(env_reward=result.reward, done=True, metrics={
            "verifier": result.detail, "verifier_output": output, "verifier_rewards": result.rewards,
            "solution": result.solution})

    def cancel(self) -> None:
        """Stop the agent now (from another thread): the rollout ends 'cancelled', unverified and untrained."""
        self.cancelled = True
        if self.sandbox is not None:
            self.sandbox.cancel()

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.stop()
        self.delete_capture()


class LocalSessionFactory:
    """Builds rollouts that run an agent harness in a sandbox against a capture proxy. Called by the trainer with
    its sampling policy (a SamplingPolicy, or OpenEnv's dict of it): pass `partial(LocalSessionFactory, proxy=...)`."""

    def __init__(self, sampling: SamplingPolicy | dict | None = None, *, proxy: ProxyClient,
                 harness: str | Harness = "mini-swe-agent", sandbox: str | SandboxProvider = "local",
                 output_dir: str | Path = "runs/rollouts", step_limit: int = 12,
                 agent_timeout_s: float | None = None, max_model_calls: int | None = None,
                 reward_key: str = "reward", public_url: str | None = None, agent_command: str | None = None,
                 agent_config: str | None = None, upload_solution: bool = False):
        self.sampling = sampling_policy(sampling)
        self.proxy = proxy
        self.harness = make_harness(harness, agent_command, agent_config) if isinstance(harness, str) else harness
        self.harness.check_installed()
        self.output_dir = Path(output_dir)
        # a provider passed in is its maker's to close; one made here from a kind's name is this factory's
        self.own_sandboxes = isinstance(sandbox, str)
        self.sandboxes = SandboxProvider(sandbox, public_url=public_url, log_dir=self.output_dir / "builds") \
            if self.own_sandboxes else sandbox
        self.step_limit, self.agent_timeout_s = step_limit, agent_timeout_s
        self.max_model_calls = max_model_calls if max_model_calls is not None else step_limit * 2 + 4
        self.reward_key = reward_key
        self.upload_solution = upload_solution  # the oracle policy: each task's solution/ at /solution

    def make_sandbox(self, trial_dir: Path, task: Task) -> Sandbox:
        return self.sandboxes.make(trial_dir, task=task.name, spec=task.environment, proxy_url=self.proxy.url,
                                   task_dir=task.path)

    def agent_base_url(self, capture: dict, task: Task) -> str:
        """A remote sandbox's agent reaches the proxy at --public-url; a jail's or a container's at the proxy's
        own loopback address, which its forwarder serves inside the trial."""
        if self.sandboxes.kind_for(task.environment) in ("local", "docker"):
            return f"http://127.0.0.1:{proxy_address(self.proxy.url)[1]}/v1"
        if self.sandboxes.public_url:
            return self.sandboxes.public_url.rstrip("/") + "/v1"
        return capture["base_url"]

    def create(self, task: Task, seed: int | None = None, episode_id: str | None = None) -> LocalSession:
        session = LocalSession(self, task, episode_id or f"{task.name}-{uuid.uuid4().hex[:8]}")
        session.start()
        return session

    def close(self) -> None:
        """The sandboxes' shared parts (containers started ahead), where this factory made its provider."""
        if self.own_sandboxes:
            self.sandboxes.close()


def cancelled_record(task: str, episode_id: str, **fields) -> RolloutRecord:
    """A rollout stopped (or never started) as it could no longer finish in time: unverified, untrained, counted."""
    return RolloutRecord(task=task, episode_id=episode_id, outcome=HarnessRolloutOutcome(None, [], [], 0, 0, {}, False),
                         status="cancelled", reason="cancelled: it could not finish within max_staleness", **fields)


def run_rollout(factory: SessionFactory, task: Task, episode_id: str | None = None,
                on_session=None) -> RolloutRecord:
    """Create, wait, fetch, verify, close; classify the ending. Raises CaptureContractError only.
    `on_session(session)` is called once the agent runs (the trainer keeps it to cancel stale work)."""
    started = time.perf_counter()
    session = factory.create(task, episode_id=episode_id)
    if on_session:
        on_session(session)
    try:
        exit_code = session.wait_for_completion(session.timeout_s + 60)
        if session.cancelled:
            return cancelled_record(task.name, session.episode_id, agent_exit=exit_code,  # its calls: what it cost
                                    seconds=time.perf_counter() - started, calls=session.rollout_calls())
        wire, reason, untouched = None, session.error or "", False
        if not session.error:
            try:  # the wire form only (a model held through the verifier doubles a rollout's memory), repeats shared
                wire = collect_trace(session.trace_json, f"rollout {session.episode_id} ({task.name})")
            except CaptureNotTrainable as exc:  # with the agent's own account of why (e.g. its connect error)
                said = f" (the agent: {session.report.exit_status})" if session.report.exit_status else ""
                # no agent turn, or a call that broke off (its engine died): the score is not the policy's
                reason, untouched = f"nothing trainable was captured: {exc}{said}", True
            except ProxyError as exc:
                reason = f"could not fetch the trace: {exc}"
        stops = session.proxy_stops()
        lost = next((s for s in stops if s.startswith((ENGINE_LOST, ENGINE_FAILED))), None)  # not the policy's end
        if lost:  # after the agent's own account of it, where it gave one
            reason = f"{reason} ({lost})" if session.error else lost
        elif not reason and stops:  # the agent was stopped cleanly: say why
            reason = "stopped by the capture proxy: " + "; ".join(stops)
        if not reason and exit_code and not session.timed_out:  # scored as it stands, but say the agent died
            reason = exit_reason(exit_code, session.report.exit_status)
        reason = reason or session.end_reason  # a white-box episode cut by its limits
        truncated = _truncation(session, stops, wire)
        verified = session.verify(session.report.completion)
        calls = session.rollout_calls()
        if session.error or lost or untouched:  # untouched: nothing of the policy to score or train
            status = "unscorable"
        elif verified.env_reward is None and not verified.metrics.get("scored_later"):
            status, reason = "unscorable", reason or verified.metrics.get("verifier", "")
        else:
            status = "timeout" if session.timed_out else "ok"
        report = session.report
        outcome = HarnessRolloutOutcome(
            env_reward=verified.env_reward if status != "unscorable" else None, completion=report.completion,
            trace=[t for t in wire["turns"]] if wire else [], tool_call_count=report.tool_call_count,
            tool_failure_count=report.tool_failure_count, tool_calls_by_name=dict(report.tool_calls_by_name),
            timed_out=session.timed_out)
        return RolloutRecord(
            task=task.name, episode_id=session.episode_id, outcome=outcome, status=status, reason=reason,
            invalid_tool_calls=report.invalid_tool_calls, training_trace=wire,
            verifier_detail=str(verified.metrics.get("verifier", "")), agent_exit=exit_code,
            seconds=time.perf_counter() - started, verifier_output=str(verified.metrics.get("verifier_output", "")),
            verifier_rewards=dict(verified.metrics.get("verifier_rewards") or {}),
            calls=calls, truncated=truncated, solution=str(verified.metrics.get("solution", "")),
            steps=list(verified.metrics.get("steps") or []),
            policy_versions=sorted({t["metadata"].get("policy_version", 0) for t in (wire or {}).get("turns", [])}),
            environment=session.environment)
    finally:
        session.close()
