"""`make engine-demo`: the engine half of the pipeline on the embedded default, end to end.

Builds the tiny model, starts vLLM, asks one tool-enabled chat completion for exact token ids and logprobs,
reloads perturbed weights into the running server, shows that the logprobs moved to the new policy (and
match transformers on those weights), then stops the engine. Later stages of the pipeline grow from here.
"""

from __future__ import annotations

import sys
import time

import httpx
import torch

from harness_trainer.models.tiny import ensure_tiny_model
from harness_trainer.serving.engine import EngineConfig, VLLMServer, teacher_forced_logprobs
from harness_trainer.serving.process import ignore_stop_signals, interrupt_on_sigterm
from harness_trainer.serving.weight_sync import ram_dir, reload_weights, save_weights, weight_version

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a bash command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
MESSAGES = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Print the numbers 1 to 3."}]


def main() -> int:
    interrupt_on_sigterm()  # SIGTERM stops the demo as Ctrl-C does, its engine with it
    try:
        demo()
    except KeyboardInterrupt:
        ignore_stop_signals()  # stopped and cleaned up: a second signal must not turn 130 into -2
        print("engine demo: interrupted; its engine is stopped", file=sys.stderr)
        return 130
    return 0


def demo() -> None:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    t0 = time.perf_counter()
    model_dir = ensure_tiny_model()
    print(f"[1/5] tiny model: {model_dir} ({time.perf_counter() - t0:.1f} s)")

    t0 = time.perf_counter()
    with VLLMServer(EngineConfig(model=str(model_dir), max_model_len=8192)) as server:
        print(f"[2/5] vLLM healthy at {server.url} after {time.perf_counter() - t0:.1f} s")

        answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 12, "temperature": 1.0,
            "seed": 0, "logprobs": True, "top_logprobs": 0, "return_token_ids": True}).json()
        choice = answer["choices"][0]
        print(f"[3/5] one chat completion with a tool list: {len(answer['prompt_token_ids'])} prompt tokens")
        print(f"      text:      {choice['message']['content']!r}")
        print(f"      token ids: {choice['token_ids']}")
        print(f"      logprobs:  {[round(c['logprob'], 3) for c in choice['logprobs']['content']]}")

        sequence = answer["prompt_token_ids"] + choice["token_ids"]
        before = teacher_forced_logprobs(server, sequence)[-len(choice["token_ids"]):]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        torch.manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.05)
        seconds = reload_weights(server, save_weights(model, ram_dir()), version=1)
        print(f"[4/5] reloaded perturbed weights in {seconds * 1000:.0f} ms; weight version now "
              f"{weight_version(server)!r}")

        after = teacher_forced_logprobs(server, sequence)[-len(choice["token_ids"]):]
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0, :-1]
        reference = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]
        reference = reference[-len(choice["token_ids"]):].tolist()
        print("      same tokens, teacher-forced:  before   after    transformers(after)")
        for tok, b, a, r in zip(choice["token_ids"], before, after, reference):
            print(f"      token {tok:>5}:                {b:8.3f} {a:8.3f} {r:8.3f}")
        gap = max(abs(a - r) for a, r in zip(after, reference))
        moved = max(abs(a - b) for a, b in zip(after, before))
        print(f"      moved by up to {moved:.3f}; vLLM vs transformers on the new weights: max |diff| {gap:.1e}")
    print("[5/5] engine stopped")
    if gap > 1e-4 or moved < 1e-3:
        raise SystemExit("demo failed: vLLM did not move exactly to the new weights")


if __name__ == "__main__":
    sys.exit(main())
