"""Emit OpenLineage run events with the openlineage-python client.

Datasets follow the spec's naming: namespace `file` + absolute path for local files; a registered
model version is `mlflow://<tracking host>` + `models/<name>/<version>`. Each dataset's version facet
is a content hash, so an auditor can tell two artifacts with the same name apart.

Events go to an append-only JSONL file in the run directory (one event per line, each signed:
tasks/lineage/signed.py), the record; with `http_url` also, best effort, to a lineage endpoint
(tasks/lineage/transport.py).

Licences propagate: an input without a `crucible_source` facet gets the one its producer recorded
in the same log, and an output without one gets the union of its inputs' raw sources. So every
artifact downstream of the raw files (curated shards, tokenizer, token shards, checkpoints, eval
reports, the model version) lists the licences of the raw files it came from.
"""
from __future__ import annotations

import threading
import traceback
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from openlineage.client import OpenLineageClient
from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
from openlineage.client.facet_v2 import (
    BaseFacet,
    DatasetFacet,
    data_quality_metrics_input_dataset,
    dataset_version_dataset,
    error_message_run,
    job_type_job,
    output_statistics_output_dataset,
    parent_run,
    processing_engine_run,
)

from tasks.core import fs
from tasks.core.storage import is_remote, lineage_name, stored, uri_lineage_name
from tasks.lineage.facets import (
    CrucibleSourceDatasetFacet,
    DataQualityMetricsDatasetFacet,
    dataset_ownership,
    documentation,
    file_stats,
    job_documentation,
    job_ownership,
    schema_facet,
    source_code_location,
    source_entries,
)
from tasks.lineage.signed import open_log, verified_line
from tasks.lineage.transport import make_transport


@dataclass(frozen=True)
class JobRef:
    """A job run: the OpenLineage job name and its run id (the Prefect run id when there is one)."""

    name: str
    run_id: str


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def dataset_for_path(path: str | Path, *, rows: int | None = None, n_bytes: int | None = None,
                     source: dict | CrucibleSourceDatasetFacet | None = None, output: bool = False,
                     doc: str | None = None, inspect: bool = True, facets: dict | None = None,
                     version: str | None = None):
    """An Input/OutputDataset for a local file or directory, versioned by its sha256.

    `source`: a registry entry {name, licence, provenance} (a raw file) or a ready facet (e.g. the
    union for a shard). `doc`: what the artifact is (documentation facet). `inspect`: read sizes,
    Parquet schemas and row counts from the file (footer only) for `schema`, `dataQualityMetrics`
    and, on outputs, `outputStatistics`; `rows`/`n_bytes` override what is read. `facets`: more
    dataset facets by name (e.g. a mix's crucible_token_mix). `version`: the dataset version when
    hashing the content is not the way to tell versions apart (default: its sha256). A URI of a store
    (an object-store run's checkpoint, read where it lives) is named as that object and hashed there."""
    path = str(path) if fs.is_remote(path) else Path(path).resolve()
    facets: dict[str, DatasetFacet] = {
        "version": dataset_version_dataset.DatasetVersionDatasetFacet(
            datasetVersion=version or fs.tree_sha256(*stored(path))),
        **(facets or {}),
    }
    if isinstance(source, dict):
        facets["crucible_source"] = CrucibleSourceDatasetFacet.raw(source["name"], source["licence"],
                                                                   source["provenance"])
    elif source is not None:
        facets["crucible_source"] = source
    if fs.is_remote(path):
        found = fs.files(*stored(path)) if inspect else {}
        stats = {"files": len(found), "bytes": sum(found.values())} if found else {}
    else:
        stats = file_stats(path) if inspect and path.exists() else {}
    rows = rows if rows is not None else stats.get("rows")
    n_bytes = n_bytes if n_bytes is not None else stats.get("bytes")
    if stats.get("columns"):
        facets["schema"] = schema_facet(stats["columns"])
    if rows is not None or n_bytes is not None:
        facets["dataQualityMetrics"] = DataQualityMetricsDatasetFacet(
            rowCount=rows, bytes=n_bytes, fileCount=stats.get("files"), columnMetrics={})
    if doc:
        facets["documentation"] = documentation(doc)
    cls = OutputDataset if output else InputDataset
    # a file of a remote run_root's working copy is named as the object it is in the store
    namespace, name = (uri_lineage_name(path) if fs.is_remote(path) else None) or lineage_name(path) or ("file", str(path))
    ds = cls(namespace=namespace, name=name, facets=facets)
    if output and (rows is not None or n_bytes is not None):
        ds.outputFacets = {"outputStatistics": output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(
            rowCount=rows, size=n_bytes, fileCount=stats.get("files"))}
    elif rows is not None:
        ds.inputFacets = {"dataQualityMetrics": data_quality_metrics_input_dataset.DataQualityMetricsInputDatasetFacet(
            rowCount=rows, bytes=n_bytes, columnMetrics={})}
    return ds


def dataset_for_uri(uri: str, storage_options: dict | None = None, *, source: dict | None = None,
                    doc: str | None = None):
    """An InputDataset for a remote file (a raw s3:// source): namespace "s3://bucket", name the key
    (the OpenLineage naming spec), versioned by the store's change stamp (ETag), with its size and
    the source's licence. The object is not read."""
    from tasks.core.fs import file_identity

    _, size, stamp = file_identity(uri, storage_options)
    facets: dict[str, DatasetFacet] = {
        "version": dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=str(stamp or size))}
    if source is not None:
        facets["crucible_source"] = CrucibleSourceDatasetFacet.raw(source["name"], source["licence"],
                                                                   source["provenance"])
    if size is not None:
        facets["dataQualityMetrics"] = DataQualityMetricsDatasetFacet(rowCount=None, bytes=size, fileCount=1,
                                                                      columnMetrics={})
    if doc:
        facets["documentation"] = documentation(doc)
    namespace, name = uri_lineage_name(uri)
    return InputDataset(namespace=namespace, name=name, facets=facets)


def model_version_dataset(tracking_uri: str, model_name: str, version: str | int, content_hash: str,
                          output: bool = True, doc: str | None = None):
    """A registered model version as a dataset: the end point an auditor traces back from."""
    cls = OutputDataset if output else InputDataset
    host = tracking_uri.split("://", 1)[-1].rstrip("/")
    facets: dict[str, DatasetFacet] = {
        "version": dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=content_hash)}
    if doc:
        facets["documentation"] = documentation(doc)
    return cls(namespace=f"mlflow://{host}", name=f"models/{model_name}/{version}", facets=facets)


def served_model_dataset(endpoint: str, model_name: str, version: str | int, doc: str | None = None):
    """The model deployment as an output dataset: namespace the server (scheme://host:port), name
    `models/<name>` (what clients ask for); its version is the registered model version served."""
    from urllib.parse import urlsplit

    from tasks.lineage.facets import CrucibleServingDatasetFacet

    parts = urlsplit(endpoint)
    facets: dict[str, DatasetFacet] = {
        "version": dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=str(version)),
        "crucible_serving": CrucibleServingDatasetFacet(endpoint=endpoint, model_name=model_name,
                                                        model_version=int(version),
                                                        model_uri=f"models:/{model_name}/{version}")}
    if doc:
        facets["documentation"] = documentation(doc)
    return OutputDataset(namespace=f"{parts.scheme}://{parts.netloc}", name=f"models/{model_name}", facets=facets)


def model_version_node(tracking_uri: str, model_name: str, version: str | int) -> str:
    """The lineage node id (Marquez form) of a registered model version."""
    host = tracking_uri.split("://", 1)[-1].rstrip("/")
    return f"dataset:mlflow://{host}:models/{model_name}/{version}"


def file_node(path: str | Path) -> str:
    if is_remote(path):  # an object of a store: the dataset dataset_for_path names
        return "dataset:{}:{}".format(*uri_lineage_name(str(path)))
    return f"dataset:file:{Path(path).resolve()}"


def lineage_page(service_url: str, node_id: str, direction: str = "upstream") -> str:
    """The lineage service's page opened on `node_id` (its graph, detail and trace)."""
    from urllib.parse import urlencode

    return f"{service_url.rstrip('/')}/#{urlencode({'node': node_id, 'direction': direction})}"


@dataclass
class ActiveRun:
    """What a running job collects; outputs are filled in by the job before it completes."""

    job: JobRef
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    run_facets: dict = field(default_factory=dict)  # added to COMPLETE (stats, config, eval results)


class _SourceIndex:
    """crucible_source facets by dataset (namespace, name), read incrementally from the JSONL log."""

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.offset = 0
        self.facets: dict[tuple[str, str], dict] = {}
        self.lock = threading.Lock()

    def refresh(self) -> None:
        with self.lock:
            try:
                with open_log(self.log_path) as f:
                    f.seek(self.offset)
                    data = f.read()
            except FileNotFoundError:
                return
            end = data.rfind(b"\n") + 1  # a line still being written is read next time
            start, self.offset = self.offset, self.offset + end
            for line in data[:end].splitlines():
                # a licence is taken from a signed line only: an appended one could claim any
                event = verified_line(line, f"{self.log_path} (at byte {start})") if line.strip() else None
                start += len(line) + 1
                if event is None:
                    continue
                for ds in (event.get("inputs") or []) + (event.get("outputs") or []):
                    facet = (ds.get("facets") or {}).get("crucible_source")
                    if isinstance(facet, dict) and source_entries(facet):
                        self.facets[(ds.get("namespace"), ds.get("name"))] = facet

    def get(self, namespace: str, name: str) -> dict | None:
        return self.facets.get((namespace, name))


class LineageEmitter:
    def __init__(self, log_path: str | Path, namespace: str, producer: str, *, http_url: str | None = None,
                 http_timeout: float = 5.0, owner: str | None = None):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.producer = producer
        self.owner = owner
        self.http_url = http_url
        self.client = OpenLineageClient(transport=make_transport(self.log_path, http_url, http_timeout))
        self._sources = _SourceIndex(self.log_path)

    def _facet(self, facet: BaseFacet) -> BaseFacet:
        facet._producer = self.producer
        return facet

    def _propagate_sources(self, inputs: list, outputs: list) -> None:
        """Inputs take the crucible_source their producer recorded in this log; outputs without one
        get the union of their inputs' raw sources."""
        self._sources.refresh()
        entries: list[dict] = []
        for ds in inputs:
            facets = ds.facets if ds.facets is not None else {}
            if "crucible_source" not in facets:
                known = self._sources.get(ds.namespace, ds.name)
                if known:
                    facets["crucible_source"] = CrucibleSourceDatasetFacet.union(source_entries(known)) \
                        if known.get("derived") else CrucibleSourceDatasetFacet.raw(
                            known["source"], known["licence"], known.get("provenance", ""))
                    ds.facets = facets
            entries += source_entries(facets.get("crucible_source"))
        union = CrucibleSourceDatasetFacet.union(entries)
        for ds in outputs:
            facets = ds.facets if ds.facets is not None else {}
            if union is not None and "crucible_source" not in facets:
                facets["crucible_source"] = union
            if self.owner and "ownership" not in facets:
                facets["ownership"] = dataset_ownership(self.owner)
            ds.facets = facets

    def emit(self, state: RunState, job: JobRef, *, parent: JobRef | None = None, root: JobRef | None = None,
             inputs: list | None = None, outputs: list | None = None, job_type: str = "TASK",
             error: BaseException | None = None, extra_run_facets: dict | None = None,
             job_doc: str | None = None, code_path: str | None = None, integration: str = "PREFECT",
             engine: tuple[str, str] | None = None) -> RunEvent:
        """One event. `integration` (jobType facet) and `engine` ((name, version), the
        processing_engine facet) default to Prefect, which runs the flows and tasks."""
        engine_name, engine_version = engine or ("prefect", package_version("prefect"))
        run_facets: dict[str, BaseFacet] = {
            "processing_engine": self._facet(processing_engine_run.ProcessingEngineRunFacet(
                version=engine_version, name=engine_name,
                openlineageAdapterVersion=package_version("openlineage-python"))),
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
        job_facets: dict[str, BaseFacet] = {"jobType": self._facet(job_type_job.JobTypeJobFacet(
            processingType="BATCH", integration=integration, jobType=job_type))}
        code = source_code_location(code_path)
        if code is not None:
            job_facets["sourceCodeLocation"] = self._facet(code)
        if job_doc:
            job_facets["documentation"] = self._facet(job_documentation(job_doc))
        if self.owner:
            job_facets["ownership"] = self._facet(job_ownership(self.owner))
        inputs, outputs = list(inputs or []), list(outputs or [])
        self._propagate_sources(inputs, outputs)
        for ds in inputs + outputs:
            for group in ("facets", "inputFacets", "outputFacets"):
                for facet in (getattr(ds, group, None) or {}).values():
                    facet._producer = self.producer
        event = RunEvent(eventType=state, eventTime=_now(), run=Run(runId=job.run_id, facets=run_facets),
                         job=Job(namespace=self.namespace, name=job.name, facets=job_facets),
                         inputs=inputs, outputs=outputs, producer=self.producer)
        self.client.emit(event)
        return event

    @contextmanager
    def run(self, job: JobRef, *, parent: JobRef | None = None, root: JobRef | None = None,
            inputs: list | None = None, job_type: str = "TASK", run_facets: dict | None = None,
            job_doc: str | None = None, code_path: str | None = None, integration: str = "PREFECT",
            engine: tuple[str, str] | None = None) -> Iterator[ActiveRun]:
        """START now; COMPLETE with the collected outputs, or FAIL with the error, at the end.
        `run_facets` go on every event (e.g. crucible_links); the body's `active.run_facets` on
        COMPLETE only."""
        active = ActiveRun(job=job, inputs=list(inputs or []))
        common = dict(parent=parent, root=root, job_type=job_type, job_doc=job_doc, code_path=code_path,
                      integration=integration, engine=engine)
        self.emit(RunState.START, job, inputs=active.inputs, extra_run_facets=run_facets, **common)
        try:
            yield active
        except BaseException as e:
            self.emit(RunState.FAIL, job, inputs=active.inputs, outputs=active.outputs, error=e,
                      extra_run_facets=run_facets, **common)
            raise
        self.emit(RunState.COMPLETE, job, inputs=active.inputs, outputs=active.outputs,
                  extra_run_facets={**(run_facets or {}), **active.run_facets}, **common)


def new_run_id() -> str:
    return str(uuid.uuid4())


@lru_cache(maxsize=8)
def package_version(distribution: str) -> str:
    """The installed version of a distribution, read from its metadata (the package is not imported)."""
    from importlib.metadata import version

    return version(distribution)
