"""rollouts: one task, one capture session, one agent (or white-box environment), one verdict. tasks.py and
builtin.py (Harbor task folders, built-in sets), task_fields.py (task.toml's values), steps.py and multi_step.py
(multi-step tasks: their format, their rollout), verifier.py, session.py (the session factory contract and
run_rollout), captured.py (what every session does with its capture session), trace_reader.py (a finished trace
fetched and read, on one thread), trace_check.py (OpenEnv's validator in a process of its own), pool.py (groups
of rollouts in flight, for train and eval), records.py (rollouts.jsonl + traces.jsonl), oracle.py (each task's
known solution as an upstream; oracle_edits.py: as file edits; oracle_keystrokes.py: as a terminal agent's
keystrokes), environments.py (TRL's environment_factory loop), rewards.py (reward functions), services.py
(engine + proxy + sandboxes + session factory, built one way for every command) and config.py (the settings they
share). Imports agents, sandboxes, proxy, serving, models and traces; never training or a command."""
