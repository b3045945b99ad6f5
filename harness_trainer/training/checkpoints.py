"""What a run leaves on disk: servable models, resumable checkpoints, and best/.

    checkpoint-N/   model + tokenizer (vLLM serves it; with LoRA: the adapter alone), trainer_state.pt (optimizer,
    RNGs),
                    trainer_state.json (step, policy version, dataset cursor, best/'s bookkeeping)
    best/           with save_best: the model after the step with the best training reward, averaged over
                    the last `window` steps with a reward (one group's mean is too noisy to rank by); written
                    once `window` steps have a reward

Every folder is written beside its final name and renamed over it: a crash mid-save leaves the old one whole.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness_trainer.training.protocols import TrainablePolicy

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def save_model(model, path: str | Path, model_dir: Path | None, state_dict: dict | None = None) -> Path:
    """The policy in Hugging Face format, with its tokenizer: a folder vLLM can serve. `state_dict`: weights to
    write instead of the model's own (a LoRA model's merged weights)."""
    path = Path(path)
    model.save_pretrained(path, state_dict=state_dict)
    if model_dir:
        for name in TOKENIZER_FILES:
            if (model_dir / name).exists() and not (path / name).exists():
                shutil.copy2(model_dir / name, path / name)
    return path


def _replace(tmp: Path, final: Path) -> Path:
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


class BestModel:
    """Keeps best/ up to date; its state (best value, recent rewards) travels in each checkpoint."""

    def __init__(self, out: Path, window: int):
        self.out, self.window = out, window
        self.value: float | None = None
        self.recent: list[float] = []

    def update(self, step: int, reward: float | None, save) -> bool:
        """After a step: True when it is the new best (ties keep the earlier step) and best/ was rewritten."""
        if reward is None:
            return False
        self.recent = (self.recent + [reward])[-self.window:]
        value = sum(self.recent) / len(self.recent)
        if len(self.recent) < self.window or (self.value is not None and value <= self.value):
            # a part window is one lucky group: a first step scoring 1.0 would stay best for the whole run
            return False
        self.value = value
        tmp = self.out / ".best.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save(tmp)
        (tmp / "best.json").write_text(json.dumps({"step": step, "reward_window_mean": value,
                                                   "window": len(self.recent)}))
        _replace(tmp, self.out / "best")
        return True

    def state(self) -> dict:
        return {"best_reward": self.value, "recent_rewards": self.recent}

    def restore(self, state: dict) -> None:
        self.value, self.recent = state.get("best_reward"), list(state.get("recent_rewards", []))


@dataclass
class LoopState:
    """The loop's own state in a checkpoint, beside the policy's: the step, the policy version the engines
    serve, the dataset cursor, the trainer's RNG and best/'s bookkeeping."""
    step: int
    version: int
    task_cursor: int
    rng: tuple
    best: dict = field(default_factory=dict)


def save_checkpoint(out: Path, policy: TrainablePolicy, state: LoopState, keep: int) -> Path:
    """checkpoint-{step}: the policy (policy.save_policy), its optimizer, the RNGs and the loop's state; only the
    newest `keep` are kept."""
    tmp = out / f".checkpoint-{state.step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_policy(tmp)
    torch.save({"optimizer": policy.optimizer_state(), "torch_rng": torch.get_rng_state(), "rng": state.rng},
               tmp / "trainer_state.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(
        {"step": state.step, "version": state.version, "task_cursor": state.task_cursor} | state.best))
    path = _replace(tmp, out / f"checkpoint-{state.step}")
    for old in _checkpoints(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def _checkpoints(folder: Path) -> list[Path]:
    return sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))


def load_checkpoint(path: Path, policy: TrainablePolicy) -> LoopState:
    """The policy and its optimizer restored in place (policy.restore), torch's RNG set; returns the loop's state.
    `.../latest` is the newest checkpoint in that folder."""
    if path.name == "latest":
        found = _checkpoints(path.parent)
        if not found:
            raise FileNotFoundError(f"no checkpoint-* in {path.parent} to resume from")
        path = found[-1]
    state = json.loads((path / "trainer_state.json").read_text())
    blob = torch.load(path / "trainer_state.pt", weights_only=False)
    policy.restore(path, blob["optimizer"])
    torch.set_rng_state(blob["torch_rng"])
    best = {k: v for k, v in state.items() if k not in ("step", "version", "task_cursor")}
    return LoopState(state["step"], state["version"], state["task_cursor"], blob["rng"], best)
