"""One Prefect task for every registered stage (tasks/registry.py).

`run_stage_task(name, cfg, run, inputs)` runs the stage as its own Prefect task; around `Stage.run` it adds what every stage gets:
- an MLflow run nested under the pipeline's parent run: the stage's numeric results as metrics,
  `dropped.*` counts, its JSON record, its wall time, its energy, CO2e and cost (`energy.*`,
  tasks/core/energy.py: the stage's process tree, also as the crucible_energy run facet);
- OpenLineage START and COMPLETE/FAIL for the task run (Prefect's task-run id is the OpenLineage
  run id; the parent facet names the enclosing flow run; `crucible_links` names the MLflow run and
  the Prefect runs), with the stage's real input and output files, its resolved config sections,
  counts and evaluation results as run facets;
- the stage's reports as Prefect artifacts, a progress artifact while it runs, and, when the
  lineage service is up, a link artifact to the lineage page of the stage's main output.
"""
from __future__ import annotations

import inspect
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run

from flows.artifacts import publish_quietly, stage_progress
from flows.run_context import RunContext, create_lineage_link
from tasks.config import PipelineConfig
from tasks.core.constants import REPO_ROOT
from tasks.core.energy import EnergyMeter, measure_energy
from tasks.core.layout import RunLayout
from tasks.core.sections import stage_config, stage_sections
from tasks.core.stage import Stage, StageContext, StageInputs, StageResult
from tasks.core.storage import push_path
from tasks.lineage import JobRef
from tasks.lineage.emitter import LineageEmitter
from tasks.lineage.facets import (CrucibleConfigRunFacet, CrucibleEnergyRunFacet, CrucibleEvalRunFacet,
                                  CrucibleLinksRunFacet, CrucibleStatsRunFacet)
from tasks.registry import FLOW_DOCS, STAGES
from tasks.tracking import Tracker

FLOWS_CODE = "flows/pretrain.py"
TRAIN_WORKER = "flows.train_worker"  # the torchrun entry that also emits Prefect checkpoint events


@dataclass
class StageLineage:
    """The stage run's lineage handle: the torchrun job parents its own run to it."""
    emitter: LineageEmitter
    job: JobRef
    root: JobRef
    links: CrucibleLinksRunFacet


def current_flow() -> JobRef:
    return JobRef(flow_run.flow_name, flow_run.id)


@contextmanager
def flow_lineage(cfg: PipelineConfig, run: RunContext) -> Iterator[None]:
    """START/COMPLETE for a subflow run, parented to the pretrain flow run."""
    flow = current_flow()
    links = run.links(mlflow_run_id=run.mlflow_parent_run_id, flow_run_id=flow.run_id)
    with run.emitter(cfg).run(flow, parent=run.root, root=run.root, job_type="FLOW",
                              run_facets={"crucible_links": links}, job_doc=FLOW_DOCS.get(flow.name),
                              code_path=FLOWS_CODE):
        yield


@contextmanager
def stage_energy(cfg: PipelineConfig, layout: RunLayout, stage: str, active) -> Iterator[EnergyMeter | None]:
    """Measure the block's energy (tasks/core/energy.py: the process tree's) into the run's energy.jsonl
    and the lineage run's crucible_energy facet (`active`: the emitter's open run); yields the meter,
    None with energy.enabled off. The stage tasks and the event-triggered flows measure through it."""
    with measure_energy(cfg, layout.energy_log, stage) as meter:
        yield meter
    if meter:
        active.run_facets["crucible_energy"] = CrucibleEnergyRunFacet.of(meter.record)


def code_path(stage: Stage) -> str:
    """The file defining the stage (the lineage job's sourceCodeLocation)."""
    path = Path(inspect.getsourcefile(type(stage))).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def run_facets(cfg: PipelineConfig, stage: Stage, data: dict) -> dict:
    """Custom run facets auditors read: the config sections the stage was given (its run signature's), its
    counts, eval results."""
    dumped = cfg.model_dump(mode="json")
    facets: dict[str, Any] = {"crucible_config": CrucibleConfigRunFacet(
        config={k: dumped[k] for k in stage_sections(stage)})}
    if "docs_in" in data:
        facets["crucible_stats"] = CrucibleStatsRunFacet(stage=stage.name, docs_in=data["docs_in"],
                                                         docs_out=data["docs_out"], dropped=data.get("dropped", {}))
    if stage.name == "evaluate":
        facets["crucible_eval"] = CrucibleEvalRunFacet(val_loss=data["val_loss"], perplexity=data["perplexity"],
                                                       step=data["step"])
    return facets


def serve_model(cfg: PipelineConfig, checkpoint_dir: str | Path, tokenizer_path: str | Path, model_name: str,
                version: int | None = None, tracking_uri: str | None = None) -> dict:
    """How a deploy stage run by a flow serves a model: the stack's model-server supervisor."""
    from infra.services.model_server.supervisor import serve_model as supervise

    return supervise(cfg, checkpoint_dir, tokenizer_path, model_name, version, tracking_uri)


def verify_model(cfg: PipelineConfig, checkpoint_dir: str | Path, tokenizer_path: str | Path, model_name: str,
                 version: int | None = None, tracking_uri: str | None = None) -> str:
    """How a deploy stage verifies a challenger: a temporary model server of its own."""
    from infra.services.model_server.supervisor import verify_model as verify

    return verify(cfg, checkpoint_dir, tokenizer_path, model_name, version, tracking_uri)


def model_server_status(cfg: PipelineConfig):
    """A `() -> {url, pid, healthy} | None` for the stack's model server of this config."""
    def status() -> dict | None:
        from infra.services.model_server.supervisor import server_status

        return server_status(cfg.stack)
    return status


def with_stack(fn, cfg: PipelineConfig):
    """`fn` (serve_model, verify_model) given the run's whole config in place of the deploy stage's,
    which withholds the stack's sections the model-server supervisor reads (tasks/core/sections.py)."""
    return lambda _stage_cfg, *args, **kwargs: fn(cfg, *args, **kwargs)


def stage_context(stage: Stage, cfg: PipelineConfig, run: RunContext, mlflow_run_id: str,
                  lineage: StageLineage) -> StageContext:
    return StageContext(layout=run.layout, run_name=run.run_name, tracking_uri=run.tracking_uri,
                        experiment=run.experiment, mlflow_run_id=mlflow_run_id, triggered=run.triggered,
                        progress=lambda unit: stage_progress(stage.name, unit), serve_model=with_stack(serve_model, cfg),
                        verify_model=with_stack(verify_model, cfg), model_server_status=model_server_status(cfg),
                        lineage=lineage, lineage_namespace=cfg.lineage.namespace, worker_module=TRAIN_WORKER)


@task(name="stage", cache_policy=NO_CACHE, persist_result=False)
def run_stage(name: str, cfg: PipelineConfig, run: RunContext, inputs: StageInputs) -> StageResult:
    stage = STAGES[name]
    tracker = Tracker(run.tracking_uri, run.experiment)
    mlflow_run = tracker.start_run(stage.name, parent_run_id=run.mlflow_parent_run_id,
                                   tags={"crucible.stage": stage.name, "crucible.run_name": run.run_name})
    links = run.links(mlflow_run_id=mlflow_run, flow_run_id=flow_run.id, task_run_id=task_run.id)
    lineage = StageLineage(run.emitter(cfg), JobRef(f"{flow_run.flow_name}.{task_run.task_name}", task_run.id),
                           run.root, links)
    collecting = collects(stage, run)  # the triggered flows do the work: a job of its own, inputs as read
    given = stage_config(stage, cfg)  # only the sections its run signature names
    t0 = time.perf_counter()
    try:
        with lineage.emitter.run(lineage.job, parent=current_flow(), root=run.root,
                                 inputs=[] if collecting else stage.input_datasets(given, inputs),
                                 run_facets={"crucible_links": links}, code_path=code_path(stage),
                                 job_doc=collecting[1] if collecting else stage.doc) as active:
            with stage_energy(cfg, run.layout, stage.name, active) as energy:
                result = stage.run(given, inputs, stage_context(stage, cfg, run, mlflow_run, lineage))
            active.inputs.extend(result.inputs)
            active.outputs.extend(result.outputs)
            active.run_facets.update(run_facets(cfg, stage, result.data))
            if energy:  # energy.enabled
                result.data["energy"] = energy.record
    except BaseException as e:
        tracker.end_run(mlflow_run, "FAILED")
        publish_quietly(getattr(e, "reports", []))  # e.g. the tokenizer's failing validation report
        raise
    data = result.data
    data["seconds"] = round(time.perf_counter() - t0, 3)
    data["mlflow_run_id"] = mlflow_run
    tracker.log_metrics(mlflow_run, {k: v for k, v in data.items() if isinstance(v, (int, float))})
    tracker.log_metrics(mlflow_run, {f"dropped.{k}": v for k, v in data.get("dropped", {}).items()})
    tracker.log_metrics(mlflow_run, {f"energy.{k}": v for k, v in data.get("energy", {}).items()
                                     if isinstance(v, (int, float))})
    tracker.log_dict(mlflow_run, data, f"{stage.name}.json")
    tracker.log_datasets(mlflow_run, active.inputs, active.outputs, node=node_of, page=run.lineage_page)
    tracker.end_run(mlflow_run)
    push_path(run.layout.run_dir)  # a remote run_root: the stage's files reach the store as it completes
    publish_quietly(result.reports)
    primary = result.primary or (node_of(result.outputs[0]) if result.outputs else None)
    if primary:
        label = primary.split(":models/", 1)[1] if ":models/" in primary else primary.rsplit("/", 1)[-1]
        create_lineage_link(run, primary, f"the {stage.name} output {label}")
    return result


def node_of(dataset) -> str:
    return f"dataset:{dataset.namespace}:{dataset.name}"


def collects(stage: Stage, run: RunContext) -> tuple[str, str] | None:
    """(task, doc) when this stage only collects what the stack's event-triggered flows did, else None."""
    return stage.collect if run.triggered else None


def run_stage_task(name: str, cfg: PipelineConfig, run: RunContext, inputs: StageInputs | None = None) -> StageResult:
    """Run stage `name` as its Prefect task, named as the registry says (the lineage job is `<flow>.<task>`);
    a stage that only collects the triggered flows' results is named for that (Stage.collect)."""
    collecting = collects(STAGES[name], run)
    task_name = collecting[0] if collecting else STAGES[name].task
    return run_stage.with_options(name=task_name)(name, cfg, run, inputs or StageInputs())
