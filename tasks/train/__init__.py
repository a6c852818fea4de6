"""Training stage: a small GPT trained data-parallel under torchrun (see launcher.run_training).

The exports load on first use, so importing a torch-free module of the package (tasks.train.flops,
which the planner uses) does not import torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "run_training": "tasks.train.launcher",
    "TrainingError": "tasks.train.launcher",
    "load_model_for_inference": "tasks.train.checkpoint",
    "list_checkpoints": "tasks.train.checkpoint",
    "GPT": "tasks.train.model",
    "GPTConfig": "tasks.train.model",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
