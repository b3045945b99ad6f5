"""serving: the inference engine and what keeps it running: engine.py (vLLM launched from its own environment,
or attached by URL), weight_sync.py (every weight-sync backend behind one interface: reload, lora),
process.py (subprocesses in their own process groups, free ports), supervise.py (restart a server that died).
Imports only models and traces; never the trainer."""
