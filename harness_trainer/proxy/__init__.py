"""Capture proxy: sits between an unmodified agent and vLLM and records exact tokens per model call (issue 3)."""
