"""Which lineage runs a checkpoint came from, read from its pipeline run's lineage log.

The event-triggered flows (flows/triggers.py) run apart from the pretrain flow: a checkpoint event
names a checkpoint and nothing else. The run's own record, `<run dir>/lineage.jsonl`, says which
torchrun job run trains (or trained) it and which root flow run that job belongs to; the triggered
runs name that training run as their parent (the run whose event spawned them) and its root as
theirs, so the graph ties them to the training run and the pipeline run.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.core.storage import is_remote, lineage_name, uri_lineage_name
from tasks.lineage.emitter import JobRef
from tasks.lineage.facets import CrucibleSourceDatasetFacet, source_entries
from tasks.lineage.signed import signed_lines


@dataclass(frozen=True)
class TrainingRun:
    """The torchrun job run of a checkpoint, the root run above it, and the raw sources of what it
    trained on (the crucible_source facets of its inputs: the checkpoint's licences while training
    still runs and its COMPLETE, which lists the checkpoints, is not written yet)."""

    run: JobRef | None = None
    root: JobRef | None = None
    sources: CrucibleSourceDatasetFacet | None = None


def _events(log_path: str | Path):
    """The log's signed events: a line a writer of the run directory appended (naming any run as the
    checkpoint's parent, or any licence) is refused. A URI (an object-store run's log) is read there:
    made a Path, "s3://" would name no file."""
    try:
        for _, event in signed_lines(log_path):
            yield event
    except FileNotFoundError:
        return


def _is_training(event: dict) -> bool:
    job_type = ((event.get("job") or {}).get("facets") or {}).get("jobType") or {}
    return job_type.get("integration") == "TORCH"


def training_run_of(log_path: str | Path, checkpoint: str | Path) -> TrainingRun:
    """The training run that wrote `checkpoint`: the torchrun run whose COMPLETE lists it, else the
    newest torchrun run started (training still running). An empty TrainingRun when the log has none."""
    ckpt = str(checkpoint) if is_remote(checkpoint) else str(Path(checkpoint).resolve())
    # an object-store run's checkpoint (its URI, or its place in the working copy) is named by its key
    named = uri_lineage_name(ckpt) if is_remote(ckpt) else lineage_name(ckpt)
    names = {ckpt} if named is None else {ckpt, named[1]}
    starts: dict[str, dict] = {}
    producer = None
    for event in _events(log_path):
        if not _is_training(event):
            continue
        run_id = event["run"]["runId"]
        if event.get("eventType") == "START":
            starts[run_id] = event
        elif any(o.get("name") in names for o in event.get("outputs") or []):
            producer = run_id
    if not starts:
        return TrainingRun()
    start = starts.get(producer) or list(starts.values())[-1]
    parent = (start["run"].get("facets") or {}).get("parent") or {}
    root = parent.get("root") or {}
    root_ref = JobRef(root["job"]["name"], root["run"]["runId"]) if root.get("run") else None
    entries = [e for ds in start.get("inputs") or []
               for e in source_entries((ds.get("facets") or {}).get("crucible_source"))]
    return TrainingRun(JobRef(start["job"]["name"], start["run"]["runId"]), root_ref,
                       CrucibleSourceDatasetFacet.union(entries))
