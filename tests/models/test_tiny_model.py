"""The embedded tiny model: loads with transformers, ids agree between tokenizer.json and AutoTokenizer,
tool markers stay plain tokens, the chat template renders tool conversations, builds are deterministic."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from harness_trainer.models.tiny import MARKER_TOKENS, SPECIAL_TOKENS, TinyModelSpec, ensure_tiny_model, train_tokenizer

TRICKY = [
    "def f(x):\n    return x's value  # naïve café 123456\r\n\n\t\tdone",
    "I'm sure it's they're WE'LL  spaces   and\u00a0nbsp, emoji 🤖 and 中文字符",
    "<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"ls -la\"}}\n</tool_call>",
    "e\u0301 composed vs é",  # NFC normalisation
]
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def test_loads_with_transformers_untied(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2"
    assert model.config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.config.vocab_size % 64 == 0


def test_tokenizer_json_agrees_with_auto_tokenizer(tiny_model_dir, tokenizer):
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    for text in TRICKY:
        assert tokenizer.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == raw.normalizer.normalize_str(text)


def test_special_and_marker_tokens(tokenizer):
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert tokenizer.eos_token == "<|im_end|>"
    for marker in MARKER_TOKENS:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        assert len(ids) == 1, marker
        # non-special: survives skip_special_tokens, so vLLM's hermes parser sees it
        assert tokenizer.decode(ids, skip_special_tokens=True) == marker
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == ""


def test_chat_template_renders_tool_conversation(tokenizer):
    messages = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": [{"type": "text", "text": "list files"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"ls\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "bash", "arguments": {"command": "pwd"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "c2", "content": "/app"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are an agent.\n\n# Tools\nbash(command): run a command\n")
    assert '"parameters"' not in text  # one line per tool, no schema
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\na.py\n</tool_response>\n<tool_response>\n/app\n"
            "</tool_response><|im_end|>") in text
    assert "<|im_start|>user\nlist files<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_tool_lines_take_bare_and_wrapped_tools(tokenizer):
    """OpenAI's {"type": "function", "function": {...}} and a bare {...} (as some clients send) render alike;
    a multi-line description gives its first line, a tool without parameters empty brackets."""
    tools = [{"name": "read", "description": "\nRead a file.\nLong details...",
              "parameters": {"properties": {"path": {}, "offset": {}}}},
             {"type": "function", "function": {"name": "noargs"}}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False)
    assert "# Tools\nread(path, offset): Read a file.\nnoargs()\nCall a tool as <tool_call>" in text


def test_generation_prompt_is_prefix_of_rendered_answer(tokenizer):
    """An assistant turn re-renders starting exactly like the generation prompt it was sampled after."""
    history = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    for answer in ({"role": "assistant", "content": "hello"},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"type": "function", "function": {"name": "bash", "arguments": "{}"}}]}):
        assert tokenizer.apply_chat_template(history + [answer], tokenize=False).startswith(prompt)


def test_tokenizer_training_is_deterministic():
    assert train_tokenizer(600).to_str() == train_tokenizer(600).to_str()


def test_cached_build_is_reused_and_out_dir_is_protected(tiny_model_dir, tmp_path):
    assert ensure_tiny_model() == tiny_model_dir
    copy = ensure_tiny_model(out=tmp_path / "m")
    assert (copy / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert ensure_tiny_model(out=copy) == copy  # same spec: reused, no error
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds something else"):
        ensure_tiny_model(TinyModelSpec(), out=tmp_path / "busy")
