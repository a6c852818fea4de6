"""Learning rate schedules, by optimizer step (1-based: the first update is step 1).

- cosine: linear warmup to lr, then cosine decay to min_lr at max_steps.
- wsd (warmup-stable-decay, as MiniCPM / "Scaling Laws and Compute-Optimal Training Beyond Fixed
  Training Durations"): linear warmup, lr held constant, then in the last wsd_decay_fraction of
  max_steps a decay to min_lr, linear or 1 - sqrt(progress).
"""
from __future__ import annotations

import math

import torch

from tasks.config import TrainConfig


def wsd_decay_start(lr_schedule: str, max_steps: int, warmup_steps: int, wsd_decay_fraction: float) -> int | None:
    """The last step of a WSD schedule's stable phase (None for another schedule)."""
    if lr_schedule != "wsd":
        return None
    decay_steps = max(1, round(wsd_decay_fraction * max_steps))
    return max(warmup_steps, max_steps - decay_steps)


def schedule_record(tcfg: TrainConfig) -> dict:
    """What a checkpoint records of its run's schedule (a continued cycle finds a WSD champion's
    pre-decay checkpoint with it)."""
    return {"lr_schedule": tcfg.lr_schedule, "max_steps": tcfg.max_steps, "warmup_steps": tcfg.warmup_steps,
            "lr": tcfg.lr, "wsd_decay_fraction": tcfg.wsd_decay_fraction,
            "decay_start": wsd_decay_start(tcfg.lr_schedule, tcfg.max_steps, tcfg.warmup_steps,
                                           tcfg.wsd_decay_fraction)}


def lr_at(step: int, tcfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (1-based: the first update is step 1)."""
    if tcfg.warmup_steps and step <= tcfg.warmup_steps:
        return tcfg.lr * step / tcfg.warmup_steps
    if tcfg.lr_schedule == "wsd":
        decay_start = wsd_decay_start("wsd", tcfg.max_steps, tcfg.warmup_steps, tcfg.wsd_decay_fraction)
        if step <= decay_start:
            return tcfg.lr
        progress = min(1.0, (step - decay_start) / max(1, tcfg.max_steps - decay_start))
        frac = 1.0 - (math.sqrt(progress) if tcfg.wsd_decay_shape == "sqrt" else progress)
        return tcfg.min_lr + frac * (tcfg.lr - tcfg.min_lr)
    decay_steps = tcfg.max_steps - tcfg.warmup_steps
    if decay_steps <= 0:
        return tcfg.lr
    progress = min(1.0, (step - tcfg.warmup_steps) / decay_steps)
    return tcfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (tcfg.lr - tcfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
