"""Marquez-shaped JSON (a compatible subset) built from the store's rows, plus links to the UIs
that hold more detail (MLflow for model versions, Prefect for flow and task runs)."""
from __future__ import annotations

import re
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote

from infra.services.lineage.fastjson import Fragment, dumps_bytes, loads
from infra.services.lineage.store import LineageStore, Walk, node_id


@dataclass(frozen=True)
class Links:
    """Base URLs of the UIs to link to; None: derive what can be derived from the data."""

    prefect_ui_url: str | None = None
    mlflow_ui_url: str | None = None


def _ms(start: str | None, end: str | None) -> int | None:
    if not start or not end:
        return None
    parse = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    return int((parse(end) - parse(start)).total_seconds() * 1000)


def _facet_value(facets: dict, facet: str, key: str) -> Any:
    value = facets.get(facet)
    return value.get(key) if isinstance(value, dict) else None


def dataset_obj(row: sqlite3.Row) -> dict:
    facets = loads(row["facets"])
    schema = facets.get("schema") if isinstance(facets.get("schema"), dict) else {}
    return {
        "id": {"namespace": row["namespace"], "name": row["name"]},
        "type": "DB_TABLE",
        "name": row["name"],
        "physicalName": row["name"],
        "createdAt": row["created_at"],
        "updatedAt": row["updated_at"],
        "namespace": row["namespace"],
        "sourceName": _facet_value(facets, "dataSource", "name") or row["namespace"],
        "fields": [f for f in schema.get("fields", []) if isinstance(f, dict)],
        "tags": [],
        "lastModifiedAt": row["last_modified_at"],
        "lastLifecycleState": _facet_value(facets, "lifecycleStateChange", "lifecycleStateChange"),
        "description": _facet_value(facets, "documentation", "description"),
        "facets": facets,
        "currentVersion": row["current_version"],
        "deleted": False,
    }


def version_obj(row: sqlite3.Row, created_by_run: dict | None = None) -> dict:
    facets = loads(row["facets"])
    return {
        "id": {"namespace": row["namespace"], "name": row["name"], "version": row["version"]},
        "type": "DB_TABLE",
        "name": row["name"],
        "physicalName": row["name"],
        "createdAt": row["created_at"],
        "version": row["version"],
        "namespace": row["namespace"],
        "sourceName": row["namespace"],
        "fields": [],
        "tags": [],
        "description": _facet_value(facets, "documentation", "description"),
        "createdByRun": created_by_run,
        "facets": facets,
    }


def _version_id(io: sqlite3.Row) -> dict:
    return {"namespace": io["namespace"], "name": io["name"], "version": io["version"] or None}


def run_obj(row: sqlite3.Row, io_rows: list[sqlite3.Row] = ()) -> dict:
    inputs = [r for r in io_rows if r["direction"] == "in"]
    outputs = [r for r in io_rows if r["direction"] == "out"]
    return {
        "id": row["run_id"],
        "createdAt": row["created_at"],
        "updatedAt": row["updated_at"],
        "nominalStartTime": row["nominal_start"],
        "nominalEndTime": row["nominal_end"],
        "state": row["state"],
        "startedAt": row["started_at"],
        "endedAt": row["ended_at"],
        "durationMs": _ms(row["started_at"], row["ended_at"]),
        "args": {},
        "jobVersion": {"namespace": row["job_namespace"], "name": row["job_name"], "version": None},
        "inputVersions": [_version_id(r) for r in inputs],
        "outputVersions": [_version_id(r) for r in outputs],
        "inputDatasetVersions": [{"datasetVersionId": _version_id(r), "facets": loads(r["facets"])}
                                 for r in inputs],
        "outputDatasetVersions": [{"datasetVersionId": _version_id(r), "facets": loads(r["facets"])}
                                  for r in outputs],
        "context": {},
        "facets": loads(row["facets"]),
        "parentRunId": row["parent_run_id"],
        "rootRunId": row["root_run_id"],
    }


def job_obj(row: sqlite3.Row, latest_run: dict | None = None, io_rows: list[sqlite3.Row] = ()) -> dict:
    facets = loads(row["facets"])
    return {
        "id": {"namespace": row["namespace"], "name": row["name"]},
        "type": _facet_value(facets, "jobType", "processingType") or "BATCH",
        "name": row["name"],
        "simpleName": row["name"].rsplit(".", 1)[-1],
        "parentJobName": row["parent_name"],
        "createdAt": row["created_at"],
        "updatedAt": row["updated_at"],
        "namespace": row["namespace"],
        "inputs": [{"namespace": r["namespace"], "name": r["name"]} for r in io_rows if r["direction"] == "in"],
        "outputs": [{"namespace": r["namespace"], "name": r["name"]} for r in io_rows if r["direction"] == "out"],
        "location": _facet_value(facets, "sourceCodeLocation", "url"),
        "description": _facet_value(facets, "documentation", "description"),
        "facets": facets,
        "latestRun": latest_run,
        "currentVersion": None,
    }


def io_for_runs(store: LineageStore, run_ids: list[str]) -> dict[str, list[sqlite3.Row]]:
    out: dict[str, list[sqlite3.Row]] = {r: [] for r in run_ids}
    for i in range(0, len(run_ids), 300):
        chunk = run_ids[i:i + 300]
        for row in store.query(f"SELECT * FROM run_io WHERE run_id IN ({', '.join('?' * len(chunk))})"
                               " ORDER BY direction, namespace, name", chunk):
            out[row["run_id"]].append(row)
    return out


def jobs_objs(store: LineageStore, job_rows: list[sqlite3.Row]) -> list[dict]:
    """Jobs with their latest run and that run's inputs/outputs (Marquez's current-version view)."""
    latest_ids = [r["latest_run_id"] for r in job_rows if r["latest_run_id"]]
    runs = store.rows_by_keys("runs", ("run_id",), [(r,) for r in latest_ids])
    io = io_for_runs(store, latest_ids)
    out = []
    for row in job_rows:
        run_row = runs.get((row["latest_run_id"],))
        latest = run_obj(run_row, io.get(row["latest_run_id"], [])) if run_row is not None else None
        out.append(job_obj(row, latest, io.get(row["latest_run_id"], [])))
    return out


# ----------------------------------------------------------------------------------------------
# Links

_URL_KEY = re.compile(r"(url|uri|link|href)$", re.IGNORECASE)
# Readable labels for the URLs of Crucible's crucible_links run facet.
_URL_LABELS = {"crucible_links.mlflow_run_url": "MLflow run", "crucible_links.prefect_flow_run_url": "Prefect flow run",
               "crucible_links.prefect_task_run_url": "Prefect task run"}


def unique_links(links: list[dict]) -> list[dict]:
    """Links in order, each URL once (the first label wins)."""
    seen: set[str] = set()
    out = []
    for link in links:
        if link["url"] not in seen:
            seen.add(link["url"])
            out.append(link)
    return out


def facet_urls(facets: Any, depth: int = 4) -> list[dict]:
    """http(s) URLs found in facets under keys such as `url`, `uiUrl`, `mlflow_run_url`."""
    found: list[dict] = []

    def visit(obj: Any, path: str, level: int) -> None:
        if level > depth:
            return
        if isinstance(obj, dict):
            for k, v in obj.items():
                if k.startswith("_"):
                    continue
                if isinstance(v, str) and _URL_KEY.search(k) and re.match(r"^https?://", v):
                    label = f"{path}{k}".lstrip(".")
                    found.append({"label": _URL_LABELS.get(label, label), "url": v})
                else:
                    visit(v, f"{path}{k}.", level + 1)
        elif isinstance(obj, list):
            for v in obj[:50]:
                visit(v, path, level + 1)

    visit(facets, "", 0)
    return found


def mlflow_model_url(namespace: str, name: str, links: Links) -> str | None:
    """MLflow UI page of a registered model version (`mlflow://host:port` + `models/<name>/<version>`)."""
    if not namespace.startswith("mlflow://"):
        return None
    m = re.match(r"^models/(.+)/([^/]+)$", name)
    if not m:
        return None
    base = links.mlflow_ui_url
    host = namespace[len("mlflow://"):]
    if not base and host and not host.startswith("/"):
        base = f"http://{host}"
    if not base:
        return None
    return f"{base.rstrip('/')}/#/models/{quote(m.group(1), safe='')}/versions/{quote(m.group(2), safe='')}"


def dataset_links(namespace: str, name: str, facets: dict, links: Links) -> list[dict]:
    out = []
    url = mlflow_model_url(namespace, name, links)
    if url:
        out.append({"label": "MLflow model version", "url": url})
    return unique_links(out + facet_urls(facets))


def run_links(run_id: str, job_type: str | None, run_facets: dict, links: Links) -> list[dict]:
    out = []
    engine = run_facets.get("processing_engine") or run_facets.get("processingEngine") or {}
    if links.prefect_ui_url and isinstance(engine, dict) and str(engine.get("name", "")).lower() == "prefect":
        kind = "flow-run" if job_type == "FLOW" else "task-run"
        out.append({"label": f"Prefect {kind}", "url": f"{links.prefect_ui_url.rstrip('/')}/runs/{kind}/{run_id}"})
    return unique_links(out + facet_urls({k: v for k, v in run_facets.items() if k != "parent"}))


# ----------------------------------------------------------------------------------------------
# Graph


class EncodedDatasets:
    """Each dataset's `dataset_obj`, JSON-encoded once (without its closing brace, so that members
    can follow) and reused while the stored row's revision is unchanged (any process's write changes
    it). A raw file's downstream graph holds thousands of datasets with kilobytes of facets each:
    parsing and encoding them was most of its time. Least recently used entries go beyond
    `max_entries` (a few kB each: ~200 MB at most by default, ~21 MB for the 5,349 datasets of
    the 10,000-event benchmark)."""

    def __init__(self, max_entries: int = 50_000):
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], tuple[int, bytes]] = OrderedDict()
        self._lock = threading.Lock()  # the app answers requests on several threads

    def get(self, store: LineageStore, keys: list[tuple[str, str]]) -> dict[tuple[str, str], bytes]:
        """Open encoded objects of the stored datasets among `keys` (absent: not stored)."""
        out: dict[tuple[str, str], bytes] = {}
        stale = []
        revisions = store.dataset_revisions(keys)
        with self._lock:
            for key, revision in revisions.items():
                entry = self._entries.get(key)
                if entry is not None and entry[0] == revision:
                    self._entries.move_to_end(key)
                    out[key] = entry[1]
                else:
                    stale.append(key)
        fresh = {key: (row["revision"], dumps_bytes(dataset_obj(row))[:-1])
                 for key, row in store.rows_by_keys("datasets", ("namespace", "name"), stale).items()}
        with self._lock:
            self._entries.update(fresh)
            for key in fresh:
                self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        out.update((key, entry[1]) for key, entry in fresh.items())
        return out


def _closed_with(open_obj: bytes, name: str, value: Any) -> Fragment:
    """An open encoded (non-empty) object closed after one more member, where dict insertion puts it."""
    return Fragment(b"".join((open_obj, b',"', name.encode(), b'":', dumps_bytes(value), b"}")))


def graph_json(store: LineageStore, walk: Walk, encoded: EncodedDatasets | None = None) -> dict:
    """Marquez's LineageGraph: {"graph": [{id, type, data, inEdges, outEdges}]}, for dumps_bytes
    (the datasets' data are pre-encoded fragments; `encoded`: the app's cache, None: none kept).

    Extension (ignored by Marquez clients): data.crucible = {hop, sides, runs | versions}."""
    ds_encoded = (encoded or EncodedDatasets()).get(store, list(walk.datasets))
    job_rows = store.rows_by_keys("jobs", ("namespace", "name"), list(walk.jobs))
    jobs = {tuple(o["id"].values()): o for o in jobs_objs(store, list(job_rows.values()))}
    nodes: dict[str, dict] = {}
    for key, info in walk.datasets.items():
        crucible = {"hop": info["hop"], "sides": sorted(info["sides"]), "versions": sorted(info["versions"])}
        obj = ds_encoded.get(key)
        if obj is not None:
            data = _closed_with(obj, "crucible", crucible)
        else:
            data = {"id": {"namespace": key[0], "name": key[1]}, "name": key[1], "namespace": key[0], "facets": {},
                    "crucible": crucible}
        nid = node_id("DATASET", *key)
        nodes[nid] = {"id": nid, "type": "DATASET", "data": data, "inEdges": [], "outEdges": []}
    for key, info in walk.jobs.items():
        data = jobs.get(key) or {"id": {"namespace": key[0], "name": key[1]}, "name": key[1],
                                 "namespace": key[0], "facets": {}}
        data["crucible"] = {"hop": info["hop"], "sides": sorted(info["sides"]), "runs": sorted(info["runs"])}
        nid = node_id("JOB", *key)
        nodes[nid] = {"id": nid, "type": "JOB", "data": data, "inEdges": [], "outEdges": []}
    for origin, destination in sorted(walk.edges):
        edge = {"origin": origin, "destination": destination}
        if origin in nodes and destination in nodes:
            nodes[origin]["outEdges"].append(edge)
            nodes[destination]["inEdges"].append(edge)
    return {"graph": list(nodes.values())}
