"""A pipeline run's identity and bookkeeping: run directory, MLflow parent run, root lineage run,
per-stage timings and the JSON summary. Plain Python; the pretrain flow uses it."""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from pydantic import BaseModel

from tasks.config import PipelineConfig
from tasks.lineage import JobRef, LineageEmitter
from tasks.tracking import Tracker


class RunContext(BaseModel):
    """Everything a stage needs to know about the pipeline run it belongs to."""

    run_name: str
    run_dir: str
    lineage_log: str
    tracking_uri: str
    experiment: str
    mlflow_parent_run_id: str
    root_run_id: str  # the pretrain flow run id (= its OpenLineage run id)
    root_job: str = "pretrain"
    prefect_ui_url: str | None = None

    def emitter(self, cfg: PipelineConfig) -> LineageEmitter:
        return LineageEmitter(self.lineage_log, cfg.lineage.namespace, cfg.lineage.producer)

    def stage_dir(self, stage: str) -> Path:
        path = Path(self.run_dir) / stage
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def root(self) -> JobRef:
        return JobRef(self.root_job, self.root_run_id)


def default_tracking_uri(cfg: PipelineConfig) -> str:
    """The stack's MLflow server when `crucible run` set one, else a SQLite store beside the runs."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    root = Path(cfg.run_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def prefect_ui_url(flow_run_id: str) -> str | None:
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    ui = PREFECT_UI_URL.value() or (PREFECT_API_URL.value() or "").removesuffix("/api")
    return f"{ui.rstrip('/')}/runs/flow-run/{flow_run_id}" if ui else None


def new_run_name(cfg: PipelineConfig) -> str:
    return f"{cfg.name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S-%f}"


def open_run(cfg: PipelineConfig, run_name: str | None = None) -> RunContext:
    """Create the run directory and the MLflow parent run; called inside the pretrain flow."""
    from prefect.runtime import flow_run

    run_name = run_name or new_run_name(cfg)
    run_dir = (Path(cfg.run_root) / run_name).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    tracking_uri = default_tracking_uri(cfg)
    tracker = Tracker(tracking_uri, experiment=cfg.name)
    parent = tracker.start_run(run_name, tags={"crucible.prefect_flow_run_id": flow_run.id})
    tracker.log_params(parent, cfg.model_dump(mode="json"))
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    return RunContext(run_name=run_name, run_dir=str(run_dir), lineage_log=str(run_dir / "lineage.jsonl"),
                      tracking_uri=tracking_uri, experiment=cfg.name, mlflow_parent_run_id=parent,
                      root_run_id=flow_run.id, prefect_ui_url=prefect_ui_url(flow_run.id))


class Summary:
    """The run's JSON summary: status, links, per-stage counts and timings."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.stages: dict = {}
        self.status = "RUNNING"
        self.error: str | None = None

    def record(self, **stages: dict | list) -> None:
        self.stages.update(stages)

    def timings(self) -> dict[str, float]:
        out = {}
        for name, result in self.stages.items():
            if isinstance(result, list):
                out[name] = round(sum(r.get("seconds", 0.0) for r in result), 3)
            elif isinstance(result, dict) and "seconds" in result:
                out[name] = result["seconds"]
        return out

    def as_dict(self) -> dict:
        s = self.stages
        stages = dict(s)
        if isinstance(s.get("evaluate"), list):
            evals = s["evaluate"]
            stages["evaluate"] = {"checkpoints": evals, "best": min(evals, key=lambda e: e["val_loss"], default=None)}
        return {
            "status": self.status,
            "error": self.error,
            "run_name": self.ctx.run_name,
            "flow_run_id": self.ctx.root_run_id,
            "prefect_ui_url": self.ctx.prefect_ui_url,
            "run_dir": self.ctx.run_dir,
            "mlflow": {"tracking_uri": self.ctx.tracking_uri, "experiment": self.ctx.experiment,
                       "run_id": self.ctx.mlflow_parent_run_id},
            "lineage_log": self.ctx.lineage_log,
            "stages": stages,
            "timings_s": self.timings(),
        }


def timings_markdown(summary: dict) -> str:
    rows = "\n".join(f"| {k} | {v:.1f} |" for k, v in summary["timings_s"].items())
    total = sum(summary["timings_s"].values())
    return f"# Stage timings — {summary['run_name']}\n\n| stage | seconds |\n|---|---|\n{rows}\n| **total** | {total:.1f} |\n"


@contextmanager
def pretrain_scope(cfg: PipelineConfig, ctx: RunContext) -> Iterator[Summary]:
    """Root lineage run + MLflow parent run status + summary file + Prefect timing artifact."""
    from prefect.artifacts import create_markdown_artifact

    summary = Summary(ctx)
    tracker = Tracker(ctx.tracking_uri, ctx.experiment)
    t0 = time.perf_counter()
    try:
        with ctx.emitter(cfg).run(ctx.root, job_type="FLOW"):
            yield summary
    except BaseException as e:
        summary.status, summary.error = "FAILED", f"{type(e).__name__}: {e}"
        tracker.end_run(ctx.mlflow_parent_run_id, "FAILED")
        raise
    finally:
        data = summary.as_dict()
        (Path(ctx.run_dir) / "summary.json").write_text(json.dumps(data, indent=2, default=str))
    summary.status = "COMPLETED"
    data = summary.as_dict()
    (Path(ctx.run_dir) / "summary.json").write_text(json.dumps(data, indent=2, default=str))
    tracker.log_metrics(ctx.mlflow_parent_run_id, {f"time_s.{k}": v for k, v in data["timings_s"].items()})
    tracker.log_metrics(ctx.mlflow_parent_run_id, {"time_s.total": time.perf_counter() - t0})
    tracker.log_dict(ctx.mlflow_parent_run_id, data, "summary.json")
    tracker.end_run(ctx.mlflow_parent_run_id)
    create_markdown_artifact(key="stage-timings", markdown=timings_markdown(data),
                             description="Seconds per stage of this pretrain run")
