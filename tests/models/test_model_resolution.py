"""A user's model: Hub ids resolved against a local stand-in of the Hub (found, pinned, missing, gated, offline,
unreachable), the tool-call and reasoning formats read from chat templates of each family, the tiny
architectures, and a tied model's untied serving copy. No engine: tests/models/test_models_served.py runs them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from harness_trainer._exceptions import ModelError
from harness_trainer.models.formats import FAMILIES, detect_formats, ties_embeddings
from harness_trainer.models.hub import resolve_model
from harness_trainer.models.tiny import TinyModelSpec, ensure_tiny_model
from harness_trainer.models.untie import untied_copy
from tests.hub_standin import HubStandIn

HARNESS_TRAIN = [sys.executable, "-m", "harness_trainer.commands.cli"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The stand-in serving the qwen3-shaped tiny model as open and as gated, and the default as open."""
    with HubStandIn() as standin:
        standin.add("harness/tiny-qwen3", ensure_tiny_model(TinyModelSpec(arch="qwen3", tie_embeddings=True)))
        standin.add("harness/gated", ensure_tiny_model(), token="hf_granted")
        yield standin


def check(hub, *args: str, token: str | None = None, home: Path, offline: bool = False, endpoint=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_ENDPOINT": endpoint or hub.url, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1" if offline else "0",
            "HF_HUB_DISABLE_TELEMETRY": "1"} | ({"HF_TOKEN": token} if token else {})
    return subprocess.run(HARNESS_TRAIN + ["model", "check", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_a_hub_id_resolves_downloads_once_and_says_what_a_run_would_use(hub, tmp_path):
    first = check(hub, "harness/tiny-qwen3", home=tmp_path)
    assert first.returncode == 0, first.stderr
    assert f"harness/tiny-qwen3 @ {hub.repos['harness/tiny-qwen3'].sha}" in first.stdout
    assert "tool calls 'hermes', reasoning 'qwen3'" in first.stdout and "32768 tokens" in first.stdout
    assert "tied" in first.stdout
    downloads = [r for r in hub.requests if r.startswith("GET /harness/tiny-qwen3/resolve/")]
    assert {r.rsplit("/", 1)[-1] for r in downloads} >= {"config.json", "model.safetensors", "tokenizer.json"}
    # the second time from the cache: the repo is asked which commit main is, no file is fetched again
    hub.requests.clear()
    again = check(hub, "harness/tiny-qwen3", home=tmp_path)
    assert again.returncode == 0 and not [r for r in hub.requests if "/resolve/" in r and r.startswith("GET")]
    # offline (HF_HUB_OFFLINE=1) the cached copy is used; the Hub is not asked
    hub.requests.clear()
    offline = check(hub, "harness/tiny-qwen3", home=tmp_path, offline=True)
    assert offline.returncode == 0 and hub.requests == []


def test_a_revision_is_pinned_and_a_wrong_one_is_a_clear_error(hub, tmp_path):
    sha = hub.repos["harness/tiny-qwen3"].sha
    pinned = check(hub, "harness/tiny-qwen3", "--model-revision", sha, home=tmp_path)
    assert pinned.returncode == 0 and sha in pinned.stdout, pinned.stderr
    wrong = check(hub, "harness/tiny-qwen3", "--model-revision", "v9", home=tmp_path)
    assert wrong.returncode == 1 and "no revision v9 in that repo" in wrong.stderr
    assert wrong.stderr.startswith("harness-train: ") and "Traceback" not in wrong.stderr


@pytest.mark.parametrize("repo, token, says", [
    ("harness/missing", None, "no such model repo on the Hub, or it is private"),
    ("harness/gated", None, "the repo is gated"),
    ("harness/gated", "hf_wrong", "the repo is gated"),
    ("harness/gated", "hf_granted", None),
])
def test_missing_and_gated_repos(hub, tmp_path, repo, token, says):
    result = check(hub, repo, token=token, home=tmp_path)
    if says is None:
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 1 and says in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert "HF_TOKEN" in result.stderr


def test_offline_or_unreachable_without_a_cached_copy_is_a_clear_error(hub, tmp_path):
    offline = check(hub, "harness/tiny-qwen3", home=tmp_path, offline=True)
    assert offline.returncode == 1 and "the Hub cannot be reached" in offline.stderr
    assert "hf download harness/tiny-qwen3" in offline.stderr
    gone = check(hub, "harness/tiny-qwen3", home=tmp_path, endpoint="http://127.0.0.1:9")
    assert gone.returncode == 1 and "the Hub cannot be reached" in gone.stderr, gone.stderr
    assert "Traceback" not in offline.stderr + gone.stderr


def test_local_folders_and_bad_names(tmp_path):
    tiny = ensure_tiny_model()
    assert resolve_model(str(tiny)).name == "tiny" and resolve_model(str(tiny)).path == tiny
    with pytest.raises(ModelError, match="does not exist.*Hub id OWNER/NAME"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelError, match="--model-revision main is for a Hub id"):
        resolve_model(str(tiny), "main")


# The markers of each family's real chat template (short excerpts), and what vLLM must parse them with.
TEMPLATES = [
    ("qwen2", "{%- if tools %}<tool_call>\n{\"name\": ...}\n</tool_call>{% endif %}", "hermes", None),
    ("qwen3", "{{- '<tool_call>' }}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
              "{%- endif %}", "hermes", "qwen3"),
    ("qwen3", "<tool_call>\n<function={{ name }}>\n<parameter={{ key }}>", "qwen3_coder", None),
    ("llama", "<|start_header_id|>ipython<|end_header_id|>{\"name\": ..., \"parameters\": ...}<|eot_id|>",
     "llama3_json", None),
    ("mistral", "[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral", None),
    ("gpt_oss", "<|start|>assistant<|channel|>commentary to=functions.x", "openai", "openai_gptoss"),
]


@pytest.mark.parametrize("model_type, template, tools, reasoning", TEMPLATES,
                         ids=[f"{t[2]}-{t[3]}" for t in TEMPLATES])
def test_formats_come_from_the_chat_template(tmp_path, model_type, template, tools, reasoning):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "max_position_embeddings": 40960}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    found = detect_formats(tmp_path)
    assert (found.tool_call_parser, found.reasoning_parser, found.max_model_len) == (tools, reasoning, 40960)
    overridden = detect_formats(tmp_path, tool_call_parser="pythonic", reasoning_parser="none")
    assert (overridden.tool_call_parser, overridden.reasoning_parser) == ("pythonic", None)


def test_an_unknown_or_missing_template_is_a_clear_error_naming_the_flags(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mystery"}))
    with pytest.raises(ModelError, match="no chat template"):
        detect_formats(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ModelError, match="--tool-call-parser .*--reasoning-parser"):
        detect_formats(tmp_path)
    assert detect_formats(tmp_path, tool_call_parser="hermes").tool_call_parser == "hermes"
    assert {f.tool_call_parser for f in FAMILIES} >= {"hermes", "qwen3_coder", "llama3_json", "mistral", "openai"}


@pytest.mark.parametrize("arch, tied, tools, reasoning", [
    ("qwen2", False, "hermes", None), ("qwen3", True, "hermes", "qwen3"), ("llama", False, "llama3_json", None)])
def test_each_tiny_architecture_has_its_family_shape(arch, tied, tools, reasoning):
    from transformers import AutoConfig, AutoTokenizer

    folder = ensure_tiny_model(TinyModelSpec(arch=arch, tie_embeddings=tied))
    formats = detect_formats(folder)
    assert (formats.tool_call_parser, formats.reasoning_parser, ties_embeddings(folder)) == (tools, reasoning, tied)
    assert AutoConfig.from_pretrained(folder).model_type == arch
    tokenizer = AutoTokenizer.from_pretrained(folder)
    turns = [{"role": "user", "content": "list"},
             {"role": "assistant", "content": "", "reasoning_content": "look first",
              "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]},
             {"role": "tool", "content": "a.py"}]
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert ("<think>\nlook first</think>" in text) == (arch == "qwen3")  # kept: after the last user query
    assert text.endswith("<think>\n") == (arch == "qwen3")
    call = '{"name": "bash", "parameters": {"command": "ls"}}' if arch == "llama" else \
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    assert call in text
    dropped = tokenizer.apply_chat_template(turns + [{"role": "user", "content": "again"}], tokenize=False)
    assert "look first" not in dropped  # before the last user query the reasoning is not rendered (Qwen3's rule)


def test_a_tied_model_is_served_from_an_untied_copy_that_links_the_weights():
    tied = ensure_tiny_model(TinyModelSpec(arch="qwen3", tie_embeddings=True))
    copy = untied_copy(tied)
    assert untied_copy(tied) == copy  # built once
    assert json.loads((copy / "config.json").read_text())["tie_word_embeddings"] is False
    assert (copy / "model.safetensors").is_symlink() and (copy / "tokenizer.json").is_symlink()
    with safe_open(str(copy / "lm_head.safetensors"), "pt") as head, \
            safe_open(str(tied / "model.safetensors"), "pt") as weights:
        assert head.get_tensor("lm_head.weight").equal(weights.get_tensor("model.embed_tokens.weight"))
    index = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["lm_head.weight"] == "lm_head.safetensors"
    assert index["model.embed_tokens.weight"] == "model.safetensors"
    shutil.rmtree(copy)


def test_an_engine_serving_a_tied_model_itself_is_refused_before_any_rollout(tmp_path, capsys):
    """A vLLM started without harness-train (plain `vllm serve` of a tied model): a stub answers its /health and
    /v1/models, since starting a real vLLM only to be refused would cost a minute."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from harness_trainer.commands.cli import main

    tied = ensure_tiny_model(TinyModelSpec(arch="qwen3", tie_embeddings=True))

    class Engine(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "tiny", "root": str(tied)}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    stub = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    try:
        code = main(["--environment", "harness_trainer.examples.echo:EchoEnv", "--reward-funcs",
                     "harness_trainer.examples.echo:reward_func", "--dataset", "harness_trainer/examples/echo.jsonl",
                     "--model", str(tied), "--vllm-url", f"http://127.0.0.1:{stub.server_port}",
                     "--report-to", "none", "--output-dir", str(tmp_path / "run")])
    finally:
        stub.shutdown()
    err = capsys.readouterr().err
    assert code == 1 and "lm_head is tied to its embedding" in err and "harness-train serve" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
