"""On-policy distillation through an unmodified agent: the teacher scores the student's own captured tokens.

Every trained token of every captured turn gets the teacher's logprob of that exact token id in its exact
context. A rollout is scored through its chains (training/packing.py: each root-to-leaf path of its turns, one
token sequence whose prefix holds every turn on the path), so a turn inside a longer sequence costs nothing
more: teacher tokens = the rollout's chain tokens, not the sum of its turns' prompts. The scores are kept in the
trace itself (each turn's metadata["teacher_logps"], one per completion token), so traces.jsonl holds them.

The loss (training/grpo.py) takes per token t the reverse KL estimate k_t = log p_student(x_t) - log p_teacher(x_t)
on the student's own sample x_t as a negative advantage (the anchors' and Tinker's on-policy distillation:
sum_t k_t is the sampled reverse KL; its gradient through the policy-gradient estimator pushes each sampled
token toward the teacher's probability of it), mixed with the group advantage:
    A_t = (1 - distillation_weight) * A_group + distillation_weight * (log p_teacher(x_t) - log p_student(x_t))
"""

from __future__ import annotations

from harness_trainer.rollouts.session import RolloutRecord
from harness_trainer.traces.files import TrainingTrace
from harness_trainer.training.packing import chains_from_trace
from harness_trainer.training.protocols import TeacherModel


def score_with_teacher(teacher: TeacherModel, records: list[RolloutRecord]) -> None:
    """Attach the teacher's logprobs to every completion token of these rollouts' traces, in place (the
    records' training_trace turns' metadata); the teacher counts the tokens and seconds it took."""
    jobs = []  # (record, its chains)
    for record in records:
        if record.training_trace and record.status in ("ok", "timeout"):
            trace = TrainingTrace.model_validate(record.training_trace)
            jobs.append((record, chains_from_trace(trace, 0, set())))
    sequences = [chain.ids for _, chains in jobs for chain in chains]
    scored = iter(teacher.logprobs(sequences)) if sequences else iter(())
    for record, chains in jobs:
        found: dict[str, dict[int, float]] = {}
        for chain, logps in zip(chains, scored):
            for origin, logp in zip(chain.origin, logps):
                if origin is not None and logp is not None:
                    found.setdefault(origin[1], {})[origin[2]] = logp
        for turn in record.training_trace["turns"]:
            mine = found.get(turn["node_id"], {})
            turn["metadata"]["teacher_logps"] = [mine.get(k) for k in range(len(turn["completion_token_ids"]))]
