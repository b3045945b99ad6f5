"""agents: the harness contract (base.py: Harness, AgentRun, AgentReport, reading what an agent left) and each
unmodified agent program pointed at the capture proxy, one file each: mini_swe_agent.py, opencode.py,
claude_code.py, codex.py, cline.py, gemini_cli.py, qwen_code.py, aider.py, terminus.py (Harbor's terminus-2),
command.py (any CLI from a template); events.py: the shape the agents that write an events file share;
registry.py: the names (`--harness`). What is copied into the sandbox to run there is in inside/ (mini_client.py,
terminus_run.py, the compact configs). Where they run is sandboxes/; knows nothing of training."""
