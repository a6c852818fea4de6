"""Emit OpenLineage run events with the openlineage-python client.

Datasets follow the spec's naming: namespace `file` + absolute path for local files; a registered
model version is `mlflow://<tracking host>` + `models/<name>/<version>`. Each dataset's version facet
is a content hash, so an auditor can tell two artifacts with the same name apart.
The default transport is an append-only JSONL file in the run directory (one event per line).
"""
from __future__ import annotations

import traceback
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import attr
from openlineage.client import OpenLineageClient
from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
from openlineage.client.facet_v2 import (
    BaseFacet,
    DatasetFacet,
    RunFacet,
    data_quality_metrics_input_dataset,
    dataset_version_dataset,
    error_message_run,
    job_type_job,
    parent_run,
    processing_engine_run,
)
from openlineage.client.transport.file import FileConfig, FileTransport

from tasks.core.hashing import sha256_tree

CUSTOM_FACET_SCHEMA = "https://github.com/crucible-ml/crucible/blob/main/docs/lineage-facets.md#"


@attr.define
class CrucibleSourceDatasetFacet(DatasetFacet):
    """Licence and provenance of raw data, from the config's source registry."""

    source: str
    licence: str
    provenance: str

    @staticmethod
    def _get_schema() -> str:
        return CUSTOM_FACET_SCHEMA + "crucible_source"


@attr.define
class CrucibleStatsRunFacet(RunFacet):
    """Documents in/out of a stage and the documents each filter dropped."""

    stage: str
    docs_in: int
    docs_out: int
    dropped: dict = attr.field(factory=dict)

    @staticmethod
    def _get_schema() -> str:
        return CUSTOM_FACET_SCHEMA + "crucible_stats"


@attr.define
class CrucibleConfigRunFacet(RunFacet):
    """The config section a stage ran with."""

    config: dict

    @staticmethod
    def _get_schema() -> str:
        return CUSTOM_FACET_SCHEMA + "crucible_config"


@attr.define
class CrucibleEvalRunFacet(RunFacet):
    """Evaluation results of one checkpoint."""

    val_loss: float
    perplexity: float
    step: int

    @staticmethod
    def _get_schema() -> str:
        return CUSTOM_FACET_SCHEMA + "crucible_eval"


@dataclass(frozen=True)
class JobRef:
    """A job run: the OpenLineage job name and its run id (the Prefect run id when there is one)."""

    name: str
    run_id: str


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def dataset_for_path(path: str | Path, *, rows: int | None = None, n_bytes: int | None = None,
                     source: dict | None = None, output: bool = False):
    """An Input/OutputDataset for a local file or directory, versioned by its sha256."""
    path = Path(path).resolve()
    facets: dict[str, DatasetFacet] = {
        "version": dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=sha256_tree(path)),
    }
    if source:
        facets["crucible_source"] = CrucibleSourceDatasetFacet(
            source=source["name"], licence=source["licence"], provenance=source["provenance"])
    cls = OutputDataset if output else InputDataset
    ds = cls(namespace="file", name=str(path), facets=facets)
    if rows is not None and not output:
        ds.inputFacets = {"dataQualityMetrics": data_quality_metrics_input_dataset.DataQualityMetricsInputDatasetFacet(
            rowCount=rows, bytes=n_bytes, columnMetrics={})}
    return ds


def model_version_dataset(tracking_uri: str, model_name: str, version: str | int, content_hash: str,
                          output: bool = True):
    """A registered model version as a dataset: the end point an auditor traces back from."""
    cls = OutputDataset if output else InputDataset
    host = tracking_uri.split("://", 1)[-1].rstrip("/")
    return cls(namespace=f"mlflow://{host}", name=f"models/{model_name}/{version}", facets={
        "version": dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=content_hash)})


@dataclass
class ActiveRun:
    """What a running job collects; outputs are filled in by the job before it completes."""

    job: JobRef
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    run_facets: dict = field(default_factory=dict)  # added to COMPLETE (stats, config, eval results)


class LineageEmitter:
    def __init__(self, log_path: str | Path, namespace: str, producer: str):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.producer = producer
        transport = FileTransport(FileConfig(log_file_path=str(self.log_path), append=True))
        self.client = OpenLineageClient(transport=transport)

    def _facet(self, facet: BaseFacet) -> BaseFacet:
        facet._producer = self.producer
        return facet

    def emit(self, state: RunState, job: JobRef, *, parent: JobRef | None = None, root: JobRef | None = None,
             inputs: list | None = None, outputs: list | None = None, job_type: str = "TASK",
             error: BaseException | None = None, extra_run_facets: dict | None = None) -> RunEvent:
        run_facets: dict[str, BaseFacet] = {
            "processing_engine": self._facet(processing_engine_run.ProcessingEngineRunFacet(
                version=_prefect_version(), name="prefect", openlineageAdapterVersion=_ol_version())),
        }
        if parent is not None:
            root = root or parent
            run_facets["parent"] = self._facet(parent_run.ParentRunFacet(
                run=parent_run.Run(runId=parent.run_id),
                job=parent_run.Job(namespace=self.namespace, name=parent.name),
                root=parent_run.Root(run=parent_run.RootRun(runId=root.run_id),
                                     job=parent_run.RootJob(namespace=self.namespace, name=root.name))))
        for name, facet in (extra_run_facets or {}).items():
            run_facets[name] = self._facet(facet)
        if error is not None:
            run_facets["errorMessage"] = self._facet(error_message_run.ErrorMessageRunFacet(
                message=str(error) or type(error).__name__, programmingLanguage="PYTHON",
                stackTrace="".join(traceback.format_exception(error))[-8000:]))
        job_facets = {"jobType": self._facet(job_type_job.JobTypeJobFacet(
            processingType="BATCH", integration="PREFECT", jobType=job_type))}
        for ds in (inputs or []) + (outputs or []):
            for facet in (ds.facets or {}).values():
                facet._producer = self.producer
            for facet in (getattr(ds, "inputFacets", None) or {}).values():
                facet._producer = self.producer
        event = RunEvent(eventType=state, eventTime=_now(), run=Run(runId=job.run_id, facets=run_facets),
                         job=Job(namespace=self.namespace, name=job.name, facets=job_facets),
                         inputs=inputs or [], outputs=outputs or [], producer=self.producer)
        self.client.emit(event)
        return event

    @contextmanager
    def run(self, job: JobRef, *, parent: JobRef | None = None, root: JobRef | None = None,
            inputs: list | None = None, job_type: str = "TASK") -> Iterator[ActiveRun]:
        """START now; COMPLETE with the collected outputs, or FAIL with the error, at the end."""
        active = ActiveRun(job=job, inputs=list(inputs or []))
        self.emit(RunState.START, job, parent=parent, root=root, inputs=active.inputs, job_type=job_type)
        try:
            yield active
        except BaseException as e:
            self.emit(RunState.FAIL, job, parent=parent, root=root, inputs=active.inputs,
                      outputs=active.outputs, job_type=job_type, error=e)
            raise
        self.emit(RunState.COMPLETE, job, parent=parent, root=root, inputs=active.inputs,
                  outputs=active.outputs, job_type=job_type, extra_run_facets=active.run_facets)


def new_run_id() -> str:
    return str(uuid.uuid4())


@lru_cache(maxsize=1)
def _prefect_version() -> str:
    import prefect

    return prefect.__version__


@lru_cache(maxsize=1)
def _ol_version() -> str:
    from importlib.metadata import version

    return version("openlineage-python")
