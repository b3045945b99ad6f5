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

import contextlib
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from openenv.core.harness.rollout import VerifyResult
from openenv.core.harness.training import TrainingTrace

from harness_trainer._exceptions import CaptureNotTrainable, ProxyError, SandboxError
from harness_trainer.agents.base import exit_reason
from harness_trainer.agents.harnesses import AgentReport, AgentRun, Harness, make_harness
from harness_trainer.agents.sandbox import ExecResult, Sandbox
from harness_trainer.agents.sandboxes import kind_for, make_sandbox, proxy_address
from harness_trainer.proxy.capture import SamplingPolicy
from harness_trainer.proxy.client import ProxyClient
from harness_trainer.proxy.engines import ENGINE_FAILED, ENGINE_LOST
from harness_trainer.rollouts.multi_step import run_steps, steps_timeout, steps_verified
from harness_trainer.rollouts.tasks import Task
from harness_trainer.rollouts.trace_reader import collect_trace, validated_trace
from harness_trainer.rollouts.verifier import VerifierResult, verify


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


def sampling_policy(sampling: SamplingPolicy | dict | None) -> SamplingPolicy:
    """A factory's sampling policy: the object, or OpenEnv's dict of it (training, temperature, max_tokens_cap)."""
    return sampling if isinstance(sampling, SamplingPolicy) else SamplingPolicy.from_dict(sampling)


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


class CapturedSession:
    """What every session does with its capture session on the proxy (needs factory.proxy, factory.sampling,
    factory.max_model_calls, factory.agent_timeout_s, task, episode_id, capture, error): open it, read back the
    trace, the clean stops and the rollout graph, delete it."""
    end_reason = ""  # a white-box episode sets why its limits ended it
    environment = None  # a white-box episode's instance

    @property
    def timeout_s(self) -> float:
        if steps := getattr(self.task, "steps", ()):  # every step's agent and verifier (a white-box task has none)
            return steps_timeout(steps, self.factory.agent_timeout_s)
        return min(self.task.agent_timeout_s, self.factory.agent_timeout_s or self.task.agent_timeout_s)

    def open_capture(self) -> bool:
        """The rollout's own capture session (its key is the agent's API key); False, with error set, if none."""
        f = self.factory
        try:
            self.capture = f.proxy.create_session(
                policy=asdict(f.sampling), max_model_calls=f.max_model_calls,
                metadata={"task": self.task.name, "episode_id": self.episode_id})
        except Exception as exc:  # transport
            self.error = f"could not create a capture session: {exc}"
        return self.capture is not None

    def fetch_training_trace(self) -> TrainingTrace:
        """The captured turns. Raises CaptureNotTrainable when nothing trainable was captured and
        CaptureContractError when what was captured breaks the contract."""
        return validated_trace(self.trace_json(), f"rollout {self.episode_id} ({self.task.name})")

    def trace_json(self) -> bytes:
        """The captured turns as the proxy sent them (its compact form: traces/compact.py), not yet validated
        (`validated_trace`)."""
        if self.capture is None:
            raise ProxyError(self.error or "no capture session")
        return self.factory.proxy.trace_json(self.capture["id"], compact=True)

    def proxy_stops(self) -> list[str]:
        """Clean stops the proxy answered (call budget, context overflow), and the last call's failure at the engine."""
        try:  # a reason is only information; never fail a rollout over it
            summary = self.factory.proxy.session(self.capture["id"]) if self.capture else {}
        except Exception:
            return []
        failure = summary.get("engine_failure")
        return list(summary.get("stops") or []) + ([f"{ENGINE_FAILED}: {failure}"] if failure else [])

    def first_version(self) -> int | None:
        """Its first model call's policy version (its oldest turn); None before any or if the proxy cannot say."""
        with contextlib.suppress(Exception):  # not judged stale then: it goes on
            return self.factory.proxy.session(self.capture["id"]).get("first_version") if self.capture else None
        return None

    def rollout_calls(self) -> list[dict]:
        """Every call the proxy captured for this rollout (agent turns, retries it discarded, auxiliary calls),
        without their token ids: the rollout graph the run viewer draws."""
        keep = ("node_id", "index", "role", "parent", "n_tools", "finish_reason", "policy_version", "model",
                "problem", "dialect", "stream", "prompt_tokens", "completion_tokens")
        try:
            calls = self.factory.proxy.graph(self.capture["id"])["calls"] if self.capture else []
        except Exception:  # information only; never fail a rollout over it
            return []
        return [{**{k: c.get(k) for k in keep},
                 "seconds": round(max(0.0, (c.get("finished") or 0) - (c.get("started") or 0)), 3)} for c in calls]

    def delete_capture(self) -> None:
        if self.capture is not None:
            try:
                self.factory.proxy.delete(self.capture["id"])
            except Exception:
                pass


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
                 harness: str | Harness = "mini-swe-agent",
                 sandbox: str = "local", output_dir: str | Path = "runs/rollouts", step_limit: int = 12,
                 agent_timeout_s: float | None = None, max_model_calls: int | None = None,
                 reward_key: str = "reward", public_url: str | None = None, agent_command: str | None = None,
                 agent_config: str | None = None, upload_solution: bool = False):
        self.sampling = sampling_policy(sampling)
        self.proxy = proxy
        self.harness = make_harness(harness, agent_command, agent_config) if isinstance(harness, str) else harness
        self.harness.check_installed()
        self.sandbox_kind, self.public_url = sandbox, public_url
        self.output_dir = Path(output_dir)
        self.step_limit, self.agent_timeout_s = step_limit, agent_timeout_s
        self.max_model_calls = max_model_calls if max_model_calls is not None else step_limit * 2 + 4
        self.reward_key = reward_key
        self.upload_solution = upload_solution  # the oracle policy: each task's solution/ at /solution

    def make_sandbox(self, trial_dir: Path, task: Task) -> Sandbox:
        return make_sandbox(self.sandbox_kind, trial_dir, task=task.name, spec=task.environment,
                            proxy_url=self.proxy.url, public_url=self.public_url, task_dir=task.path,
                            log_dir=self.output_dir / "builds")

    def agent_base_url(self, capture: dict, task: Task) -> str:
        """A remote sandbox's agent reaches the proxy at --public-url; a jail's or a container's at the proxy's
        own loopback address, which its forwarder serves inside the trial."""
        if kind_for(self.sandbox_kind, task.environment) in ("local", "docker"):
            return f"http://127.0.0.1:{proxy_address(self.proxy.url)[1]}/v1"
        if self.public_url:
            return self.public_url.rstrip("/") + "/v1"
        return capture["base_url"]

    def create(self, task: Task, seed: int | None = None, episode_id: str | None = None) -> LocalSession:
        session = LocalSession(self, task, episode_id or f"{task.name}-{uuid.uuid4().hex[:8]}")
        session.start()
        return session


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
