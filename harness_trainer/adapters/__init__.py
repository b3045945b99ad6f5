"""Adapters: run agent harnesses in sandboxes on Harbor tasks and score them with their verifiers (issue 4)."""
