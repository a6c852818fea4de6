"""Learning rate schedules, by optimizer step (1-based: the first update is step 1).

- cosine: linear warmup to lr, then cosine decay to min_lr at max_steps.
- wsd (warmup-stable-decay, as MiniCPM / "Scaling Laws and Compute-Optimal Training Beyond Fixed
  Training Durations"): linear warmup, lr held constant, then in the last wsd_decay_fraction of
  max_steps a decay to min_lr, linear or 1 - sqrt(progress).

With a batch-size ramp (train.batch_ramp_start_tokens, tasks/train/batch_ramp.py) the early steps
are smaller, so the warm-up is counted in tokens instead of steps: it spans warmup_steps x the full
batch's tokens (what it spans without a ramp), rising as lr x (tokens trained through the step) /
those tokens, until it meets the decay, which stays counted in steps (so max_steps and a WSD
decay_start keep their meaning): lr = min(token warm-up, decay by step). It is continuous, and a
function of (step, tokens) alone, so a resume on another layout continues it. Without a ramp `lr_at`
is unchanged (and equals the token form: tokens = step x batch gives the same values).
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


def schedule_record(tcfg: TrainConfig, batch_ramp: dict | None = None) -> dict:
    """What a checkpoint records of its run's schedule (a continued cycle finds a WSD champion's
    pre-decay checkpoint with it). `batch_ramp`: the ramp's state (BatchRamp.record), from which a
    resumed run continues it."""
    record = {"lr_schedule": tcfg.lr_schedule, "max_steps": tcfg.max_steps, "warmup_steps": tcfg.warmup_steps,
              "lr": tcfg.lr, "wsd_decay_fraction": tcfg.wsd_decay_fraction,
              "decay_start": wsd_decay_start(tcfg.lr_schedule, tcfg.max_steps, tcfg.warmup_steps,
                                             tcfg.wsd_decay_fraction)}
    if batch_ramp is not None:
        record["batch_ramp"] = batch_ramp
    return record


def lr_at(step: int, tcfg: TrainConfig, tokens: int | None = None, full_batch_tokens: int | None = None) -> float:
    """Learning rate for optimizer step `step` (1-based: the first update is step 1). With a batch
    ramp give `tokens`, the tokens trained through this step, and `full_batch_tokens`: the warm-up
    then follows the tokens (module docstring)."""
    if tokens is not None:
        warm = tcfg.lr * tokens / (tcfg.warmup_steps * full_batch_tokens) if tcfg.warmup_steps else math.inf
        return min(warm, _after_warmup(max(step, tcfg.warmup_steps), tcfg))
    if tcfg.warmup_steps and step <= tcfg.warmup_steps:
        return tcfg.lr * step / tcfg.warmup_steps
    return _after_warmup(step, tcfg)


def _after_warmup(step: int, tcfg: TrainConfig) -> float:
    """The schedule from the last warm-up step on (the peak lr there)."""
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
