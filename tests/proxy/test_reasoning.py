"""Reasoning: what a reasoning model samples before its answer is captured and trained like any sampled token
(mask 1), shown to each dialect as that dialect's block (Anthropic `thinking`, Responses `reasoning` items),
read back from the history into `reasoning_content`, and, when the chat template drops it from later turns,
recorded in the rollout graph as the reason a new root starts.

The translation and graph rules run on synthetic chunks and ids; the slow test runs the qwen3-shaped tiny model
in a real vLLM with its reasoning parser, through the real proxy, in all three dialects."""

from __future__ import annotations

import json

import httpx
import pytest

from harness_trainer.proxy.anthropic import AnthropicDialect
from harness_trainer.proxy.responses import ResponsesDialect
from harness_trainer.proxy.session import Call, Session, rollout_document, training_trace


def chunk(**delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "token_ids": [7]}], "prompt_token_ids": [1, 2]}


STREAM = [chunk(reasoning="let me "), chunk(reasoning="look"), chunk(content="ls it is"),
          {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
ANSWER = {"model": "m", "choices": [{"message": {"role": "assistant", "reasoning": "let me look",
                                                 "content": "ls it is"}, "finish_reason": "stop"}]}


def events(stream) -> list[dict]:
    raw = b"".join(stream.event(b"", c) for c in STREAM) + stream.done()
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]


def test_anthropic_shows_reasoning_as_a_thinking_block_and_reads_it_back():
    dialect = AnthropicDialect()
    shown = events(dialect.stream_translator({"model": "m"}))
    starts = [e["content_block"]["type"] for e in shown if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    thinking = "".join(e["delta"]["thinking"] for e in shown if e.get("delta", {}).get("type") == "thinking_delta")
    assert thinking == "let me look"
    assert dialect.from_chat(ANSWER, {})["content"][0] == {"type": "thinking", "thinking": "let me look",
                                                           "signature": ""}
    history = dialect.to_chat({"messages": [
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "let me look", "signature": "s"},
                                          {"type": "text", "text": "ls it is"}]}]})
    assert history["messages"][-1] == {"role": "assistant", "content": "ls it is", "reasoning_content": "let me look"}


def test_responses_shows_reasoning_as_an_item_and_keeps_it_in_the_history():
    dialect = ResponsesDialect()
    shown = events(dialect.stream_translator({"model": "m"}))
    added = [e["item"]["type"] for e in shown if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert "".join(e["delta"] for e in shown if e["type"] == "response.reasoning_text.delta") == "let me look"
    final = shown[-1]["response"]["output"]
    assert final[0]["type"] == "reasoning" and final[0]["content"][0]["text"] == "let me look"
    assert dialect.from_chat(ANSWER, {})["output"][0]["content"] == [{"type": "reasoning_text", "text": "let me look"}]
    # codex sends a reasoning item back before the turn it opened: it joins that turn, call or message
    history = dialect.to_chat({"input": [
        {"type": "message", "role": "user", "content": "list"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look"}]},
        {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "done"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a.py"}]}]})
    turns = history["messages"]
    assert turns[1]["reasoning_content"] == "look" and turns[1]["tool_calls"][0]["id"] == "c1"
    assert turns[3] == {"role": "assistant", "content": "a.py", "reasoning_content": "done"}


def call(index, prompt, completion, reasoning=None):
    message = {"role": "assistant", "content": "x", **({"reasoning": reasoning} if reasoning else {})}
    return Call(index=index, dialect="chat", stream=False, policy_version=0, n_tools=1,
                request={"messages": [], "tools": None}, sampling_params={}, requested_sampling_params={},
                prompt_suffix=prompt, completion_token_ids=completion, per_token_logps=[-0.5] * len(completion),
                message=message, finish_reason="stop")


def test_a_template_that_drops_reasoning_starts_a_new_root_and_says_why():
    think, end = 90, 91
    first = call(0, [1, 5, think], [40, 41, end, 50], reasoning="r")
    # the next prompt re-renders turn 0 without its reasoning: it leaves turn 0 inside what turn 0 sampled
    dropped = call(1, [1, 5, think, end, 50, 6, think], [42, end, 51], reasoning="r")
    rewritten = call(2, [1, 8, think], [60])  # a compacted history: it leaves before what was sampled
    doc = rollout_document(Session(id="s", upstream="http://u", model="m", calls=[first, dropped, rewritten]))
    calls = {c["index"]: c for c in doc["calls"]}
    assert "root_break" not in calls[0] and doc["roots"] == ["s:0", "s:1", "s:2"]
    assert calls[1]["root_break"] == {"at": 3, "prompt_tokens": 3, "reason": "reasoning dropped from the history"}
    assert calls[2]["root_break"]["reason"] == "history rewritten"
    turns = training_trace(Session(id="s", upstream="http://u", model="m", calls=[first, dropped]))["turns"]
    assert turns[1]["metadata"]["root_break"]["reason"] == "reasoning dropped from the history"
    assert all(t["loss_mask"][len(t["prompt_token_ids"]):] == [1] * len(t["completion_token_ids"]) for t in turns)


def test_the_viewer_names_why_a_root_started(tmp_path):
    from harness_trainer.commands.viewer.runs import Decoder, RunFolder

    think, end = 90, 91
    calls = [call(0, [1, 5, think], [40, 41, end, 50], reasoning="r"),
             call(1, [1, 5, think, end, 50, 6, think], [42, end, 51], reasoning="r")]
    trace = training_trace(Session(id="s", upstream="http://u", model="m", calls=calls))
    del trace["turns"][1]["metadata"]["root_break"]  # a trace from before the proxy recorded it: worked out again
    (tmp_path / "traces.jsonl").write_text(json.dumps(trace) + "\n")
    shown = RunFolder(tmp_path, Decoder(None)).rollout(0)["turns"]
    assert "root_break" not in shown[0]
    assert shown[1]["parent"] is None and shown[1]["root_break"]["reason"] == "reasoning dropped from the history"


# --- the real thing: the qwen3-shaped tiny model (tied embeddings) in vLLM with its reasoning parser -------------

@pytest.fixture(scope="module")
def qwen3_proxy(tmp_path_factory):
    from harness_trainer.models.tiny import TinyModelSpec, ensure_tiny_model
    from harness_trainer.proxy.client import ProxyServer
    from harness_trainer.serving.engine import EngineConfig, VLLMServer

    out = tmp_path_factory.mktemp("qwen3")
    model = ensure_tiny_model(TinyModelSpec(arch="qwen3", tie_embeddings=True))
    with VLLMServer(EngineConfig(model=str(model), log_path=out / "vllm.log")) as engine, \
            ProxyServer(engine.url, model=engine.model_name, log_path=out / "proxy.log") as proxy:
        yield proxy


TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                           "parameters": {"type": "object", "properties": {"command": {}}}}}]


@pytest.mark.slow
def test_reasoning_is_captured_with_mask_one_in_every_dialect(qwen3_proxy):
    proxy = qwen3_proxy
    session = proxy.client.create_session()
    headers = {"authorization": f"Bearer {session['api_key']}"}
    user = [{"role": "user", "content": "list the files"}]
    chat = httpx.post(proxy.url + "/v1/chat/completions", headers=headers, timeout=120, json={
        "model": "m", "messages": user, "tools": TOOLS, "max_tokens": 12, "seed": 1}).json()
    thought = chat["choices"][0]["message"]["reasoning"]
    assert thought  # the generation prompt opens <think>: what the model samples first is reasoning
    # each dialect asks its own question (the same prompt twice would be a retry, and only one kept)
    anthropic = httpx.post(proxy.url + "/v1/messages", headers=headers, timeout=120, json={
        "model": "m", "max_tokens": 12, "messages": [{"role": "user", "content": "list all files"}], "stream": True,
        "tools": [{"name": "bash", "description": "run a command",
                   "input_schema": TOOLS[0]["function"]["parameters"]}]})
    assert '"type":"thinking"' in anthropic.text and '"thinking_delta"' in anthropic.text
    responses = httpx.post(proxy.url + "/v1/responses", headers=headers, timeout=120, json={
        "model": "m", "input": "list the files, please", "max_output_tokens": 12,
        "tools": [{"type": "function", "name": "bash", "description": "run a command",
                   "parameters": TOOLS[0]["function"]["parameters"]}]}).json()
    assert responses["output"][0]["type"] == "reasoning" and responses["output"][0]["content"][0]["text"]
    # the agent sends its turn back without the reasoning, after a new user query: Qwen3's template drops it
    again = user + [{"role": "assistant", "content": chat["choices"][0]["message"]["content"] or ""},
                    {"role": "user", "content": "and now?"}]
    httpx.post(proxy.url + "/v1/chat/completions", headers=headers, timeout=120, json={
        "model": "m", "messages": again, "tools": TOOLS, "max_tokens": 12, "seed": 1}).raise_for_status()
    trace = proxy.client.trace(session["id"])
    assert len(trace["turns"]) == 4
    for turn in trace["turns"]:  # every sampled token, reasoning included, is trained on
        n = len(turn["completion_token_ids"])
        assert n and turn["loss_mask"][-n:] == [1] * n and sum(turn["loss_mask"]) == n
        assert turn["response"]["choices"][0]["message"].get("reasoning")
    last = trace["turns"][-1]["metadata"]  # compared with the call before it (the Responses one): another prompt
    assert last["parent"] is None and last["root_break"]["reason"] == "history rewritten"
    rollout = proxy.client.rollout(session["id"])
    by_index = {c["index"]: c for c in rollout["calls"]}
    first, fourth = by_index[0], by_index[3]
    # against the turn it repeats, the fourth prompt leaves turn 0 exactly where turn 0's sampling began
    from harness_trainer.traces.prefixes import root_break

    broke = root_break(fourth["prompt_token_ids"], first["prompt_token_ids"],
                       first["prompt_token_ids"] + first["completion_token_ids"], True)
    assert broke == {"at": len(first["prompt_token_ids"]), "prompt_tokens": len(first["prompt_token_ids"]),
                     "reason": "reasoning dropped from the history"}
