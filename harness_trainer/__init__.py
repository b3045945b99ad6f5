"""harness-trainer: reinforcement learning for coding agents you do not own.

Data flows one way: agent -> proxy -> trace -> rows -> loss -> weights -> vLLM.

The Python API, imported from here:

    from harness_trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer, LocalSessionFactory, load_dataset
    from harness_trainer import EnvironmentSessionFactory, load_rows, TrainRunConfig, run_training

Every error it raises on purpose is a `HarnessTrainerError` (the tree: `_exceptions.py`), exported here.

Names load on first use: the capture proxy runs in an environment without torch, and imports this package.
"""

import importlib

from harness_trainer import _exceptions
from harness_trainer._exceptions import *  # noqa: F403 (the exception tree is the public API's)

__version__ = "0.1.0"

_API = {"AsyncGRPOConfig": "training.config", "HarnessAsyncGRPOTrainer": "training.trainer",
        "LocalSessionFactory": "rollouts.session", "HarnessRolloutOutcome": "rollouts.session",
        "load_dataset": "rollouts.tasks", "EnvironmentSessionFactory": "rollouts.environments",
        "load_rows": "rollouts.environments", "TrainRunConfig": "commands.train", "run_training": "commands.train"}
__all__ = sorted(_API) + _exceptions.__all__


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(f"harness_trainer.{_API[name]}"), name)
    raise AttributeError(f"module 'harness_trainer' has no attribute {name!r}")
