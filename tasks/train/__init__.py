"""Training stage: a small GPT trained data-parallel under torchrun (see launcher.run_training)."""
from tasks.train.checkpoint import list_checkpoints, load_model_for_inference
from tasks.train.launcher import TrainingError, run_training
from tasks.train.model import GPT, GPTConfig

__all__ = ["run_training", "TrainingError", "load_model_for_inference", "list_checkpoints", "GPT", "GPTConfig"]
