"""proxy: the capture proxy, between an unmodified agent and vLLM, on mitmproxy. Per model call it records the
engine's own prompt ids, sampled ids, sampled logprobs and a loss mask, never re-tokenising, and exports OpenEnv
TrainingTraces (addon.py: the hooks; capture.py, session.py, store.py: calls, sessions and their journal;
relay.py: the engine's stream passed on as it comes; engines.py: several engines, a
session pinned to one; dialects.py, anthropic.py, responses.py, translate.py: the Messages and Responses APIs
translated to chat completions; control.py: the session routes; server.py: the process; client.py: what the
trainer uses to start and drive it).
Runs in its own environment (mitmproxy and httpx, no torch): imports only serving's process helpers and traces."""
