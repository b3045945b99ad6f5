"""agents: the adapter contract (base.py: Harness, AgentRun, AgentReport) and each unmodified agent program
pointed at the capture proxy (harnesses.py: mini-swe-agent, opencode, command; claude_code.py; codex.py),
and the sandboxes they run in (sandbox.py: bubblewrap, e2b, docker, Harbor's environments through
harbor_bridge.py). Knows nothing of tasks, traces or training: imports only the packages below it."""
