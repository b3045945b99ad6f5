"""How a model writes tool calls and reasoning, read from its own files, so vLLM parses what it samples.

vLLM turns sampled text into `tool_calls` and `reasoning` with a parser per format (`--tool-call-parser`,
`--reasoning-parser`). The right one is a property of the model's chat template, which is what taught it the
format; the table below recognises the families vLLM has parsers for by the markers their templates render.
Either choice is overridden by a flag; an unrecognised template is an error naming the flags, never a guess.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness_trainer._exceptions import ModelError


@dataclass(frozen=True)
class Family:
    name: str
    markers: tuple[str, ...]  # all must appear in the chat template (or model_type:X in config.json)
    tool_call_parser: str
    reasoning_parser: str | None = None  # when the template also renders <think>-style reasoning


# First match wins: the more specific shapes come before the general ones they contain.
FAMILIES = (
    Family("gpt-oss (harmony)", ("model_type:gpt_oss",), "openai", "openai_gptoss"),
    Family("Qwen3-Coder (XML calls)", ("<function=", "<parameter="), "qwen3_coder"),
    Family("DeepSeek V3 / R1", ("tool▁calls▁begin",), "deepseek_v3"),
    Family("Mistral", ("[TOOL_CALLS]",), "mistral"),
    Family("Llama 3.x (JSON calls)", ("<|eot_id|>", "parameters"), "llama3_json"),
    Family("Hermes / Qwen2.5 / Qwen3", ("<tool_call>",), "hermes"),
)
# A template that renders an assistant turn's reasoning (or opens the next turn with it) as <think>: the parser
# for that block, per family (DeepSeek's rules differ from Qwen3's).
REASONING_BY_FAMILY = {"DeepSeek V3 / R1": "deepseek_r1"}
THINK_PARSER = "qwen3"
NO_PARSER = ("none", "off", "")


@dataclass(frozen=True)
class ModelFormats:
    family: str
    tool_call_parser: str
    reasoning_parser: str | None
    max_model_len: int | None  # from config.json (max_position_embeddings)

    def describe(self) -> str:
        reasoning = self.reasoning_parser or "none"
        return f"{self.family}: tool calls '{self.tool_call_parser}', reasoning '{reasoning}'"


def chat_template(folder: Path) -> str:
    """The chat template a model folder carries: chat_template.jinja, chat_template.json or tokenizer_config."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = folder / name
        if path.is_file():
            template = json.loads(path.read_text()).get("chat_template")
            if isinstance(template, list):  # named templates: the default one, else the tool-use one
                by_name = {t.get("name"): t.get("template", "") for t in template if isinstance(t, dict)}
                template = by_name.get("tool_use") or by_name.get("default") or next(iter(by_name.values()), "")
            if template:
                return template
    return ""


def model_config(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text())
    return config | (config.get("text_config") or {})  # multimodal configs nest the language model's


def detect_formats(folder: Path, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                   named: str | None = None) -> ModelFormats:
    """The parsers for the model in `folder`; a given parser wins over detection ('none' turns reasoning off)."""
    named = named or str(folder)
    config = model_config(folder)
    template = chat_template(folder)
    haystack = template + f"\nmodel_type:{config.get('model_type', '')}"
    family = next((f for f in FAMILIES if all(m in haystack for m in f.markers)), None)
    if tool_call_parser is None:
        if not template:
            raise ModelError(
                f"model {named} has no chat template (chat_template.jinja or tokenizer_config.json), so an agent's "
                "messages and tools cannot be rendered for it: use its instruct/chat variant, or add a template")
        if family is None:
            raise ModelError(
                f"model {named}: its chat template uses a tool-call format this table does not know "
                "(harness_trainer/models/formats.py). Name vLLM's parser with --tool-call-parser (hermes, "
                "qwen3_coder, qwen3_xml, llama3_json, llama4_json, mistral, pythonic, openai, deepseek_v3, ...) and "
                "--reasoning-parser (qwen3, deepseek_r1, openai_gptoss, ... or none)")
    if reasoning_parser is None:
        reasoning_parser = family.reasoning_parser if family else None
        if reasoning_parser is None and renders_reasoning(template):
            reasoning_parser = REASONING_BY_FAMILY.get(family.name if family else "", THINK_PARSER)
    return ModelFormats(
        family=family.name if family and tool_call_parser in (None, family.tool_call_parser) else "as given",
        tool_call_parser=tool_call_parser or family.tool_call_parser,
        reasoning_parser=None if (reasoning_parser or "").lower() in NO_PARSER else reasoning_parser,
        max_model_len=config.get("max_position_embeddings"))


def renders_reasoning(template: str) -> bool:
    """Whether the template renders reasoning as <think>: a reply given `reasoning_content`, or the generation
    prompt of a thinking model. Rendered, not searched: a template may hold <think> in a branch never taken."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, indent=indent, ensure_ascii=False)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: "")
    reply = {"role": "assistant", "content": "answer", "reasoning_content": "thought", "reasoning": "thought"}
    try:
        compiled = env.from_string(template)
        texts = [compiled.render(messages=messages, add_generation_prompt=prompt, tools=None, bos_token="",
                                 eos_token="") for messages, prompt in
                 (([{"role": "user", "content": "hi"}, reply], False), ([{"role": "user", "content": "hi"}], True))]
    except Exception:  # a template this sandbox cannot render: fall back to reading it
        return "<think>" in template
    return any("<think>" in text for text in texts)


def ties_embeddings(folder: Path) -> bool:
    """True when the output projection is the input embedding (one tensor: lm_head has no weights of its own)."""
    config = json.loads((folder / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings")))
