"""Learning rate: linear warmup to lr, then cosine decay to min_lr at max_steps."""
from __future__ import annotations

import math

import torch

from tasks.config import TrainConfig


def lr_at(step: int, tcfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (1-based: the first update is step 1)."""
    if tcfg.warmup_steps and step <= tcfg.warmup_steps:
        return tcfg.lr * step / tcfg.warmup_steps
    decay_steps = tcfg.max_steps - tcfg.warmup_steps
    if decay_steps <= 0:
        return tcfg.lr
    progress = min(1.0, (step - tcfg.warmup_steps) / decay_steps)
    return tcfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (tcfg.lr - tcfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
