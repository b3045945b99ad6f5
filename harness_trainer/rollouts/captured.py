"""What every rollout session does with its capture session on the proxy, whoever drives the model (an agent in a
sandbox, session.py; a white-box environment, environments.py): open it under the run's sampling policy, read back
the trace, the proxy's clean stops and the rollout graph, delete it."""

from __future__ import annotations

import contextlib
from dataclasses import asdict

from openenv.core.harness.training import TrainingTrace

from harness_trainer._exceptions import ProxyError
from harness_trainer.proxy.capture import SamplingPolicy
from harness_trainer.proxy.engines import ENGINE_FAILED
from harness_trainer.rollouts.multi_step import steps_timeout
from harness_trainer.rollouts.trace_reader import validated_trace


def sampling_policy(sampling: SamplingPolicy | dict | None) -> SamplingPolicy:
    """A factory's sampling policy: the object, or OpenEnv's dict of it (training, temperature, max_tokens_cap)."""
    return sampling if isinstance(sampling, SamplingPolicy) else SamplingPolicy.from_dict(sampling)



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
