"""A pipeline run's identity and bookkeeping: run directory, MLflow parent run, root lineage run,
per-stage timings and the JSON summary, as the pretrain and ablate flows open and close it.

Lineage: events always go to `<run dir>/lineage.jsonl`; also over HTTP to `lineage.http_url` or,
when that is unset, to the lineage service named by $CRUCIBLE_LINEAGE_URL (`crucible run` sets it
to the stack's service), unless `lineage.http_enabled` is false."""
from __future__ import annotations

import json
import logging
import os
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from pydantic import BaseModel

from flows import prefect_ui_base
from tasks.config import PipelineConfig
from tasks.core.constants import LINEAGE_URL_ENV
from tasks.core.energy import read_log, run_energy
from tasks.core.layout import RunLayout
from tasks.core.storage import local_run_root, push_path, run_uri, store_for
from tasks.dedup.index import check_index_store
from tasks.lineage import JobRef, LineageEmitter
from tasks.lineage.emitter import lineage_page, model_version_node
from tasks.lineage.facets import CrucibleLinksRunFacet
from tasks.registry import FLOW_DOCS
from tasks.tracking import Tracker
from tasks.tracking.links import mlflow_run_page, prefect_page

log = logging.getLogger("crucible.lineage")

# the file defining each root flow (the lineage job's sourceCodeLocation)
ROOT_FLOW_CODE = {"pretrain": "flows/pretrain.py", "continue-pretraining": "flows/continued.py",
                  "curation": "flows/curation.py",
                  "ablate": "flows/ablate.py"}


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
    mlflow_experiment_id: str | None = None
    lineage_url: str | None = None  # where events also go over HTTP (None: the JSONL log only)
    lineage_service_url: str | None = None  # Crucible's lineage service, when it receives the events
    # the stack's worker runs the event-triggered flows that evaluate and deploy the checkpoints
    # (flows/triggers.py); the pretrain flow then waits for their results instead of doing the work twice
    triggered: bool = False

    def emitter(self, cfg: PipelineConfig) -> LineageEmitter:
        return lineage_emitter(cfg, self.lineage_log, self.lineage_url)

    def links(self, *, mlflow_run_id: str | None, flow_run_id: str | None,
              task_run_id: str | None = None) -> CrucibleLinksRunFacet:
        """The crucible_links run facet: this run in MLflow and in Prefect."""
        return run_links(self.tracking_uri, self.experiment, self.mlflow_experiment_id, mlflow_run_id=mlflow_run_id,
                         flow_run_id=flow_run_id, task_run_id=task_run_id)

    def lineage_page(self, node_id: str) -> str | None:
        """Link to the lineage service's page of a node, if the service is receiving this run."""
        return lineage_page(self.lineage_service_url, node_id) if self.lineage_service_url else None

    @property
    def layout(self) -> RunLayout:
        return RunLayout(Path(self.run_dir))

    @property
    def root(self) -> JobRef:
        return JobRef(self.root_job, self.root_run_id)


def lineage_emitter(cfg: PipelineConfig, lineage_log: str | Path, http_url: str | None) -> LineageEmitter:
    """The emitter of a pipeline run's events: its JSONL log, and `http_url` (None: the log only)."""
    return LineageEmitter(lineage_log, cfg.lineage.namespace, cfg.lineage.producer, http_url=http_url,
                          http_timeout=cfg.lineage.http_timeout, owner=cfg.lineage.owner)


def run_links(tracking_uri: str, experiment: str, experiment_id: str | None, *, mlflow_run_id: str | None,
              flow_run_id: str | None, task_run_id: str | None = None) -> CrucibleLinksRunFacet:
    """The crucible_links run facet: a run in MLflow (its page when the tracking server is HTTP and
    the experiment id known) and in Prefect."""
    ui = prefect_ui_base()
    return CrucibleLinksRunFacet(
        mlflow_run_id=mlflow_run_id, mlflow_run_url=mlflow_run_page(tracking_uri, experiment_id, mlflow_run_id),
        mlflow_experiment=experiment, prefect_flow_run_id=flow_run_id,
        prefect_flow_run_url=prefect_page(ui, f"/runs/flow-run/{flow_run_id}") if flow_run_id else None,
        prefect_task_run_id=task_run_id,
        prefect_task_run_url=prefect_page(ui, f"/runs/task-run/{task_run_id}") if task_run_id else None)


def default_tracking_uri(cfg: PipelineConfig) -> str:
    """The stack's MLflow server when `crucible run` set one, else a SQLite store beside the runs."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    root = local_run_root(cfg)
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def prefect_ui_url(flow_run_id: str) -> str | None:
    """The flow run's page, through the Prefect UI's login (tasks/tracking/links.py)."""
    return prefect_page(prefect_ui_base(), f"/runs/flow-run/{flow_run_id}")


def lineage_targets(cfg: PipelineConfig) -> tuple[str | None, str | None]:
    """(HTTP target of the events, Crucible lineage service receiving them) for this process:
    lineage.http_url if set, else $CRUCIBLE_LINEAGE_URL; the second only if it is the first."""
    service = (os.environ.get(LINEAGE_URL_ENV) or "").strip().rstrip("/") or None
    if not cfg.lineage.http_enabled:
        return None, None
    target = (cfg.lineage.http_url or "").rstrip("/") or service
    return target, (service if target == service else None)


def new_run_name(cfg: PipelineConfig) -> str:
    return f"{cfg.name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S-%f}"


def open_run(cfg: PipelineConfig, run_name: str | None = None) -> RunContext:
    """Create the run directory and the MLflow parent run; called inside the pretrain flow."""
    from prefect.runtime import flow_run

    from tasks.core.ray_utils import check_ray_address
    from tasks.train.launcher import write_train_config

    check_ray_address(cfg.ray)  # a cluster nobody answers on fails here, before the run directory exists
    # likewise a missing bucket or a refused key, before anything is written
    store = store_for(cfg, check=True)
    check_index_store(cfg)
    run_name = run_name or new_run_name(cfg)
    layout = RunLayout.for_run(cfg.run_root, run_name)
    run_dir = layout.run_dir
    if store is not None and not run_dir.exists():  # a run another machine started: resume from the store
        store.pull_run(layout)
    run_dir.mkdir(parents=True, exist_ok=True)
    tracking_uri = default_tracking_uri(cfg)
    tracker = Tracker(tracking_uri, experiment=cfg.name)
    parent = tracker.start_run(run_name, tags={"crucible.prefect_flow_run_id": flow_run.id})
    tracker.log_params(parent, cfg.model_dump(mode="json"))
    write_train_config(cfg, layout.config_file)  # signed beside it: the Kubernetes TrainJob trains on it
    register_config(cfg, run_dir)
    target, service = lineage_targets(cfg)
    return RunContext(run_name=run_name, run_dir=str(run_dir), lineage_log=str(layout.lineage_log),
                      tracking_uri=tracking_uri, experiment=cfg.name, mlflow_parent_run_id=parent,
                      root_run_id=flow_run.id, prefect_ui_url=prefect_ui_url(flow_run.id),
                      mlflow_experiment_id=tracker.experiment_id, lineage_url=target, lineage_service_url=service)


def register_config(cfg: PipelineConfig, run_dir: str | Path) -> Path | None:
    """With a stack ($CRUCIBLE_STATE_DIR: `crucible run` and the stack's flow runs have it), its signed
    copy of this run's config, the only one its triggered flows use (the run directory's config.json
    is for people; anyone who can write the run directory can change it). None without a stack:
    then no triggered flow runs for this run."""
    from infra import stack

    if not os.environ.get(stack.STATE_DIR_ENV):
        return None
    return stack.register_run_config(cfg.stack, run_dir, cfg.model_dump(mode="json"))


class Summary:
    """The run's JSON summary: status, links, per-stage counts, timings and energy."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.stages: dict = {}
        self.status = "RUNNING"
        self.error: str | None = None
        self.lineage: dict = {"log": ctx.lineage_log, "http_url": ctx.lineage_url,
                              "service_url": ctx.lineage_service_url}

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
            "run_uri": run_uri(self.ctx.run_dir),
            "mlflow": {"tracking_uri": self.ctx.tracking_uri, "experiment": self.ctx.experiment,
                       "experiment_id": self.ctx.mlflow_experiment_id, "run_id": self.ctx.mlflow_parent_run_id,
                       "run_url": mlflow_run_page(self.ctx.tracking_uri, self.ctx.mlflow_experiment_id,
                                                  self.ctx.mlflow_parent_run_id)},
            "lineage_log": self.ctx.lineage_log,
            "lineage": self.lineage,
            "stages": stages,
            "timings_s": self.timings(),
            # kWh, CO2e and cost per stage and in total, the event-triggered flows' stage runs included
            "energy": run_energy(read_log(self.ctx.layout.energy_log)),
        }


def timings_markdown(summary: dict) -> str:
    rows = "\n".join(f"| {k} | {v:.1f} |" for k, v in summary["timings_s"].items())
    total = sum(summary["timings_s"].values())
    return f"# Stage timings — {summary['run_name']}\n\n| stage | seconds |\n|---|---|\n{rows}\n| **total** | {total:.1f} |\n"


def final_output_node(ctx: RunContext, stages: dict) -> str | None:
    """What the run produced, as a lineage node: the model version, else the best checkpoint."""
    deploy = stages.get("deploy") or {}
    if deploy.get("version") is not None and deploy.get("model_name"):
        return model_version_node(ctx.tracking_uri, deploy["model_name"], deploy["version"])
    evals = stages.get("evaluate")
    evals = evals if isinstance(evals, list) else []
    best = min(evals, key=lambda e: e.get("val_loss", float("inf")), default=None)
    from tasks.lineage.emitter import file_node

    return file_node(best["checkpoint"]) if best and best.get("checkpoint") else None  # a store run's: its object


def finish_lineage(ctx: RunContext, stages: dict, missed_before: int = 0) -> dict:
    """After the last event: delivery counts of the HTTP transport; if events were missed while the
    lineage service was down and it is up now, replay the log to it (idempotent there); the page of
    the run's final output. Never raises."""
    from tasks.lineage.transport import endpoint_url, http_stats, service_healthy

    out: dict = {}
    if ctx.lineage_url:
        stats = http_stats(endpoint_url(ctx.lineage_url))
        out["http"] = stats.as_dict()
        missed = stats.missed - missed_before
        if missed > 0 and ctx.lineage_service_url and service_healthy(ctx.lineage_service_url):
            try:
                from tasks.lineage.replay import replay

                out["replayed"] = replay(ctx.lineage_log, ctx.lineage_service_url, timeout=30)
                log.info("lineage service missed %d events; replayed %s", missed, ctx.lineage_log)
            except Exception as e:  # noqa: BLE001 - the JSONL log is complete; replay can be run later
                out["replayed"] = {"error": f"{type(e).__name__}: {e}"}
                log.warning("could not replay %s to %s: %s", ctx.lineage_log, ctx.lineage_service_url, e)
    node = final_output_node(ctx, stages)
    if node:
        out["output_node"] = node
        out["page_url"] = ctx.lineage_page(node)
    return out


def create_lineage_link(ctx: RunContext, node: str | None, what: str, key: str | None = None) -> str | None:
    """A Prefect link artifact on the current flow/task run to the lineage page of `node`, when the
    lineage service is up. Returns the URL (None when no artifact was made). Never raises."""
    page = ctx.lineage_page(node) if node else None
    if not page:
        return None
    from tasks.lineage.transport import service_healthy

    if not service_healthy(ctx.lineage_service_url):
        return None
    try:
        from prefect.artifacts import create_link_artifact

        create_link_artifact(link=page, link_text=f"Lineage of {what}", key=key,
                             description=f"Upstream lineage of {what} in the lineage service: the runs and "
                                         f"artifacts it came from, down to the raw files and their licences.")
    except Exception as e:  # noqa: BLE001 - a missing link must not fail the run
        log.warning("could not create the lineage link artifact: %s", e)
        return None
    return page


@contextmanager
def pretrain_scope(cfg: PipelineConfig, ctx: RunContext) -> Iterator[Summary]:
    """Root lineage run (the pretrain flow's, or the continue-pretraining flow's: ctx.root_job) +
    MLflow parent run status + summary file + Prefect timing artifact and a link artifact to the
    lineage of what the run produced."""
    from prefect.artifacts import create_markdown_artifact

    from tasks.lineage.transport import endpoint_url, http_stats

    summary = Summary(ctx)
    tracker = Tracker(ctx.tracking_uri, ctx.experiment)
    t0 = time.perf_counter()
    missed_before = http_stats(endpoint_url(ctx.lineage_url)).missed if ctx.lineage_url else 0
    links = ctx.links(mlflow_run_id=ctx.mlflow_parent_run_id, flow_run_id=ctx.root_run_id)
    try:
        with ctx.emitter(cfg).run(ctx.root, job_type="FLOW", run_facets={"crucible_links": links},
                                  job_doc=FLOW_DOCS.get(ctx.root_job), code_path=ROOT_FLOW_CODE.get(ctx.root_job)):
            yield summary
    except BaseException as e:
        summary.status, summary.error = "FAILED", f"{type(e).__name__}: {e}"
        tracker.end_run(ctx.mlflow_parent_run_id, "FAILED")
        raise
    finally:
        summary.lineage.update(finish_lineage(ctx, summary.stages, missed_before))
        data = summary.as_dict()
        ctx.layout.summary_file.write_text(json.dumps(data, indent=2, default=str))
        push_path(ctx.layout.run_dir.parent)  # a remote run_root: everything the run wrote, to the store
    summary.status = "COMPLETED"
    deploy = summary.stages.get("deploy") or {}
    what = (f"model {deploy['model_name']} version {deploy['version']}" if deploy.get("version") is not None
            else "the best checkpoint")
    summary.lineage["artifact_url"] = create_lineage_link(ctx, summary.lineage.get("output_node"), what,
                                                          key="lineage-model-version")
    data = summary.as_dict()
    ctx.layout.summary_file.write_text(json.dumps(data, indent=2, default=str))
    push_path(ctx.layout.summary_file)
    tracker.log_metrics(ctx.mlflow_parent_run_id, {f"time_s.{k}": v for k, v in data["timings_s"].items()})
    tracker.log_metrics(ctx.mlflow_parent_run_id, {"time_s.total": time.perf_counter() - t0})
    tracker.log_metrics(ctx.mlflow_parent_run_id,
                        {f"energy.{k}": v for k, v in (data["energy"] or {}).get("total", {}).items()})
    tracker.log_dict(ctx.mlflow_parent_run_id, data, "summary.json")
    tracker.end_run(ctx.mlflow_parent_run_id)
    create_markdown_artifact(key="stage-timings", markdown=timings_markdown(data),
                             description=f"Seconds per stage of this {ctx.root_job} run")


@contextmanager
def ablation_scope(cfg: PipelineConfig, ctx: RunContext) -> Iterator[None]:
    """Root lineage run of the ablate flow and the status of its MLflow parent run."""
    tracker = Tracker(ctx.tracking_uri, ctx.experiment)
    links = ctx.links(mlflow_run_id=ctx.mlflow_parent_run_id, flow_run_id=ctx.root_run_id)
    try:
        with ctx.emitter(cfg).run(ctx.root, job_type="FLOW", run_facets={"crucible_links": links},
                                  job_doc=FLOW_DOCS["ablate"], code_path="flows/ablate.py"):
            yield
    except BaseException:
        tracker.end_run(ctx.mlflow_parent_run_id, "FAILED")
        raise
    tracker.end_run(ctx.mlflow_parent_run_id)
