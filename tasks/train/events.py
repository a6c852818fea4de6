"""Where the trainer reports checkpoints and loss-spike actions beyond its own logs.

Stage logic stays free of any event system: the Trainer calls an EventSink, by default NoEvents.
The pipeline's torchrun entry (flows/train_worker.py) passes one that emits Prefect events, which
trigger the evaluation of each checkpoint.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol


class EventSink(Protocol):
    def checkpoint_saved(self, path: str | Path, step: int, run_id: str | None, run_name: str) -> bool:
        """A checkpoint is complete and published at `path`; True when an event went out."""

    def spike(self, action: str, step: int, run_id: str | None, run_name: str, **details) -> bool:
        """A loss-spike action: "skip", "rollback" or "rebaseline", with its details."""

    def drain(self) -> None:
        """Wait until queued events are sent (called once, before the process exits)."""


class NoEvents:
    """The default sink: training reports through its logs and MLflow only."""

    def checkpoint_saved(self, path: str | Path, step: int, run_id: str | None, run_name: str) -> bool:
        return False

    def spike(self, action: str, step: int, run_id: str | None, run_name: str, **details) -> bool:
        return False

    def drain(self) -> None:
        pass
