"""Marquez-shaped JSON (a compatible subset) built from the store's rows, plus links to the UIs
that hold more detail (MLflow for model versions, Prefect for flow and task runs)."""
from __future__ import annotations

import re
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable
from urllib.parse import quote

from infra.services.lineage.fastjson import Fragment, dumps_bytes, loads
from infra.services.lineage.store import LineageStore, PagedWalk, node_id
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


class PagedWalks:
    """The PagedWalks of recent graph queries, continued by their later pages (a cursor, a group)
    and reused by repeated queries while the store's revision holds; a walk placed as far as a
    page needs. Bounded by the nodes the walks have found (~1 kB each)."""

    def __init__(self, max_nodes: int = 400_000):
        self.max_nodes = max_nodes
        self._entries: OrderedDict[tuple, PagedWalk] = OrderedDict()
        self._lock = threading.Lock()

    def placed(self, store: LineageStore, start, depth: int, direction: str, fanout: int, count: int) -> PagedWalk:
        """The query's walk with at least `count` nodes placed (fewer: all there are); its `lock`
        is held by the caller while reading it (another request may be taking it further)."""
        key = (start.id, depth, direction, fanout)
        for _ in range(5):  # each try begins again when a write lands meanwhile
            revision = store.revision()
            with self._lock:
                walk = self._entries.get(key)
                if walk is None or walk.revision != revision:
                    walk = self._entries[key] = store.paged_walk(start, depth, direction, fanout)
                self._entries.move_to_end(key)
            with walk.lock:
                if store.advance(walk, count):
                    break
        self._trim()
        return walk

    def _trim(self) -> None:
        with self._lock:
            while len(self._entries) > 1 and sum(len(w.kinds) for w in self._entries.values()) > self.max_nodes:
                self._entries.popitem(last=False)


def _node_json(nid: str, data: bytes, in_edges: list, out_edges: list) -> bytes:
    """A graph node, its `data` already encoded."""
    return b"".join((b'{"id":', dumps_bytes(nid), b',"type":"', nid.split(":", 1)[0].upper().encode(), b'","data":',
                     data, b',"inEdges":', dumps_bytes(in_edges), b',"outEdges":', dumps_bytes(out_edges), b"}"))


def _node_data(walk: PagedWalk, nid: str, ds_encoded: dict, jobs: dict) -> Any:
    """A page node's Marquez `data` with Crucible's walk facts under data.crucible."""
    node_type, key = walk.kinds[nid]
    items = walk.items(nid)
    common = {"hop": walk.hop(nid), "sides": ["start"] if nid == walk.start.id else walk.sides(nid)}
    if node_type == "DATASET":
        versions = sorted(v for v in items if v)
        crucible = {**common, "versions": versions[:LISTED], "versionCount": len(versions), "via": walk.via[nid]}
        obj = ds_encoded.get(key)
        return _closed_with(obj, "crucible", crucible) if obj is not None else {
            "id": {"namespace": key[0], "name": key[1]}, "name": key[1], "namespace": key[0], "facets": {},
            "crucible": crucible}
    data = jobs.get(key) or {"id": {"namespace": key[0], "name": key[1]}, "name": key[1],
                             "namespace": key[0], "facets": {}}
    runs = sorted(items)
    data["crucible"] = {**common, "runs": runs[:LISTED], "runCount": len(runs), "via": walk.via[nid]}
    return data


def _node_edges(walk: PagedWalk, nid: str) -> list[tuple[str, str]]:
    """The edges listed with a node: at its place, or (not placed yet) those found so far."""
    at = walk.pos.get(nid)
    return walk.edges_at[at] if at is not None else walk.pending.get(nid, [])


def _page_edges(walk: PagedWalk, page_ids: list[str], loaded: Callable[[str], bool]) -> tuple[dict, list]:
    """(inEdges, outEdges) per page node for the edges within the page, and its edges to nodes
    `loaded` before (earlier pages); each edge is listed at one place only, so no page repeats
    another's."""
    in_page = set(page_ids)
    nodes: dict[str, tuple[list, list]] = {nid: ([], []) for nid in page_ids}
    earlier = []
    for nid in page_ids:
        for origin, destination in _node_edges(walk, nid):
            e = {"origin": origin, "destination": destination}
            if origin in in_page and destination in in_page:
                nodes[origin][1].append(e)
                nodes[destination][0].append(e)
            elif (origin in in_page or loaded(origin)) and (destination in in_page or loaded(destination)):
                earlier.append(e)
    return nodes, earlier


def _fan_outs(walk: PagedWalk, nid: str, end: int, ordered: bool = True) -> dict[str, list[str]]:
    """Per side, the nodes `nid`'s fan-out found that are not placed before `end`; `ordered`: those
    placed since in page order, then the rest (jobs first, by id), else as found (a group's count
    needs no order: a job's fan-out at 100,000 events is ~16,000 nodes)."""
    out: dict[str, list[str]] = {}
    pos, kinds, never = walk.pos, walk.kinds, len(walk.kinds)
    for child, side in walk.children[nid]:
        at = pos.get(child)
        if at is None or at >= end:
            out.setdefault(side, []).append(child)
    if ordered:
        for members in out.values():
            members.sort(key=lambda n: (pos.get(n, never), kinds[n][0] != "JOB", n))
    return out


def _group(walk: PagedWalk, parent: str, side: str, members: list[str], cursor: str | None) -> dict:
    """An "N more" group: `count` nodes of `parent`'s fan-out on `side` still to come, at least that
    many (`atLeast`) until the walk is done."""
    datasets = sum(1 for m in members if walk.kinds[m][0] == "DATASET")
    types = {"DATASET": datasets, "JOB": len(members) - datasets}
    return {"id": f"group:{side}:{parent}", "parent": parent, "direction": side, "count": len(members),
            "atLeast": not walk.done, "types": {t: n for t, n in types.items() if n},
            "offset": min((walk.pos[m] for m in members if m in walk.pos), default=None), "cursor": cursor}


def _page_groups(walk: PagedWalk, page_ids: list[str], end: int, cursor_for: Callable[[str], str] | None) -> list[dict]:
    """One group per (page node, side) whose fan-out has nodes after the page."""
    groups = []
    for nid in page_ids:
        for side, members in sorted(_fan_outs(walk, nid, end, ordered=False).items()):
            at = f"g{walk.pos[nid]}:{side[0]}:{end}:0"
            groups.append(_group(walk, nid, side, members, cursor_for(at) if cursor_for else None))
    return groups


def _encoded_nodes(store: LineageStore, walk: PagedWalk, candidates: list[str], encoded: EncodedDatasets | None,
                   max_bytes: int) -> dict[str, bytes]:
    """The encoded data of the first `candidates` that fit in `max_bytes` (at least one)."""
    ds_keys = [walk.kinds[n][1] for n in candidates if walk.kinds[n][0] == "DATASET"]
    job_keys = [walk.kinds[n][1] for n in candidates if walk.kinds[n][0] == "JOB"]
    ds_encoded = (encoded or EncodedDatasets()).get(store, ds_keys)
    job_rows = store.rows_by_keys("jobs", ("namespace", "name"), job_keys)
    jobs = {tuple(o["id"].values()): o for o in jobs_objs(store, list(job_rows.values()))}
    budget = max_bytes - 4096  # the envelope and `page`, beside the nodes and groups
    data_of: dict[str, bytes] = {}
    used = 0
    for nid in candidates:
        # the node and the edges listed with it (within the page: on both ends)
        data = dumps_bytes(_node_data(walk, nid, ds_encoded, jobs))
        size = len(data) + len(nid) + 200 + sum((len(a) + len(b) + _EDGE_BYTES) * 2 for a, b in _node_edges(walk, nid))
        if used + size > budget and data_of:
            break
        used += size
        data_of[nid] = data
    return data_of


def graph_page(store: LineageStore, walk: PagedWalk, encoded: EncodedDatasets | None = None, *, offset: int = 0,
               limit: int = DEFAULT_LIMIT, max_bytes: int = DEFAULT_MAX_BYTES,
               cursor_for: Callable[[str], str] | None = None) -> bytes:
    """One page of Marquez's LineageGraph, encoded JSON (the walk placed up to offset + limit).

    {"graph": [{id, type, data, inEdges, outEdges}]} holds the nodes walk.ids[offset:] up to
    `limit` nodes and `max_bytes` of JSON (at least one node), with the edges among them. Added
    for Crucible (Marquez clients ignore them): `groups`, one per fan-out of a page node whose
    remaining nodes come on later pages ({id, parent, direction, count, atLeast, types, offset,
    cursor}: the cursor opens a page of those nodes); `page` {offset, nodes, totalNodes (found so
    far), complete, nextOffset, nextCursor, limit, fanout, maxBytes, earlierEdges: edges from this
    page's nodes to nodes of earlier pages, truncated: the walk stopped at `depth`};
    data.crucible = {hop, sides, runs and runCount | versions and versionCount (the first
    LISTED, sorted), via}. Following nextCursor from the first page lists every node of the
    walk once and every edge once. `cursor_for` makes a cursor from a position (None: no cursors)."""
    offset = min(max(offset, 0), len(walk.ids))
    data_of = _encoded_nodes(store, walk, walk.ids[offset:offset + max(limit, 1)], encoded, max_bytes)
    end = offset + len(data_of)
    page_ids = walk.ids[offset:end]
    nodes, earlier = _page_edges(walk, page_ids, lambda n: walk.pos.get(n, end) < offset)
    groups = _page_groups(walk, page_ids, end, cursor_for)
    next_offset = end if end < len(walk.ids) else None
    parts = [_node_json(nid, data_of[nid], *nodes[nid]) for nid in page_ids]
    page = {"offset": offset, "nodes": len(page_ids), "totalNodes": len(walk.kinds), "complete": walk.done,
            "nextOffset": next_offset,
            "nextCursor": cursor_for(str(next_offset)) if cursor_for and next_offset is not None else None,
            "limit": limit, "fanout": walk.fanout, "maxBytes": max_bytes, "truncated": walk.truncated,
            "earlierEdges": earlier}
    body = b"".join((b'{"graph":[', b",".join(parts), b'],"groups":', dumps_bytes(groups),
                     b',"page":', dumps_bytes(page), b"}"))
    if len(body) > max_bytes and len(page_ids) > 1:  # the estimate fell short: cut the page further
        return graph_page(store, walk, encoded, offset=offset, limit=max(1, len(page_ids) * 3 // 4),
                          max_bytes=max_bytes, cursor_for=cursor_for)
    return body


def group_page(store: LineageStore, walk: PagedWalk, encoded: EncodedDatasets | None, parent_at: int, side: str,
               end: int, skip: int, *, limit: int = DEFAULT_LIMIT, max_bytes: int = DEFAULT_MAX_BYTES,
               cursor_for: Callable[[str], str] | None = None) -> bytes:
    """The nodes of an "N more" group (the fan-out on `side` of the node placed at `parent_at`, not
    placed before `end`) from the `skip`-th on, as a graph page: their edges to each other and to
    the nodes placed before `end`, and the group again for the rest."""
    if parent_at >= len(walk.ids) or side not in ("upstream", "downstream"):
        raise ValueError("the group's cursor no longer matches the graph: ask for the graph again")
    parent = walk.ids[parent_at]
    members = _fan_outs(walk, parent, end).get(side, [])
    skip = min(max(skip, 0), len(members))
    data_of = _encoded_nodes(store, walk, members[skip:skip + max(limit, 1)], encoded, max_bytes)
    page_ids = members[skip:skip + len(data_of)]
    nodes, earlier = _page_edges(walk, page_ids, lambda n: walk.pos.get(n, end) < end)
    rest = members[skip + len(page_ids):]
    at = f"g{parent_at}:{side[0]}:{end}:{skip + len(page_ids)}"
    groups = [_group(walk, parent, side, rest, cursor_for(at) if cursor_for else None)] if rest else []
    parts = [_node_json(nid, data_of[nid], *nodes[nid]) for nid in page_ids]
    page = {"group": f"group:{side}:{parent}", "offset": skip, "nodes": len(page_ids), "totalNodes": len(walk.kinds),
            "complete": walk.done, "nextOffset": None, "nextCursor": None, "limit": limit, "fanout": walk.fanout,
            "maxBytes": max_bytes, "truncated": walk.truncated, "earlierEdges": earlier}
    return b"".join((b'{"graph":[', b",".join(parts), b'],"groups":', dumps_bytes(groups),
                     b',"page":', dumps_bytes(page), b"}"))


def parse_position(at: str) -> tuple:
    """A cursor's position: ("page", offset) or ("group", parent place, side, end, skip)."""
    if at.isdigit():
        return ("page", int(at))
    parent, side, end, skip = at[1:].split(":") if at.startswith("g") else ("",) * 4
    if not (parent.isdigit() and end.isdigit() and skip.isdigit() and side in ("u", "d")):
        raise ValueError("cursor is not one this service gave")
    return ("group", int(parent), "upstream" if side == "u" else "downstream", int(end), int(skip))


def graph_answer(store: LineageStore, walks: PagedWalks, encoded: EncodedDatasets, start, *, depth: int,
                 direction: str, fanout: int, at: str = "0", limit: int = DEFAULT_LIMIT,
                 max_bytes: int = DEFAULT_MAX_BYTES, cursor_for: Callable[[str], str] | None = None) -> bytes:
    """The page a query and a cursor position ask for, the walk taken only as far as it needs."""
    position = parse_position(at)
    if position[0] == "page":
        # one node past the page: whether a next page exists is known
        walk = walks.placed(store, start, depth, direction, fanout, position[1] + max(limit, 1) + 1)
        with walk.lock:
            return graph_page(store, walk, encoded, offset=position[1], limit=limit, max_bytes=max_bytes,
                              cursor_for=cursor_for)
    _, parent_at, side, end, skip = position
    walk = walks.placed(store, start, depth, direction, fanout, end)
    with walk.lock:
        return group_page(store, walk, encoded, parent_at, side, end, skip, limit=limit, max_bytes=max_bytes,
                          cursor_for=cursor_for)
