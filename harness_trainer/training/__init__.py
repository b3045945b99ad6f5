"""training: async GRPO over captured rollouts. config.py (AsyncGRPOConfig and its checks), trainer.py (the loop:
rollouts in flight, groups, staleness, checkpoints), policy.py (the model, its optimizer and ranks), protocols.py
(the loop's collaborators as Protocols: TrainablePolicy, EngineSync), step.py (one optimizer step), packing.py
(chains and the prefix tree), tree_attention.py and tree_forward.py (the tree's forward in micro-batches, memory
linear in its tokens), grpo.py (advantages and the loss, TRL's names), distill.py (a teacher's logprobs on every
trained token), trust_region.py (the bound on a step and the collapse warnings), policy_sync.py (the policy into the
engines and the probe), timing.py (where a step's time went), checkpoints.py, distributed.py (ranks), sharding.py
(FSDP2), lora.py, sft_tree.py (SFT on the prefix tree). Imports rollouts and everything below; never a command."""
