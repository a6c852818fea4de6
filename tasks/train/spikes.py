"""Loss-spike detection (PaLM recipe): skip a spiking batch; on a persistent spike, roll back, or,
with no checkpoint to roll back to, re-baseline.

A spike is a sharp jump above the recent healthy level, not a drift. For each signal (the loss and
the grad norm before clipping) the baseline is the median of the last `window` healthy steps and
its noise the robust standard deviation (1.4826 x the median absolute deviation), so one healthy
outlier in the window neither drags the baseline nor inflates the noise. A value is a spike when
it exceeds both

    median + sigma * robust std       (statistically far above the recent level)
    median * ratio                    (and a real jump: loss_ratio, grad_ratio)

The second test keeps a flat window (tiny robust std) from turning every wobble into a spike and
lets both signals drift, as they do in early training and after a learning-rate re-warm. The loss
is the main signal (loss_ratio 1.1: healthy demo steps stay within 6 % of the median). The grad
norm alone only flags explosions (grad_ratio 30): small batches give heavy-tailed grad norms
(healthy demo steps reach 5x the median, and bursts of 25x over a few steps that one clipped
update clears), gradient clipping already bounds the update of a large finite gradient, and
skipping cannot clear an anomaly that lives in the weights, since a skip leaves them unchanged. A
non-finite loss or grad norm is always a spike. Detection starts after `min_history` healthy
steps; the comparison is one-sided (a falling loss is never a spike).

Skipped steps do not enter the window, so a level shift (a new regime, not a spike) would be
skipped for ever: after `rollback_after` consecutive spikes the trainer rolls back to a checkpoint
before the streak, or, when it cannot, calls `rebaseline()`, which adopts the streak's values as the
new window; no streak outlasts `rollback_after` steps without an action that says so.

Every rank computes the same decision from the same all-reduced loss and the same (DDP-synchronised)
grad norm: the detector is plain deterministic arithmetic on floats. Its state is a plain dict,
saved in each checkpoint's JSON, so a resumed run decides as the uninterrupted one would.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median

MAD_TO_STD = 1.4826  # the median absolute deviation of a normal distribution is 0.6745 std


@dataclass
class SpikeDetector:
    window: int = 20
    min_history: int = 5
    sigma: float = 6.0
    rollback_after: int = 3
    loss_ratio: float = 1.1
    grad_ratio: float = 30.0
    losses: deque = field(default_factory=deque)  # the last `window` healthy steps
    grad_norms: deque = field(default_factory=deque)
    consecutive: int = 0
    streak_start: int | None = None  # loader position (global sample) where the current streak began
    streak_first_step: int | None = None
    streak: list = field(default_factory=list)  # [loss, grad_norm] of the current streak's steps
    rebaselines: int = 0

    def _threshold(self, values: deque, ratio: float) -> float | None:
        if len(values) < self.min_history:
            return None
        level = median(values)
        robust_std = MAD_TO_STD * median(abs(v - level) for v in values)
        return max(level + self.sigma * robust_std, level * ratio)

    def check(self, loss: float, grad_norm: float) -> dict | None:
        """None when healthy, else {"reason", "loss", "grad_norm", "loss_threshold", "grad_threshold"}."""
        lt, gt = self._threshold(self.losses, self.loss_ratio), self._threshold(self.grad_norms, self.grad_ratio)
        reasons = []
        if not math.isfinite(loss) or (lt is not None and loss > lt):
            reasons.append("loss")
        if not math.isfinite(grad_norm) or (gt is not None and grad_norm > gt):
            reasons.append("grad_norm")
        if not reasons:
            return None
        return {"reason": "+".join(reasons), "loss": loss, "grad_norm": grad_norm,
                "loss_threshold": lt, "grad_threshold": gt}

    def healthy(self, loss: float, grad_norm: float) -> None:
        self._append(loss, grad_norm)
        self._end_streak()

    def spiked(self, step: int, position: int, loss: float | None = None, grad_norm: float | None = None) -> bool:
        """Record a spike at `step` whose batch began at loader `position` (with its loss and grad
        norm, which a re-baseline adopts); True when persistent (`rollback_after` in a row): the
        caller then rolls back or re-baselines."""
        if self.consecutive == 0:
            self.streak_start, self.streak_first_step = position, step
        self.consecutive += 1
        if loss is not None and grad_norm is not None:
            self.streak.append([loss, grad_norm])
        return self.consecutive >= self.rollback_after

    def rebaseline(self) -> dict:
        """Adopt the current streak as the new healthy level: the window restarts from the streak's
        values, and detection resumes once it holds `min_history` steps. Ends the streak; returns
        the new baseline {"loss", "grad_norm"} (medians, None while the window is empty) and the
        count of re-baselines. Raises FloatingPointError when the streak is not finite: a NaN is
        no level to train at."""
        if not all(math.isfinite(v) for values in self.streak for v in values):
            raise FloatingPointError(f"{self.consecutive} consecutive spikes from step {self.streak_first_step} "
                                     f"with a non-finite loss or grad norm, and no checkpoint to roll back to")
        self.losses.clear()
        self.grad_norms.clear()
        for loss, grad_norm in self.streak:
            self._append(loss, grad_norm)
        self._end_streak()
        self.rebaselines += 1
        return {"loss": median(self.losses) if self.losses else None,
                "grad_norm": median(self.grad_norms) if self.grad_norms else None,
                "rebaselines": self.rebaselines}

    def _append(self, loss: float, grad_norm: float) -> None:
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        while len(self.losses) > self.window:
            self.losses.popleft()
            self.grad_norms.popleft()

    def _end_streak(self) -> None:
        self.consecutive, self.streak_start, self.streak_first_step, self.streak = 0, None, None, []

    def state(self) -> dict:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms),
                "consecutive": self.consecutive, "streak_start": self.streak_start,
                "streak_first_step": self.streak_first_step, "streak": [list(v) for v in self.streak],
                "rebaselines": self.rebaselines}

    def load(self, state: dict) -> None:
        self.losses = deque(state.get("losses", []))
        self.grad_norms = deque(state.get("grad_norms", []))
        self.consecutive = state.get("consecutive", 0)
        self.streak_start = state.get("streak_start")
        self.streak_first_step = state.get("streak_first_step")
        self.streak = [list(v) for v in state.get("streak", [])]
        self.rebaselines = state.get("rebaselines", 0)
