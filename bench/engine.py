"""Engine benchmark on the embedded tiny model: time to healthy, decode throughput at 1 and 8 concurrent
requests (and their ratio, measured in the same run), and weight-reload time (median of ten).

    .venv/bin/python bench/engine.py [--tokens 128] [--reloads 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from harness_trainer.models.tiny import ensure_tiny_model
from harness_trainer.serving.engine import EngineConfig, VLLMServer, gpu_available
from harness_trainer.serving.weight_sync import ram_dir, reload_weights, save_weights


def one_request(url: str, tokens: int, seed: int) -> int:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"Write code number {seed}."}],
            "max_tokens": tokens, "min_tokens": tokens, "temperature": 1.0, "seed": seed,
            "logprobs": True, "top_logprobs": 0, "return_token_ids": True}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return len(response.json()["choices"][0]["token_ids"])


def throughput(url: str, concurrency: int, tokens: int, rounds: int = 2) -> float:
    """Generated tokens per second with `concurrency` requests in flight."""
    with ThreadPoolExecutor(concurrency) as pool:
        started = time.perf_counter()
        total = sum(pool.map(lambda i: one_request(url, tokens, i), range(concurrency * rounds)))
        return total / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reloads", type=int, default=10)
    args = parser.parse_args()

    model_dir = ensure_tiny_model()
    started = time.perf_counter()
    with VLLMServer(EngineConfig(model=str(model_dir), max_model_len=4096)) as server:
        healthy = time.perf_counter() - started
        one_request(server.url, 8, 0)  # warm-up
        # Interleaved, best of three each: single-request speed on 2 shared cores is noisy.
        tps1, tps8 = 0.0, 0.0
        for _ in range(3):
            tps1 = max(tps1, throughput(server.url, 1, args.tokens))
            tps8 = max(tps8, throughput(server.url, 8, args.tokens))

        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        directory = save_weights(model, ram_dir())
        reloads = [reload_weights(server, directory, version=i) for i in range(args.reloads)]
        save_times = []
        for _ in range(3):
            t0 = time.perf_counter()
            save_weights(model, ram_dir())
            save_times.append(time.perf_counter() - t0)

    print(f"engine: vllm on {'GPU' if gpu_available() else 'CPU'}, tiny model {model_dir.name}")
    print(f"time to healthy            {healthy:8.1f} s")
    print(f"decode tok/s, 1 request    {tps1:8.0f}   (best of 3, with logprobs + token ids)")
    print(f"decode tok/s, 8 concurrent {tps8:8.0f}   ({tps8 / tps1:.1f}x of 1 request, same run)")
    print(f"reload_weights, median/{args.reloads}  {statistics.median(reloads) * 1000:8.1f} ms "
          f"(min {min(reloads) * 1000:.1f}, max {max(reloads) * 1000:.1f})")
    print(f"save_pretrained to RAM dir {statistics.median(save_times) * 1000:8.1f} ms (median of 3)")


if __name__ == "__main__":
    main()
