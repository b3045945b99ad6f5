"""A model class for mini-swe-agent that speaks Chat Completions with plain `requests`, not litellm.

mini-swe-agent picks its model class by `model.model_class` (a full import path is allowed); its default,
LitellmModel, imports litellm at start: ~5 s of CPU per agent process on these machines (pydantic models of
the openai types), more than the rest of a short rollout. A proof makes 320 rollouts, so that import alone is
~27 CPU-minutes. This class is mini-swe-agent's own OpenRouter client (requests, the same message parsing,
observation format and FormatError on a bad or cut-off call) pointed at `model_kwargs.api_base` instead.

Runs inside the sandbox with mini-swe-agent's Python: the harness writes this file next to the agent's config
and puts its folder on PYTHONPATH; `--agent-config compact` selects it (`model_class:
harness_mini_client.ChatCompletionsModel`). Nothing of the project is imported here.
"""

from __future__ import annotations

import json
import os

import requests
from minisweagent.models.openrouter_model import OpenRouterAPIError, OpenRouterModel
from minisweagent.models.utils.actions_toolcall import BASH_TOOL


class ChatCompletionsModel(OpenRouterModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        kwargs = dict(self.config.model_kwargs)
        base = kwargs.pop("api_base", None) or os.getenv("OPENAI_BASE_URL")
        if not base:
            raise ValueError("ChatCompletionsModel needs model.model_kwargs.api_base (or OPENAI_BASE_URL)")
        self._api_url = base.rstrip("/") + "/chat/completions"
        self._api_key = kwargs.pop("api_key", None) or os.getenv("OPENAI_API_KEY", "")
        kwargs.pop("drop_params", None)  # litellm's own (mini.yaml sets it); not a request field
        self._body = kwargs  # what else the config asks for: temperature, max_tokens, ...
        self._model = self.config.model_name.split("/", 1)[-1]  # "hosted_vllm/tiny" -> "tiny", as litellm sends

    def _query(self, messages: list[dict], **kwargs):
        payload = {"model": self._model, "messages": messages, "tools": [BASH_TOOL], **(self._body | kwargs)}
        try:
            response = requests.post(self._api_url, data=json.dumps(payload), timeout=600, headers={
                "Authorization": f"Bearer {self._api_key}", "Content-Type": "application/json"})
        except requests.exceptions.RequestException as error:
            raise OpenRouterAPIError(f"Request failed: {error}") from error
        if response.status_code != 200:
            raise OpenRouterAPIError(f"HTTP {response.status_code}: {response.text[:2000]}")
        return response.json()
