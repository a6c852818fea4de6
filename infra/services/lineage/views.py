"""Marquez-shaped JSON (a compatible subset) built from the store's rows, plus links to the UIs
that hold more detail (MLflow for model versions, Prefect for flow and task runs)."""
from __future__ import annotations

import re
import sqlite3
import threading
from collections import OrderedDict, deque
from bisect import bisect_left
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable
from urllib.parse import quote

from infra.services.lineage.fastjson import Fragment, dumps_bytes, loads
from infra.services.lineage.store import LineageStore, Walk, node_id
from tasks.tracking.links import prefect_page


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
        # through the Prefect UI's login route: a bare deep link fails in a browser not yet logged in
        out.append({"label": f"Prefect {kind}", "url": prefect_page(links.prefect_ui_url, f"/runs/{kind}/{run_id}")})
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


# The bounds of a graph answer unless the request asks otherwise: a raw file's downstream graph at
# 10,000 events is 5,354 nodes and 21.9 MB, which no one reads and no page draws.
DEFAULT_LIMIT = 200  # nodes per page
DEFAULT_FANOUT = 10  # neighbours of a node that come before the "N more" of its fan-out
DEFAULT_MAX_BYTES = 2_000_000  # per answer
_EDGE_BYTES = 32  # {"origin":"","destination":""}, beside the two ids
LISTED = 100  # run ids of a job node, versions of a dataset node (and their count): 33,400 runs at 100,000 events


@dataclass
class LineageOrder:
    """The nodes of a walk in the order pages are cut from: breadth-first from the start along the
    walk's direction (a node's fan-out: its neighbours away from the start, the way the walk found
    them), where a node's first `fanout` unplaced neighbours (fewest hops, jobs first, then by id)
    come at once and the rest of its fan-out only after everything reachable that way (then again
    in the same manner). So a page reaches as deep as the walk (the chain to a model) before it
    lists the thousandth output of one job. `via[n]`: the node whose fan-out holds n."""

    ids: list[str]
    index: dict[str, int]
    via: dict[str, str | None]
    kinds: dict[str, tuple[str, tuple[str, str]]]  # node id -> (type, key)
    outgoing: set[tuple[str, str]]  # the walk's edges (origin, destination)
    edges_of: dict[str, list[tuple[str, tuple[str, str]]]]  # node id -> (neighbour, edge) per edge of it
    fan: dict[str, dict[str, list[int]]]  # node id -> direction -> order positions of the nodes it is via of
    _memo: dict[str, tuple[list, dict]] = field(default_factory=dict, repr=False)  # see sides()

    @classmethod
    def of(cls, walk: Walk, fanout: int) -> "LineageOrder":
        kinds: dict[str, tuple[str, tuple[str, str]]] = {}
        rank: dict[str, tuple] = {}
        along, against = set(), set()  # downstream the walk stepped along edges, upstream against them
        for node_type, infos, first in (("DATASET", walk.datasets, 1), ("JOB", walk.jobs, 0)):
            for key, info in infos.items():
                nid = node_id(node_type, *key)
                kinds[nid], rank[nid] = (node_type, key), (info["hop"], first, nid)
                sides = info["sides"]
                if "start" in sides or "downstream" in sides:
                    along.add(nid)
                if "start" in sides or "upstream" in sides:
                    against.add(nid)
        away: dict[str, list[str]] = {nid: [] for nid in kinds}
        edges_of: dict[str, list[tuple[str, tuple[str, str]]]] = {nid: [] for nid in kinds}
        for edge in walk.edges:
            a, b = edge
            edges_of[a].append((b, edge))
            edges_of[b].append((a, edge))
            if a in along:
                away[a].append(b)
            if b in against:
                away[b].append(a)
        start = walk.start.id
        ids: list[str] = []
        index: dict[str, int] = {}
        via: dict[str, str | None] = {}
        fan: dict[str, dict[str, list[int]]] = {}
        level, later = deque([(start, None)]), deque()
        fanout = max(fanout, 1)
        while level:
            while level:
                nid, parent = level.popleft()
                if nid in index:
                    continue
                index[nid] = len(ids)
                ids.append(nid)
                via[nid] = parent
                if parent is not None:  # placed in order: each list ascends
                    side = "downstream" if (parent, nid) in walk.edges else "upstream"
                    fan.setdefault(parent, {}).setdefault(side, []).append(index[nid])
                fresh = sorted({n for n in away[nid] if n not in index}, key=rank.__getitem__)
                level.extend((n, nid) for n in fresh[:fanout])
                later.extend((n, nid) for n in fresh[fanout:])
            level, later = later, deque()
        return cls(ids, index, via, kinds, walk.edges, edges_of, fan)

    def sides(self, nid: str) -> tuple[list[tuple[str, tuple[str, str]]], dict[str, tuple[list[int], list[int]]]]:
        """(its edges to nodes before it in the order; per direction, the order positions of its
        fan-out (the nodes it is `via` of), ascending, with how many of them from each position
        on are datasets). Made once per node a page shows and kept with the order: a job of the
        100,000-event benchmark has ~50,000 outputs, and each page passing over them all took
        ~0.25 s; a page now looks its groups up by position (bisect)."""
        memo = self._memo.get(nid)
        if memo is not None:
            return memo
        index, mine, ids, kinds = self.index, self.index[nid], self.ids, self.kinds
        earlier = [(other, edge) for other, edge in self.edges_of[nid] if index[other] < mine]
        groups: dict[str, tuple[list[int], list[int]]] = {}
        for direction, at in sorted(self.fan.get(nid, {}).items()):
            datasets_from = [0] * (len(at) + 1)
            for i in range(len(at) - 1, -1, -1):
                datasets_from[i] = datasets_from[i + 1] + (kinds[ids[at[i]]][0] == "DATASET")
            groups[direction] = (at, datasets_from)
        memo = self._memo[nid] = (earlier, groups)
        return memo


class WalkOrders:
    """The walks and their page orders of recent graph queries, reused while the store's revision
    holds: the pages after the first (a cursor, a group's nodes) and repeated queries are cut from
    the same order instead of walking again (at 100,000 events a raw file's downstream walk and its
    order take most of the answer's time: ~2 s of CPU there). Bounded by the nodes held (~1 kB each: the
    ten walks from the raw files of the 100,000-event benchmark are ~530,000)."""

    def __init__(self, max_nodes: int = 400_000):
        self.max_nodes = max_nodes
        self._entries: OrderedDict[tuple, tuple[int, Walk, LineageOrder]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, store: LineageStore, start, depth: int, direction: str, fanout: int) -> tuple[Walk, LineageOrder]:
        key = (start.id, depth, direction, fanout)
        revision = store.revision()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] == revision:
                self._entries.move_to_end(key)
                return entry[1], entry[2]
        walk = store.walk(start, depth, direction)
        order = LineageOrder.of(walk, fanout)
        with self._lock:
            self._entries[key] = (revision, walk, order)
            self._entries.move_to_end(key)
            while len(self._entries) > 1 and sum(len(e[2].ids) for e in self._entries.values()) > self.max_nodes:
                self._entries.popitem(last=False)
        return walk, order


def _node_json(nid: str, data: bytes, in_edges: list, out_edges: list) -> bytes:
    """A graph node, its `data` already encoded."""
    return b"".join((b'{"id":', dumps_bytes(nid), b',"type":"', nid.split(":", 1)[0].upper().encode(), b'","data":',
                     data, b',"inEdges":', dumps_bytes(in_edges), b',"outEdges":', dumps_bytes(out_edges), b"}"))


def _node_data(walk: Walk, order: LineageOrder, nid: str, ds_encoded: dict, jobs: dict) -> Any:
    """A page node's Marquez `data` with Crucible's walk facts under data.crucible."""
    node_type, key = order.kinds[nid]
    if node_type == "DATASET":
        info = walk.datasets[key]
        crucible = {"hop": info["hop"], "sides": sorted(info["sides"]),
                    "versions": sorted(info["versions"])[:LISTED], "versionCount": len(info["versions"]),
                    "via": order.via[nid]}
        obj = ds_encoded.get(key)
        return _closed_with(obj, "crucible", crucible) if obj is not None else {
            "id": {"namespace": key[0], "name": key[1]}, "name": key[1], "namespace": key[0], "facets": {},
            "crucible": crucible}
    info = walk.jobs[key]
    data = jobs.get(key) or {"id": {"namespace": key[0], "name": key[1]}, "name": key[1],
                             "namespace": key[0], "facets": {}}
    data["crucible"] = {"hop": info["hop"], "sides": sorted(info["sides"]),
                        "runs": sorted(info["runs"])[:LISTED], "runCount": len(info["runs"]), "via": order.via[nid]}
    return data


def _page_edges(order: LineageOrder, page_ids: list[str]) -> tuple[dict, list]:
    """(inEdges, outEdges) per page node for the edges within the page, and the edges to earlier
    pages' nodes; each edge is listed by its later end only, so no page repeats another's."""
    in_page = set(page_ids)
    nodes: dict[str, tuple[list, list]] = {nid: ([], []) for nid in page_ids}
    earlier = []
    for nid in page_ids:
        for other, edge in order.sides(nid)[0]:  # an edge to a later node: that node lists it
            if other in in_page:
                e = {"origin": edge[0], "destination": edge[1]}
                nodes[edge[0]][1].append(e)
                nodes[edge[1]][0].append(e)
            else:
                earlier.append({"origin": edge[0], "destination": edge[1]})
    return nodes, earlier


def _page_groups(order: LineageOrder, page_ids: list[str], end: int,
                 cursor_for: Callable[[int], str] | None) -> list[dict]:
    """One group per (page node, direction) whose fan-out has nodes after the page: how many, of
    which types, and where the first of them is."""
    groups = []
    for nid in page_ids:
        for direction, (at, datasets_from) in order.sides(nid)[1].items():
            first = bisect_left(at, end)
            count = len(at) - first
            if not count:
                continue
            types = {"DATASET": datasets_from[first], "JOB": count - datasets_from[first]}
            groups.append({"id": f"group:{direction}:{nid}", "parent": nid, "direction": direction, "count": count,
                           "types": {t: n for t, n in types.items() if n}, "offset": at[first],
                           "cursor": cursor_for(at[first]) if cursor_for else None})
    return groups


def graph_page(store: LineageStore, walk: Walk, encoded: EncodedDatasets | None = None, *, offset: int = 0,
               limit: int = DEFAULT_LIMIT, fanout: int = DEFAULT_FANOUT, max_bytes: int = DEFAULT_MAX_BYTES,
               order: LineageOrder | None = None, cursor_for: Callable[[int], str] | None = None) -> bytes:
    """One page of Marquez's LineageGraph, encoded JSON.

    {"graph": [{id, type, data, inEdges, outEdges}]} holds the nodes order.ids[offset:] up to
    `limit` nodes and `max_bytes` of JSON (at least one node), with the edges among them. Added
    for Crucible (Marquez clients ignore them): `groups`, one per fan-out of a page node whose
    remaining nodes come on later pages ({id, parent, direction, count, types, offset, cursor}:
    where the first of them is); `page` {offset, nodes, totalNodes, nextOffset, nextCursor, limit,
    fanout, maxBytes, earlierEdges: edges from this page's nodes to nodes of earlier pages,
    truncated: the walk stopped at `depth`}; data.crucible = {hop, sides, runs and runCount |
    versions and versionCount (the first LISTED, sorted), via}.
    Following nextCursor from the first page lists every node of the walk once. `cursor_for`
    makes a cursor from an offset (None: no cursors)."""
    order = order or LineageOrder.of(walk, fanout)
    offset = min(max(offset, 0), len(order.ids))
    candidates = order.ids[offset:offset + max(limit, 1)]
    ds_keys = [order.kinds[n][1] for n in candidates if order.kinds[n][0] == "DATASET"]
    job_keys = [order.kinds[n][1] for n in candidates if order.kinds[n][0] == "JOB"]
    ds_encoded = (encoded or EncodedDatasets()).get(store, ds_keys)
    job_rows = store.rows_by_keys("jobs", ("namespace", "name"), job_keys)
    jobs = {tuple(o["id"].values()): o for o in jobs_objs(store, list(job_rows.values()))}
    budget = max_bytes - 4096  # the envelope and `page`, beside the nodes and groups
    data_of: dict[str, Any] = {}
    used, end = 0, offset
    for nid in candidates:
        # the node, its edges to nodes placed before it (in this page: listed on both ends), its group
        data = dumps_bytes(_node_data(walk, order, nid, ds_encoded, jobs))
        size = len(data) + len(nid) + 200
        for other, _ in order.sides(nid)[0]:
            size += (len(nid) + len(other) + _EDGE_BYTES) * 2
        if used + size > budget and end > offset:
            break
        used += size
        data_of[nid] = data
        end += 1
    page_ids = order.ids[offset:end]
    nodes, earlier = _page_edges(order, page_ids)
    groups = _page_groups(order, page_ids, end, cursor_for)
    next_offset = end if end < len(order.ids) else None
    parts = [_node_json(nid, data_of[nid], *nodes[nid]) for nid in page_ids]
    page = {"offset": offset, "nodes": len(page_ids), "totalNodes": len(order.ids), "nextOffset": next_offset,
            "nextCursor": cursor_for(next_offset) if cursor_for and next_offset is not None else None,
            "limit": limit, "fanout": fanout, "maxBytes": max_bytes, "truncated": walk.truncated,
            "earlierEdges": earlier}
    body = b"".join((b'{"graph":[', b",".join(parts), b'],"groups":', dumps_bytes(groups),
                     b',"page":', dumps_bytes(page), b"}"))
    if len(body) > max_bytes and len(page_ids) > 1:  # the estimate fell short: cut the page further
        return graph_page(store, walk, encoded, offset=offset, limit=max(1, len(page_ids) * 3 // 4), fanout=fanout,
                          max_bytes=max_bytes, order=order, cursor_for=cursor_for)
    return body
