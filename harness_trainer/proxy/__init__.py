"""proxy: the capture proxy, between an unmodified agent and vLLM. Per model call it records the engine's own prompt
ids, sampled ids, sampled logprobs and a loss mask, never re-tokenising, and exports OpenEnv TrainingTraces
(core.py, inflight.py: the capture logic and a call in flight; front.py, http1.py, upstream.py, wire.py: the asyncio
HTTP front for base-URL agents, its requests read by llhttp; addon.py: mitmproxy's hooks for HTTPS_PROXY agents;
capture.py, session.py, store.py: calls, sessions and their journal; relay.py: under mitmproxy, a stream the engine
breaks ends cleanly; engines.py: several engines, a session pinned to one; dialects.py, anthropic.py, responses.py,
google.py, translate.py: the Messages, Responses and Gemini APIs translated to chat completions; control.py: the
session routes; server.py: the process; client.py: what the trainer uses to start and drive it). Runs in its own
environment (mitmproxy and httpx, no torch): imports only serving's process helpers and traces."""
