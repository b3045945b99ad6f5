"""serving: the inference engine and what keeps it running: engine.py (vLLM launched from its own environment,
or attached by URL), weight_sync.py (the weight-sync backends behind one interface: reload, lora), gpu_sync.py
(the GPU backends: nccl, ipc), sync_steps.py (what the backends share: one HTTP step that fails loudly),
placement.py (which GPUs the engines and the trainer's ranks take), process.py (subprocesses in their own process
groups, the /health probe, free ports), tether.py (a server stopped when its parent dies), supervise.py (restart a
server that died), teacher.py (a distillation teacher's engine: prompt logprobs of given ids, tokenizer
check). Imports only models and traces; never the trainer."""
