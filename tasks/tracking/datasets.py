"""A stage's lineage datasets (OpenLineage Input/OutputDatasets) as MLflow run datasets, so a run's
page lists the data it read and wrote ("Datasets used"), each with the same identity as in the
lineage: its URI, its content hash and its lineage node (and page, when a lineage service has it).

MLflow records datasets as run inputs only; a stage's outputs are logged the same way with the
context `output`, so the stage's run shows what it wrote and the next stage's run shows it again as
an input (context `input`), under the same name and digest. MLflow keeps one dataset per name and
digest in an experiment: the same bytes logged again from another folder (a later run) show the first
source URI, while each run's input tag `crucible.lineage_node` names the file that run used."""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Callable, Iterable

from mlflow.entities import DatasetInput, InputTag
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

LINEAGE_NODE_TAG = "crucible.lineage_node"
LINEAGE_PAGE_TAG = "crucible.lineage_page"
MAX_DIGEST = 36  # MLflow's SQL stores keep a dataset digest in 36 characters
MAX_TAG_VALUE = 500  # ... and an input tag's value in 500


def dataset_uri(namespace: str, name: str) -> str:
    """The URI of an OpenLineage dataset: a local file's file:// URI, else <namespace>/<name>
    (s3://bucket/key, mlflow://host/models/<name>/<version>)."""
    if namespace == "file":
        return Path(name).as_uri()
    return f"{namespace.rstrip('/')}/{name.lstrip('/')}"


def display_name(name: str) -> str:
    """The name a run's page shows: the file and its folder (tokens/train.bin, not the whole path)."""
    return "/".join(name.rstrip("/").split("/")[-2:])


def _facet(dataset, key: str):
    return (getattr(dataset, "facets", None) or {}).get(key)


def content_version(dataset) -> str:
    """The sha256 of a dataset that has no version facet (as tasks/lineage/emitter.py versions a
    local file or directory). Without one MLflow's MetaDataset would make up a digest from the source
    URI, the same for every content: a dataset that is no local path is refused instead."""
    from tasks.core.hashing import sha256_tree

    path = Path(dataset.name)
    if dataset.namespace == "file" and path.exists():
        return sha256_tree(path)
    raise ValueError(f"dataset {dataset_uri(dataset.namespace, dataset.name)} has no version facet and is no "
                     f"local path to hash: its MLflow digest would not be its content hash (give it the "
                     f"version facet, as tasks/lineage/emitter.py's datasets have)")


def mlflow_dataset(dataset, node: str, page: str | None):
    """The MLflow Dataset entity of one lineage dataset: mlflow.data's source for its URI (a
    LocalArtifact/S3 source; MLflow has none for other schemes, which then keep their URI under
    source type `lineage`), the content hash as digest, the lineage identity and sizes as profile."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import Dataset
    from mlflow.exceptions import MlflowException

    uri = dataset_uri(dataset.namespace, dataset.name)
    version = getattr(_facet(dataset, "version"), "datasetVersion", None) or content_version(dataset)
    quality = _facet(dataset, "dataQualityMetrics")
    profile = {"lineage_node": node, "lineage_page": page, "sha256": version,
               "rows": getattr(quality, "rowCount", None), "bytes": getattr(quality, "bytes", None),
               "files": getattr(quality, "fileCount", None)}
    profile = json.dumps({k: v for k, v in profile.items() if v is not None})
    name, digest = display_name(dataset.name), version[:MAX_DIGEST]
    try:
        with warnings.catch_warnings():  # a local path matches two registered local sources, both alike
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(uri)
    except MlflowException:
        return Dataset(name=name, digest=digest, source_type="lineage",
                       source=json.dumps({"uri": uri}), profile=profile)
    entity = MetaDataset(source=source, name=name, digest=digest)._to_mlflow_entity()
    entity._profile = profile
    return entity


def dataset_inputs(inputs: Iterable, outputs: Iterable, node: Callable[[object], str],
                   page: Callable[[str], str | None] | None = None) -> list[DatasetInput]:
    """DatasetInputs for a stage's lineage inputs and outputs (context `input` / `output`), each
    dataset once per context; `node` names a dataset's lineage node, `page` its lineage page."""
    out, seen = [], set()
    for context, datasets in (("input", inputs), ("output", outputs)):
        for ds in datasets:
            node_id = node(ds)
            if (node_id, context) in seen:
                continue
            seen.add((node_id, context))
            link = page(node_id) if page else None
            tags = [InputTag(MLFLOW_DATASET_CONTEXT, context), InputTag(LINEAGE_NODE_TAG, node_id[:MAX_TAG_VALUE])]
            if link and len(link) <= MAX_TAG_VALUE:
                tags.append(InputTag(LINEAGE_PAGE_TAG, link))
            out.append(DatasetInput(mlflow_dataset(ds, node_id, link), tags))
    return out
