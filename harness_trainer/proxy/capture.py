"""Exact capture of one model call, in chat-completions form: what to send, and what came back.

The proxy never tokenises. It asks the engine for its own ids (`return_token_ids`), the sampled tokens'
logprobs (`logprobs`, `top_logprobs: 0`) and reads them back from the JSON answer or, chunk by chunk, from
the SSE stream. With `--return-tokens-as-token-ids` every logprob entry's token is "token_id:N", which is
checked against the ids so a misaligned capture is caught, not trained on.

Pure Python (stdlib only): imported by the proxy's light environment and by the trainer's tests alike.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from harness_trainer._exceptions import PolicyRefusal

INJECTED = {"logprobs": True, "top_logprobs": 0, "return_token_ids": True}
# Sampling knobs forced neutral under a training policy: processed logprobs are then the behaviour policy's.
NEUTRAL = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
           "repetition_penalty": 1.0}
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "max_tokens", "max_completion_tokens", "seed", "stop", "n")
CONSTRAINED = ("logit_bias", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "guided_decoding_backend", "structured_outputs", "allowed_token_ids", "bad_words")


@dataclass
class SamplingPolicy:
    """What a session lets the harness choose. `training=True` pins everything but temperature."""
    training: bool = True
    temperature: float = 1.0  # used when the harness sends none
    max_tokens_cap: int = 8192

    @classmethod
    def from_dict(cls, data: dict | None) -> SamplingPolicy:
        data = data or {}
        return cls(training=bool(data.get("training", True)), temperature=float(data.get("temperature", 1.0)),
                   max_tokens_cap=int(data.get("max_tokens_cap", 8192)))


def prepare_chat_request(body: dict, policy: SamplingPolicy, served_model: str) -> tuple[dict, dict, dict]:
    """Returns (body to send upstream, sampling params as requested, sampling params as sent).

    Raises PolicyRefusal for what a training policy must refuse."""
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise PolicyRefusal("'messages' must be a non-empty list of chat messages")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise PolicyRefusal(f"'{key}' must be a positive integer, not {value!r}")
    if body.get("tools") is not None and not isinstance(body["tools"], list):
        raise PolicyRefusal("'tools' must be a list of tool definitions")
    requested = {k: body[k] for k in SAMPLING_KEYS if k in body}
    sent = dict(body)
    sent["model"] = served_model  # harnesses mangle names ("openai/tiny", "hosted_vllm/tiny")
    sent["messages"] = [dict(m, role="system") if isinstance(m, dict) and m.get("role") == "developer" else m
                        for m in body["messages"]]
    if not sent.get("tools"):  # an empty tool list confuses some engines
        for key in ("tools", "tool_choice", "parallel_tool_calls"):
            sent.pop(key, None)
    n = body.get("n", 1)
    if n not in (1, None):
        raise PolicyRefusal(f"n={n} is not supported: each model call must sample exactly one answer (n=1)")
    sent.pop("n", None)
    if policy.training:
        for key in CONSTRAINED:
            if body.get(key) not in (None, {}, []):
                raise PolicyRefusal(f"'{key}' constrains sampling, so the captured logprobs would not be the "
                                    "policy's; remove it for training sessions")
        fmt = body.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            raise PolicyRefusal(f"response_format '{fmt.get('type')}' constrains sampling; only text is allowed "
                                "in training sessions")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise PolicyRefusal(f"tool_choice {json.dumps(choice)} forces a tool call; only 'auto' or 'none' are "
                                "allowed in training sessions")
        temperature = body.get("temperature")
        if temperature is None:
            temperature = policy.temperature
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or \
                not math.isfinite(temperature) or temperature <= 0:
            raise PolicyRefusal(f"temperature {temperature!r} is not a positive finite number; greedy decoding "
                                "has no logprobs to learn from")
        sent["temperature"] = float(temperature)
        sent.update(NEUTRAL)
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    sent.pop("max_completion_tokens", None)
    sent["max_tokens"] = min(limit, policy.max_tokens_cap) if limit else policy.max_tokens_cap
    sent.update(INJECTED)
    sent_params = {k: sent[k] for k in SAMPLING_KEYS if k in sent}
    return sent, requested, sent_params


@dataclass
class Completion:
    """What the engine returned for one call, accumulated from JSON or from SSE chunks."""
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_strings: list[str] = field(default_factory=list)
    content: str = ""
    reasoning: str = ""
    tool_calls: dict[int, dict] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict | None = None
    saw_logprobs: bool = True

    def add_choice_delta(self, choice: dict) -> None:
        """Fold one streamed choice (or one whole JSON choice) into the accumulated answer."""
        self.token_ids += choice.get("token_ids") or []
        lp = choice.get("logprobs")
        if lp is None:
            if choice.get("token_ids"):
                self.saw_logprobs = False
        else:
            for entry in lp.get("content") or []:
                self.logprobs.append(entry.get("logprob"))
                self.token_strings.append(entry.get("token"))
        msg = choice.get("delta") or choice.get("message") or {}
        self.content += msg.get("content") or ""
        self.reasoning += msg.get("reasoning") or msg.get("reasoning_content") or ""
        for i, call in enumerate(msg.get("tool_calls") or []):
            slot = self.tool_calls.setdefault(call.get("index", i), {
                "id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            slot["id"] = call.get("id") or slot["id"]
            fn = call.get("function") or {}
            slot["function"]["name"] += fn.get("name") or ""
            slot["function"]["arguments"] += fn.get("arguments") or ""
        self.finish_reason = choice.get("finish_reason") or self.finish_reason

    @classmethod
    def from_json(cls, body: dict) -> Completion:
        done = cls(prompt_token_ids=body.get("prompt_token_ids"), usage=body.get("usage"))
        for choice in body.get("choices") or []:
            done.add_choice_delta(choice)
        return done

    def message(self) -> dict:
        calls = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if calls:
            msg["tool_calls"] = calls
        if self.reasoning:
            msg["reasoning"] = self.reasoning
        return msg

    def problem(self) -> str | None:
        """Why this call cannot be trained on, or None when its capture is exact."""
        if not self.prompt_token_ids:
            return "the engine returned no prompt_token_ids (it must be vLLM with return_token_ids support)"
        if self.finish_reason is None:
            return "the answer never finished (no finish_reason: the stream broke off or errored)"
        if not self.saw_logprobs or len(self.logprobs) != len(self.token_ids):
            return (f"{len(self.logprobs)} logprobs for {len(self.token_ids)} sampled tokens: the engine must "
                    "return one logprob per sampled token")
        for i, (tok, s, lp) in enumerate(zip(self.token_ids, self.token_strings, self.logprobs)):
            if s is not None and s.startswith("token_id:") and s != f"token_id:{tok}":
                return f"token {i}: logprob entry '{s}' does not pair with sampled id {tok}"
            if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not math.isfinite(lp) or lp > 0:
                return f"token {i}: logprob {lp!r} is not a finite number <= 0"
        return None


class SSEDecoder:
    """Splits an SSE byte stream into complete events, keeping partial lines between chunks."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        events = []
        while True:
            cut = self._buffer.find(b"\n\n")
            if cut < 0:
                return events
            events.append(self._buffer[:cut])
            self._buffer = self._buffer[cut + 2:]


def event_data(event: bytes) -> str | None:
    """The joined `data:` payload of one SSE event (None for comments/keep-alives)."""
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines).decode("utf-8") if lines else None


def strip_injected(obj: dict, asked: dict) -> dict:
    """Undo what the proxy's injected fields added, so the agent sees the answer it would have had without
    the proxy: vLLM sends those fields as null when they were not asked for."""
    if not asked.get("return_token_ids"):
        for key in ("prompt_token_ids", "prompt_text"):
            if key in obj:
                obj[key] = None
    for choice in obj.get("choices") or []:
        if not asked.get("return_token_ids") and "token_ids" in choice:
            choice["token_ids"] = None
        if not asked.get("logprobs") and "logprobs" in choice:
            choice["logprobs"] = None
    return obj
