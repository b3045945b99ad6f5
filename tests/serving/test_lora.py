"""LoRA on the real tiny model, vLLM (CPU, adapters loaded at runtime) and proxy: async steps with mini-swe-agent
whose turns carry the adapter that sampled them, the probe after every sync, old adapters unloaded when idle,
a call in flight during a sync finishing on its own adapter, exact resume, and clear refusals."""

from __future__ import annotations

import json
import threading
from functools import partial
from http.server import ThreadingHTTPServer

import httpx
import pytest
import torch
from stubs import Link, StubHandler

from harness_trainer._exceptions import TrainingStopped
from harness_trainer.proxy.client import ProxyServer
from harness_trainer.rollouts.session import LocalSessionFactory
from harness_trainer.rollouts.tasks import load_dataset
from harness_trainer.serving.engine import teacher_forced_logprobs
from harness_trainer.serving.weight_sync import LoraSync, reload_weights
from harness_trainer.training.checkpoints import LoopState, save_checkpoint
from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer


def served_adapters(engine) -> set[str]:
    return {m["id"] for m in httpx.get(engine.url + "/v1/models", timeout=10).json()["data"] if m.get("parent")}


def lora_config(tmp_path, engine, **overrides) -> AsyncGRPOConfig:
    base = dict(output_dir=str(tmp_path / "run"), vllm_server_base_url=engine.url, num_generations=2,
                max_concurrent_rollouts=2, max_steps=2, learning_rate=1e-2, max_completion_tokens=16, save_steps=1,
                shuffle_dataset=False, use_peft=True, lora_rank=8, max_staleness=1)
    return AsyncGRPOConfig(**base | overrides)


def test_lora_async_steps_with_mini_swe_agent(fresh_engine, proxy, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    factory = partial(LocalSessionFactory, proxy=proxy.client, harness="mini-swe-agent",
                      output_dir=tmp_path / "rollouts", step_limit=2)
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), factory, lora_config(tmp_path, fresh_engine),
                                      load_dataset("builtin:toy-train")[:2])
    history = trainer.train()
    assert [h["version"] for h in history] == [2, 3] and all(h["probe_gap"] < 1e-3 for h in history)
    turns = [t for line in (tmp_path / "run" / "traces.jsonl").read_text().splitlines()
             for t in json.loads(line)["turns"]]
    assert turns and all(t["metadata"]["model"] == f"policy-v{t['metadata']['policy_version']}" for t in turns)
    assert {t["metadata"]["policy_version"] for t in turns} <= {1, 2}
    # max_staleness 1: after syncing v3 no rollout may sample from v1 any more, and no call did
    assert "policy-v1" not in served_adapters(fresh_engine) and "policy-v3" in served_adapters(fresh_engine)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").exists() and not (checkpoint / "model.safetensors").exists()
    # final/: a merged model that scores like the trainer's adapted one, and the adapter beside it
    final = trainer.save_model(tmp_path / "final")
    ids = torch.tensor([[1, 10, 20, 30, 40, 50, 60, 70, 2]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)(ids).logits
        adapted = trainer.model(ids).logits
    assert float((merged - adapted).abs().max()) < 1e-4 and (final / "adapter" / "adapter_config.json").exists()
    # ... and vLLM serving that folder (loaded as its base weights) scores like the adapted trainer too
    reload_weights(fresh_engine, final, version=99)
    served = torch.tensor(teacher_forced_logprobs(fresh_engine, ids[0].tolist(), model="tiny"))
    ours = torch.log_softmax(adapted[0, :-1].double(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert float((served.double() - ours).abs().max()) < 1e-4


@pytest.mark.slow
def test_a_call_in_flight_during_a_sync_finishes_on_its_adapter(fresh_engine, tiny_model_dir, tmp_path):
    """A stream sampled from policy-v1 while v2 is loaded and published: it stays v1 (and v1 is not unloaded
    while it runs); the next call is v2; the agent sees its own model name throughout. The stream is held in
    flight by a Link (tests/stubs.py) after its first event, for as long as the test needs: no race with the
    model's speed."""
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), lambda sampling: None,
                                      lora_config(tmp_path, fresh_engine), ["unused"])
    sync = LoraSync(fresh_engine.url)
    link = Link(int(fresh_engine.url.rsplit(":", 1)[1]))
    with ProxyServer(link.url, model="tiny", log_path=tmp_path / "proxy.log") as proxy:
        _sync_during_a_call(proxy, link, trainer, sync)
    link.cut()
    assert served_adapters(fresh_engine) == {"policy-v2"}
    sync.close()


def _sync_during_a_call(proxy, link, trainer, sync) -> None:
    proxy.client.set_policy_version(1, model=sync.load(trainer.policy.peft, 1))
    session = proxy.client.create_session()
    headers = {"authorization": f"Bearer {session['api_key']}"}
    body = {"model": "my-agent-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
            "min_tokens": 64, "stream": True}
    seen = []
    link.pause_streams()
    call = threading.Thread(target=lambda: seen.append(httpx.post(session["base_url"] + "/chat/completions",
                                                                  json=body, headers=headers, timeout=300).text))
    call.start()
    assert link.first_event.wait(300), "the call never went out"
    assert proxy.client.policy_state()["in_flight"].get("policy-v1") == 1
    assert sync.unload_idle(2, proxy.client.policy_state()["in_flight"]) == []  # v1 still samples: kept
    for p in trainer.policy.params:  # a different adapter for v2
        torch.nn.init.normal_(p, std=0.05)
    proxy.client.set_policy_version(2, model=sync.load(trainer.policy.peft, 2))
    link.release()  # the v1 stream goes on to its end
    call.join()
    second = httpx.post(session["base_url"] + "/chat/completions", headers=headers, timeout=60,
                        json=dict(body, stream=False, max_tokens=4, min_tokens=0)).json()
    calls = proxy.client.rollout(session["id"])["calls"]
    assert [(c["model"], c["policy_version"]) for c in calls] == [("policy-v1", 1), ("policy-v2", 2)]
    assert '"model":"tiny"' in seen[0] and "policy-v" not in seen[0] and second["model"] == "tiny"
    assert proxy.client.policy_state()["in_flight"] == {}
    assert sync.unload_idle(2, {}) == [1]


def test_lora_resume_restores_the_adapter_and_optimizer_exactly(tiny_model_dir, tmp_path):
    make = lambda **kw: HarnessAsyncGRPOTrainer(  # noqa: E731
        str(tiny_model_dir), lambda sampling: None,
        AsyncGRPOConfig(output_dir=str(tmp_path / "run"), use_peft=True, lora_rank=4, **kw), ["unused"])
    first = make()
    assert len(first.policy.params) == 2 * 7 * 2 and all("lora_" in n for n, p in first.model.named_parameters()
                                                  if p.requires_grad)
    loss = first.model(torch.tensor([[1, 10, 20, 30, 40]])).logits.square().mean()
    loss.backward()
    first.policy.optimizer.step()  # an Adam state worth restoring
    path = save_checkpoint(first.out, first.policy, LoopState(step=3, version=4, task_cursor=0,
                                                              rng=first.rng.getstate()), keep=2)
    second = make(resume_from_checkpoint=str(path))
    assert (second.step, second.version) == (3, 4)
    for a, b in zip(first.policy.params, second.policy.params):
        assert torch.equal(a, b)
    state_a, state_b = first.policy.optimizer.state_dict()["state"], second.policy.optimizer.state_dict()["state"]
    assert all(torch.equal(state_a[k]["exp_avg"], state_b[k]["exp_avg"]) for k in state_a)


class NoLoraEngine(StubHandler):
    """Stands in for a vLLM started without LoRA (a second real engine would double the session's engines):
    FastAPI's own 404 for the route VLLM_ALLOW_RUNTIME_LORA_UPDATING did not add."""
    def do_POST(self):
        self.send_json(404, b'{"detail":"Not Found"}')


def test_lora_needs_an_engine_with_lora_and_its_own_sync(tiny_model_dir, tmp_path):
    stub = ThreadingHTTPServer(("127.0.0.1", 0), NoLoraEngine)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    try:
        trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), lambda sampling: None, AsyncGRPOConfig(
            output_dir=str(tmp_path), use_peft=True, vllm_server_base_url=f"http://127.0.0.1:{stub.server_port}"),
            ["unused"])
        with pytest.raises(TrainingStopped, match="--enable-lora --max-lora-rank R --max-loras K"):
            trainer.train()  # the cold sync, before any rollout
    finally:
        stub.shutdown()
    with pytest.raises(ValueError, match="--weight-sync-backend lora and --use-peft go together"):
        HarnessAsyncGRPOTrainer(str(tiny_model_dir), None, AsyncGRPOConfig(use_peft=True,
                                                                            weight_sync_backend="reload"), [])
    with pytest.raises(ValueError, match="the model has no such modules"):
        HarnessAsyncGRPOTrainer(str(tiny_model_dir), None, AsyncGRPOConfig(use_peft=True,
                                                                            lora_target_modules=["c_attn"]), [])
