"""`harness-train sft`: supervised warm-up on captured traces, with TRL's SFTTrainer, on the exact token ids.

    traces.jsonl (from `harness-train eval --policy oracle`, or any run) -> chains (training/packing.py, the same exact
    prefix rebuild the RL trainer uses) -> {input_ids, completion_mask} -> SFTTrainer(completion_only_loss)
    --packing tree: the same loss on each batch's chains packed as one prefix tree (training/sft_tree.py), so a
    system prompt the traces share runs once a batch instead of once a row

Nothing is re-tokenised: `input_ids` are the engine's prompt + sampled ids, and `completion_mask` is 1 exactly
on the tokens the trace's loss mask trains (each sampled token once, prompts and tool outputs masked).
The result is saved in Hugging Face format, with the tokenizer, so vLLM can serve it and GRPO can start from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness_trainer._exceptions import SFTError
from harness_trainer.rollouts.config import check_choices, check_positive, option
from harness_trainer.training.config import LR_SCHEDULES, same_as


@dataclass
class SFTRunConfig:
    """`harness-train sft`: TRL's SFTConfig names where TRL has one."""
    traces: str = option(None, "a traces.jsonl, or a folder holding traces.jsonl files (e.g. the --output-dir of "
                               "`harness-train eval --policy oracle`)", required=True)
    model: str | None = option(None, "starting model folder or Hub id OWNER/NAME (default: the embedded tiny model)")
    model_revision: str | None = option(None, "for a Hub id: the branch, tag or commit to use (default: main)")
    output_dir: str = option("runs/sft", "where the run goes; the model lands in OUTPUT_DIR/final")
    num_train_epochs: float = option(3.0, "passes over the traces")
    learning_rate: float = option(1e-3, "peak learning rate")
    per_device_train_batch_size: int = option(8, "rows per optimizer step")
    lr_scheduler_type: str = option("cosine", "learning-rate schedule, by transformers' names", choices=LR_SCHEDULES)
    only_rewarded: bool = option(False, "keep only rollouts whose reward was >= 1 (needs rollouts.jsonl next to "
                                        "the traces)")
    seed: int = option(0, "data order and initialisation seed")
    packing: str = option("rows", "rows (TRL's SFTTrainer, one row per chain) or tree (each batch as one prefix "
                                  "tree: a system prompt the traces share runs once a batch, e.g. opencode's)",
                          choices=("rows", "tree"))
    use_peft: bool = option(False, "train a LoRA adapter (training/lora.py); final/ is then the merged model, "
                                   "adapter/ beside it")
    lora_rank: int = same_as("lora_rank")
    lora_alpha: int = same_as("lora_alpha")
    lora_dropout: float = same_as("lora_dropout")
    lora_target_modules: list[str] | None = same_as("lora_target_modules")

    def __post_init__(self):
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = [m.strip() for m in self.lora_target_modules.split(",") if m.strip()]
        check_choices(self)
        check_positive(self, ("per_device_train_batch_size", "lora_rank"))


def trace_files(where: str | Path) -> list[Path]:
    path = Path(where)
    files = [path] if path.is_file() else sorted(path.rglob("traces.jsonl")) if path.is_dir() else []
    if not files:
        raise SFTError(f"no traces at {where}: give a traces.jsonl file or a folder holding some (written by "
                       "`harness-train eval --output-dir DIR`, e.g. with --policy oracle)")
    return files


def _rewarded_episodes(traces_file: Path) -> set[str]:
    rollouts = traces_file.with_name("rollouts.jsonl")
    if not rollouts.exists():
        raise SFTError(f"--only-rewarded needs {rollouts} (the rollout records written next to the traces)")
    records = [json.loads(line) for line in rollouts.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {r["episode_id"] for r in records if (r["outcome"].get("env_reward") or 0) >= 1.0}


def sft_chains(where: str | Path, only_rewarded: bool = False) -> list:
    """Every chain with a trained token, in the engine's token ids (each trace its own rollout index)."""
    from harness_trainer.traces.files import read_traces
    from harness_trainer.training.packing import chains_from_trace

    chains = []
    for file in trace_files(where):
        keep = _rewarded_episodes(file) if only_rewarded else None
        for trace in read_traces(file):
            if keep is not None and trace.turns[0].metadata.get("episode_id") not in keep:
                continue
            chains += [c for c in chains_from_trace(trace, len(chains)) if any(c.trained)]
    if not chains:
        raise SFTError(f"the traces at {where} hold no trained token (every loss mask is 0, or --only-rewarded "
                       "left nothing): collect traces whose rollouts produced completions")
    return chains


def _row(chain) -> dict:
    return {"input_ids": chain.ids, "completion_mask": [int(t) for t in chain.trained]}


def sft_rows(where: str | Path, only_rewarded: bool = False) -> list[dict]:
    """One row per chain: {"input_ids": [...], "completion_mask": [...]}, in the engine's token ids."""
    return [_row(c) for c in sft_chains(where, only_rewarded)]


def _save_adapted(model, peft, final: Path, model_dir: Path) -> None:
    """A LoRA run's final/: servable alone (GRPO and vLLM start from it), the adapter beside it."""
    from harness_trainer.training.checkpoints import save_model
    from harness_trainer.training.lora import merged_state_dict

    save_model(model, final, model_dir, state_dict=merged_state_dict(model))
    peft.save_pretrained(final / "adapter")


def run_sft(cfg: SFTRunConfig) -> Path:
    """Train, save the model + tokenizer into cfg.output_dir/final, return that folder."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from harness_trainer.models.hub import model_or_default
    from harness_trainer.training.lora import LoraSettings, add_lora

    model_dir = str(model_or_default(cfg.model, cfg.model_revision).path)
    chains = sft_chains(cfg.traces, cfg.only_rewarded)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = add_lora(model, LoraSettings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)) \
        if cfg.use_peft else None
    out = Path(cfg.output_dir)
    if cfg.packing == "tree":
        return _sft_on_tree(cfg, model, peft, chains, tokenizer, Path(model_dir), out)
    rows = [_row(c) for c in chains]
    gpu = torch.cuda.is_available()
    args = SFTConfig(output_dir=str(out), num_train_epochs=cfg.num_train_epochs, learning_rate=cfg.learning_rate,
                     per_device_train_batch_size=cfg.per_device_train_batch_size, completion_only_loss=True,
                     max_length=None, save_strategy="no", report_to="none", logging_steps=5, seed=cfg.seed,
                     lr_scheduler_type=cfg.lr_scheduler_type, warmup_steps=5, use_cpu=not gpu, dataloader_num_workers=0,
                     disable_tqdm=True,
                     # TRL defaults to bf16 and gradient checkpointing: on a CPU, bf16 matmuls are ~10x slower
                     # than float32, and the tiny model needs no activation memory savings.
                     bf16=gpu, gradient_checkpointing=gpu)
    trainer = SFTTrainer(model=peft or model, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tokenizer)
    result = trainer.train()
    final = out / "final"
    if peft is None:
        trainer.save_model(str(final))
    else:
        _save_adapted(model, peft, final, Path(model_dir))
    tokenizer.save_pretrained(final)
    summary = {"rows": len(rows), "trained_tokens": sum(sum(r["completion_mask"]) for r in rows),
               "train_loss": result.training_loss, "steps": result.global_step, "model": str(final),
               "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    (out / "sft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return final


def _sft_on_tree(cfg: SFTRunConfig, model, peft, chains: list, tokenizer, model_dir: Path, out: Path) -> Path:
    import torch

    from harness_trainer.training.checkpoints import save_model
    from harness_trainer.training.sft_tree import train_on_tree

    torch.manual_seed(cfg.seed)
    result = train_on_tree(model, chains, cfg.num_train_epochs, cfg.learning_rate,
                           cfg.per_device_train_batch_size, cfg.lr_scheduler_type, warmup_steps=5, seed=cfg.seed,
                           log=lambda line: print(line, flush=True))
    final = out / "final"
    if peft is None:
        save_model(model, final, model_dir)
    else:
        _save_adapted(model, peft, final, model_dir)
    tokenizer.save_pretrained(final)
    summary = {"rows": len(chains), "trained_tokens": sum(sum(c.trained) for c in chains), "packing": "tree",
               "train_loss": result["train_loss"], "steps": result["steps"], "model": str(final),
               "tokens_fed": result["tokens_fed"], "row_tokens": result["row_tokens"],
               "seconds": round(result["seconds"], 1), "losses": result["losses"]}
    (out / "sft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return final
