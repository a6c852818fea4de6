"""The torchrun entry the pipeline trains with: the training worker (tasks/train/worker.py) with a
Prefect event sink. The train stage runs it through run_training(..., worker_module="flows.train_worker").

After each published checkpoint rank 0 emits `crucible.checkpoint.saved` (resource
crucible.checkpoint.<run>.<step>; payload path, step, run_id, run_name), which triggers the
evaluate-checkpoint deployment (flows/triggers.py); each loss-spike action emits
`crucible.train.spike`. Events go out only when PREFECT_API_URL is set, and queued ones are
drained before the process exits.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from tasks.core.constants import CHECKPOINT_EVENT, SPIKE_EVENT
from tasks.train import worker


class PrefectEvents:
    """tasks.train.events.EventSink emitting Prefect events (imported only when used: Prefect is
    slow to import, and every rank starts this module)."""

    def checkpoint_saved(self, path: str | Path, step: int, run_id: str | None, run_name: str) -> bool:
        """Emit `crucible.checkpoint.saved` (only when PREFECT_API_URL is set)."""
        if not os.environ.get("PREFECT_API_URL"):
            print(f"[events] PREFECT_API_URL not set: skipping {CHECKPOINT_EVENT} for step {step}", flush=True)
            return False
        from prefect.events import emit_event

        event = emit_event(
            event=CHECKPOINT_EVENT,
            resource={"prefect.resource.id": f"crucible.checkpoint.{run_name}.{step}"},
            payload={"path": str(path), "step": step, "run_id": run_id, "run_name": run_name},
        )
        print(f"[events] {CHECKPOINT_EVENT} step {step}: {'emitted' if event else 'not emitted'}", flush=True)
        return event is not None

    def spike(self, action: str, step: int, run_id: str | None, run_name: str, **details) -> bool:
        """Emit `crucible.train.spike` (only when PREFECT_API_URL is set). action: "skip" (batch
        skipped, no optimizer step), "rollback" (back to a checkpoint, data range skipped) or
        "rebaseline" (persistent spikes with no checkpoint to roll back to: the new level adopted)."""
        if not os.environ.get("PREFECT_API_URL"):
            return False
        try:
            from prefect.events import emit_event

            event = emit_event(
                event=SPIKE_EVENT,
                resource={"prefect.resource.id": f"crucible.train.{run_name}.spike.{step}",
                          "crucible.action": action},
                payload={"action": action, "step": step, "run_id": run_id, "run_name": run_name, **details},
            )
        except Exception as e:  # events are observability; never fail training on them
            print(f"[events] WARNING: {SPIKE_EVENT} failed: {e}", flush=True)
            return False
        print(f"[events] {SPIKE_EVENT} {action} step {step}: {'emitted' if event else 'not emitted'}", flush=True)
        return event is not None

    def drain(self, timeout: float = 10.0) -> None:
        """Wait for queued Prefect events to be sent before the process exits."""
        if not os.environ.get("PREFECT_API_URL"):
            return
        try:
            from prefect.events.worker import EventsWorker

            EventsWorker.drain_all(timeout=timeout)
        except Exception as e:
            print(f"[events] WARNING: draining events failed: {e}", flush=True)


def main(argv: list[str] | None = None) -> int:
    return worker.main(argv, events=PrefectEvents())


if __name__ == "__main__":
    sys.exit(main())
