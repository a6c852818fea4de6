"""Thin wrapper over MlflowClient so every stage logs the same way.

The client API (not the fluent `mlflow.start_run`) is used on purpose: stages run in Prefect
worker threads and a torchrun subprocess, and explicit run ids cannot get crossed between them.
"""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

PARENT_TAG = "mlflow.parentRunId"
# MLflow 3's UI opens an experiment without this tag in its GenAI view ("Evaluation runs"); these
# are model-training runs
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
MAX_PARAM_LEN = 6000  # MLflow 3 stores params up to 6000 chars


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}} -> {"a.b": "1"}; lists are kept as JSON."""
    out: dict[str, str] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    value = tree if isinstance(tree, str) else json.dumps(tree)
    out[prefix.rstrip(".")] = value[:MAX_PARAM_LEN]
    return out


def local_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """Artifacts of a SQLite store live beside the database file; MLflow's default for a
    database store would be ./mlruns in whatever the current directory is. None (the
    server's choice) for a tracking server."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    db = Path(tracking_uri[len(prefix):]).resolve()
    return (db.parent / "mlartifacts" / experiment).as_uri()


def metric_name(name: str) -> str:
    """`name` with every character MLflow refuses in a metric name (data source names may hold
    any) replaced by "_"."""
    return re.sub(r"[^\w\-. /]", "_", name)


class Tracker:
    def __init__(self, tracking_uri: str, experiment: str):
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(
            experiment, artifact_location=local_artifact_location(tracking_uri, experiment), tags=EXPERIMENT_KIND)
        for key, value in EXPERIMENT_KIND.items():  # an experiment made before the tag existed
            if found and found.tags.get(key) != value:
                self.client.set_experiment_tag(self.experiment_id, key, value)
        self.experiment = experiment

    def start_run(self, name: str, parent_run_id: str | None = None, tags: dict[str, str] | None = None) -> str:
        all_tags = dict(tags or {})
        if parent_run_id:
            all_tags[PARENT_TAG] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        return run.info.run_id

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        items = [Param(k, v) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):  # MLflow batches take at most 100 params
            self.client.log_batch(run_id, params=items[i:i + 100])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        """Finite numbers only; a name is made of what MLflow allows (others become "_")."""
        ts = int(time.time() * 1000)
        items = [Metric(metric_name(k), float(v), ts, step) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i:i + 1000])

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_dict(self, run_id: str, data: dict, artifact_file: str) -> None:
        self.client.log_dict(run_id, data, artifact_file)

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_datasets(self, run_id: str, inputs, outputs, node, page=None) -> None:
        """A stage's lineage input and output datasets as the run's MLflow datasets
        (tasks/tracking/datasets.py); `node(dataset)` names a dataset's lineage node, `page(node)` its page."""
        from tasks.tracking.datasets import dataset_inputs

        logged = dataset_inputs(inputs, outputs, node, page)
        if logged:
            self.client.log_inputs(run_id, datasets=logged)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

