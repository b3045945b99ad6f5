"""agents: the harness contract (base.py: Harness, AgentRun, AgentReport) and each unmodified agent program pointed at
the capture proxy (harnesses.py: mini-swe-agent, opencode, command, and the registry; mini_client.py;
claude_code.py; codex.py; gemini_cli.py; qwen_code.py; cline.py; aider.py; terminus.py: Harbor's terminus-2,
run in the sandbox by terminus_run.py), and the sandboxes they run in (sandbox.py:
bubblewrap and e2b; containers.py: a Docker container per trial; spares.py: containers started ahead;
compose.py: a task's services beside it; images.py: the task images; forwarder.py: the one road out to the proxy;
sandboxes.py: the registry and the pre-run checks; harbor_bridge.py: Harbor's environments). Knows nothing of
training: imports only the packages below it."""
