"""Loss-spike detection (PaLM recipe): skip a spiking batch; on a persistent spike, roll back.

A step is a spike when its loss or its grad norm (before clipping) exceeds mean + k * std of the
last `window` healthy steps (std floored at 2% of the mean, so a flat window does not make every
small wobble a spike). Detection starts after `min_history` healthy steps. Every rank computes the
same decision from the same all-reduced loss and the same (DDP-synchronised) grad norm.

The state is a plain dict, saved in each checkpoint's JSON, so a resumed run decides as the
uninterrupted one would.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class SpikeDetector:
    window: int = 20
    min_history: int = 5
    sigma: float = 6.0
    rollback_after: int = 3
    losses: deque = field(default_factory=deque)
    grad_norms: deque = field(default_factory=deque)
    consecutive: int = 0
    streak_start: int | None = None  # loader position (global sample) where the current streak began
    streak_first_step: int | None = None

    def _threshold(self, values: deque) -> float | None:
        if len(values) < self.min_history:
            return None
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        return mean + self.sigma * max(std, 0.02 * abs(mean))

    def check(self, loss: float, grad_norm: float) -> dict | None:
        """None when healthy, else {"reason", "loss", "grad_norm", "loss_threshold", "grad_threshold"}."""
        lt, gt = self._threshold(self.losses), self._threshold(self.grad_norms)
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
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        while len(self.losses) > self.window:
            self.losses.popleft()
            self.grad_norms.popleft()
        self.consecutive, self.streak_start, self.streak_first_step = 0, None, None

    def spiked(self, step: int, position: int) -> bool:
        """Record a spike at `step` whose batch began at loader `position`; True when persistent."""
        if self.consecutive == 0:
            self.streak_start, self.streak_first_step = position, step
        self.consecutive += 1
        return self.consecutive >= self.rollback_after

    def state(self) -> dict:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms),
                "consecutive": self.consecutive, "streak_start": self.streak_start,
                "streak_first_step": self.streak_first_step}

    def load(self, state: dict) -> None:
        self.losses = deque(state.get("losses", []))
        self.grad_norms = deque(state.get("grad_norms", []))
        self.consecutive = state.get("consecutive", 0)
        self.streak_start = state.get("streak_start")
        self.streak_first_step = state.get("streak_first_step")
