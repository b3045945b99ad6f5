"""White-box environments: TRL's `environment_factory` classes and reward functions, unchanged, run by a small
agent loop whose every model call goes through the capture proxy (so exact engine tokens, async rollouts, the
off-policy correction, prefix sharing and the run viewer come with them).

The contract, as TRL states it:

    class Wordle:                                   the class is passed, not an instance
        def __init__(self): ...                     no arguments
        def reset(self, **row) -> str | None        every column of the dataset row; the first observation
        def guess(self, guess: str) -> str:         every other public method (but get_reward) is a tool: from the
            '''Make a guess.                         signature and the docstring's Args: (transformers'
            Args:                                    get_json_schema); an exception it raises goes back to the
                guess: The guessed word.'''          model as the tool's answer, {'error': ...}, and counts as a
                                                     tool failure
    def reward_win(environments, **kwargs) -> list[float | None]    over a group's instances (rewards.py)

One rollout = one capture session + one fresh instance:

    messages = row["prompt"] (+ reset's observation, appended to the last message's text)
    loop:  one chat completion through the proxy (the proxy records its prompt ids, sampled ids, logprobs)
           no tool call                                  -> the episode ends
           max_tool_calling_iterations tool rounds done  -> it ends (that answer's calls are not run)
           max_completion_length tokens after the prompt used (sampled and tool answers, all turns together)
                                                         -> it ends
           else each tool call runs, its answer becomes a tool message
The session keeps session.py's contract, so the trainer, `eval` and the viewer take it unchanged; its
rewards come from the reward functions over its group (rewards.score_group), not from a verifier.
Environments are the user's own Python and run in the trainer's process, as in TRL: no sandbox.
"""

from __future__ import annotations

import importlib
import inspect
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from openenv.core.harness.rollout import VerifyResult

from harness_trainer._exceptions import EnvironmentContractError, ModelCallError
from harness_trainer.agents.base import AgentReport
from harness_trainer.proxy.capture import SamplingPolicy
from harness_trainer.proxy.client import ProxyClient
from harness_trainer.rollouts.captured import CapturedSession, sampling_policy

SCORED_WITH_GROUP = "scored by the reward functions with its group"


@dataclass(frozen=True)
class EnvironmentTask:
    """One dataset row as the trainer's task: a group's rollouts all play it; reset() receives its columns."""
    name: str
    row: dict = field(hash=False, compare=False)
    agent_timeout_s: float = 600.0


def load_rows(source: str | Path | Iterable[Mapping]) -> list[EnvironmentTask]:
    """Dataset rows as tasks: a .jsonl / .json file, or any iterable of mappings (a list, a `datasets.Dataset`).
    Every row needs `prompt`: chat messages (a string is taken as one user message); other columns are free."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise EnvironmentContractError(f"--dataset {path}: no such file; white-box runs take rows as a .jsonl file "
                                    "(one JSON object a line) or a .json list, each with a 'prompt' column")
        text = path.read_text(encoding="utf-8")
        try:
            rows = json.loads(text) if path.suffix == ".json" else \
                [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise EnvironmentContractError(f"--dataset {path}: not valid JSON ({exc})") from None
        where = str(path)
    else:
        rows, where = list(source), "train_dataset"
    tasks, names = [], set()
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or "prompt" not in row:
            raise EnvironmentContractError(f"{where} row {i}: every row must be an object with a 'prompt' column (chat "
                                    "messages, or a string); other columns go to reset() and the reward functions")
        row = dict(row)
        prompt = row["prompt"]
        if isinstance(prompt, str):
            row["prompt"] = prompt = [{"role": "user", "content": prompt}]
        if not (isinstance(prompt, list) and prompt and all(isinstance(m, Mapping) and "role" in m for m in prompt)):
            raise EnvironmentContractError(f"{where} row {i}: 'prompt' must be a non-empty list of chat messages "
                                    "({'role': ..., 'content': ...}) or a string")
        for reserved in ("environments", "outcomes", "completions", "prompts"):
            if reserved in row:
                raise EnvironmentContractError(f"{where} row {i}: the column '{reserved}' is a reward function "
                                               "argument; "
                                        "rename it")
        name = str(row.get("name") or row.get("task") or f"row-{i}")
        if name in names:
            name = f"{name}-{i}"  # a group is keyed by its task's name
        names.add(name)
        tasks.append(EnvironmentTask(name=name, row=row))
    if not tasks:
        raise EnvironmentContractError(f"{where} has no rows")
    return tasks


def load_object(spec: str, what: str) -> object:
    """`module:attribute` (the CLI's --environment, --reward-funcs), with an error that says what to fix."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise EnvironmentContractError(f"{what} {spec}: give module:name, e.g. harness_trainer.examples.wordle:Wordle")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise EnvironmentContractError(f"{what} {spec}: cannot import {attr} from {module_name} ({exc}); the "
                                       "module must "
                                "be importable (on PYTHONPATH) and define it") from None


NOT_TOOLS = ("reset", "get_reward")  # TRL's rule: reset starts an episode, get_reward is for reward functions


def environment_tools(instance) -> dict[str, Callable]:
    """Every public method of the class but reset and get_reward, by name: the tools the model gets."""
    if not callable(getattr(instance, "reset", None)):
        raise EnvironmentContractError(f"{type(instance).__name__} has no reset method: an environment class needs "
                                       "reset(self, **row) returning the first observation or None")
    return {name: getattr(instance, name) for name, _ in inspect.getmembers(type(instance), inspect.isfunction)
            if name not in NOT_TOOLS and not name.startswith("_")}


def tool_schemas(tools: dict[str, Callable]) -> list[dict]:
    """OpenAI tool schemas from signatures and docstrings, by transformers' own parser."""
    from transformers.utils import get_json_schema

    schemas = []
    for name, method in tools.items():
        try:
            function = get_json_schema(method)["function"]
            schemas.append({"type": "function", "function": {k: function[k] for k in ("name", "description",
                                                                                      "parameters") if k in function}})
        except Exception as exc:  # DocstringParsingException, TypeHintParsingException
            owner = type(method.__self__).__name__
            raise EnvironmentContractError(f"tool {owner}.{name}: its schema cannot be built ({exc}). Give every "
                                           "argument "
                                    "a type hint and a line under 'Args:' in the docstring, whose first line "
                                    "describes the tool") from None
    return schemas


def check_environment(environment_factory) -> list[dict]:
    """Fail before anything starts: a class (not an instance) that builds with no arguments, has reset and tools
    whose schemas build. Returns the schemas."""
    if not callable(environment_factory):
        raise EnvironmentContractError("environment_factory must be the class itself (or a no-argument callable), "
                                "not an instance")
    try:
        instance = environment_factory()
    except TypeError as exc:
        raise EnvironmentContractError(f"environment_factory() failed: {exc}. Its __init__ must take no arguments; "
                                "per-episode settings come as dataset columns to reset()") from None
    schemas = tool_schemas(environment_tools(instance))
    if not schemas:
        raise EnvironmentContractError(f"{type(instance).__name__} has no public method besides reset: nothing for the "
                                "model to call")
    return schemas


def call_tool(tools: dict[str, Callable], call: dict) -> tuple[str, bool, bool]:
    """Run one tool call: (the tool's answer as text, failed, malformed). A tool's exception is its answer."""
    function = call.get("function") or {}
    name, arguments = function.get("name"), function.get("arguments") or {}
    try:
        if name not in tools:
            raise LookupError(f"unknown tool {name!r}; the tools are {', '.join(tools)}")
        if isinstance(arguments, str):
            arguments = json.loads(arguments or "{}")
        if not isinstance(arguments, dict):
            raise TypeError("the arguments must be a JSON object")
    except (LookupError, ValueError, TypeError) as exc:
        return str({"error": str(exc)}), True, True
    try:
        return str(tools[name](**arguments)), False, False
    except Exception as exc:  # what the tool raised is what the model is told
        return str({"error": str(exc)}), True, False


class EnvironmentSession(CapturedSession):
    """One episode of an environment through the capture proxy, in a thread (the black-box agents' contract)."""

    def __init__(self, factory: EnvironmentSessionFactory, task: EnvironmentTask, episode_id: str):
        self.factory, self.task, self.episode_id = factory, task, episode_id
        self.capture: dict | None = None
        self.report = AgentReport()
        self.error: str | None = None  # why it cannot be scored
        self.cancelled = self.timed_out = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.open_capture():
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self.environment = self.factory.environment_factory()
            tools = environment_tools(self.environment)
            first = self.environment.reset(**self.task.row)
        except Exception as exc:
            self.error = f"the environment failed to start: {type(exc).__name__}: {exc}"
            return
        try:
            self._episode(tools, _with_observation(self.task.row["prompt"], first))
        except ModelCallError as exc:
            self.error = f"the model call failed: {exc}"
        except Exception as exc:  # the loop itself must never take the trainer down
            self.error = f"the episode failed: {type(exc).__name__}: {exc}"

    def _episode(self, tools: dict[str, Callable], prompt: list[dict]) -> None:
        f, report = self.factory, self.report
        schemas, deadline = tool_schemas(tools), time.monotonic() + self.timeout_s
        prompt_tokens, used, rounds = None, 0, 0  # tokens after the first prompt: sampled + tool answers
        while not self.cancelled:
            if time.monotonic() > deadline:
                self.timed_out, self.end_reason = True, f"the episode ran past its timeout ({self.timeout_s:.0f} s)"
                return
            budget = f.max_completion_length - used
            if budget <= 0:
                self.end_reason = f"max_completion_length ({f.max_completion_length} tokens) used"
                return
            answer = self._chat(prompt + report.completion, schemas, min(budget, f.max_tokens))
            choice, usage = answer["choices"][0], answer.get("usage") or {}
            prompt_tokens = prompt_tokens if prompt_tokens is not None else usage.get("prompt_tokens", 0)
            used = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0) - prompt_tokens
            message = choice.get("message") or {}
            calls = message.get("tool_calls") or []
            report.completion.append({"role": "assistant", "content": message.get("content"),
                                      **({"tool_calls": calls} if calls else {})})
            if not calls:
                return  # the model stopped calling tools: the episode's natural end
            if f.max_tool_calling_iterations is not None and rounds >= f.max_tool_calling_iterations:
                self.end_reason = f"max_tool_calling_iterations ({f.max_tool_calling_iterations}) reached"
                return
            for call in calls:
                name = (call.get("function") or {}).get("name") or "?"
                text, failed, malformed = call_tool(tools, call)
                report.tool_calls_by_name[name] = report.tool_calls_by_name.get(name, 0) + 1
                report.tool_failure_count += failed
                report.invalid_tool_calls += malformed
                report.completion.append({"role": "tool", "tool_call_id": call.get("id", ""), "name": name,
                                          "content": text})
            rounds += 1

    def _chat(self, messages: list[dict], tools: list[dict], max_tokens: int) -> dict:
        """One chat completion through this session's capture proxy; transport errors retried (a restarting
        proxy keeps its sessions), refusals not."""
        body = {"model": self.capture["model"], "messages": messages, "tools": tools, "max_tokens": max_tokens,
                "temperature": self.factory.sampling.temperature}
        for attempt in range(4):
            try:
                response = self.factory.http.post(
                    self.capture["base_url"].rstrip("/") + "/chat/completions", json=body,
                    headers={"authorization": f"Bearer {self.capture['api_key']}"}, timeout=self.timeout_s)
                break
            except httpx.TransportError as exc:
                if attempt == 3:
                    raise ModelCallError(f"the capture proxy did not answer: {exc}") from None
                time.sleep(2 ** attempt)
        if not response.is_success:
            raise ModelCallError(f"HTTP {response.status_code}: {response.text[:300]}")
        return response.json()

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        if self._thread is not None:
            self._thread.join(timeout_s)
        return 1 if self.error else 0 if self._thread is not None else -1

    def verify(self, transcript: list | None = None, final_state=None) -> VerifyResult:
        """No verifier: the reward functions score the group's environments (rewards.score_group)."""
        if self.error or self.environment is None:
            return VerifyResult(env_reward=None, done=True, metrics={"verifier": self.error or "no environment"})
        return VerifyResult(env_reward=None, done=True, metrics={"verifier": SCORED_WITH_GROUP, "scored_later": True})

    def cancel(self) -> None:
        self.cancelled = True  # the loop stops before its next model call

    def close(self) -> None:
        self.delete_capture()


def _with_observation(prompt: list[dict], observation) -> list[dict]:
    """The row's messages, reset()'s first observation appended to the last message's text (as TRL does)."""
    messages = [dict(m) for m in prompt]
    if observation is not None:
        content = messages[-1].get("content") or ""
        if isinstance(content, list):  # text parts
            content = content + [{"type": "text", "text": str(observation)}]
        else:
            content = content + str(observation)
        messages[-1]["content"] = content
    return messages


class EnvironmentSessionFactory:
    """Builds white-box rollouts. Called by the trainer with its sampling policy, like LocalSessionFactory:
    `partial(EnvironmentSessionFactory, proxy=..., environment_factory=Wordle)`."""

    def __init__(self, sampling: SamplingPolicy | dict | None = None, *, proxy: ProxyClient, environment_factory,
                 max_tool_calling_iterations: int | None = None, max_completion_length: int = 1024,
                 max_tokens: int | None = None, agent_timeout_s: float | None = None,
                 output_dir: str | Path | None = None):
        check_environment(environment_factory)
        self.sampling = sampling_policy(sampling)
        self.proxy, self.environment_factory = proxy, environment_factory
        self.max_tool_calling_iterations = max_tool_calling_iterations
        self.max_completion_length = max_completion_length
        self.max_tokens = max_tokens or (self.sampling.max_tokens_cap if sampling else None) or max_completion_length
        self.agent_timeout_s = agent_timeout_s
        self.output_dir = Path(output_dir) if output_dir else None
        # the proxy's own bound: one call per tool round, plus the answer that ends the episode
        self.max_model_calls = None if max_tool_calling_iterations is None else max_tool_calling_iterations + 1
        self.http = httpx.Client()

    def create(self, task: EnvironmentTask, seed: int | None = None, episode_id: str | None = None):
        session = EnvironmentSession(self, task, episode_id or f"{task.name}-{uuid.uuid4().hex[:8]}")
        session.start()
        return session

    def close(self) -> None:
        self.http.close()
