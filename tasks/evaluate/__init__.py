"""Evaluate stage: val loss / perplexity and sample generations for one checkpoint."""
from tasks.evaluate.evaluate import evaluate_checkpoint, val_loss, val_window_starts

__all__ = ["evaluate_checkpoint", "val_loss", "val_window_starts"]
