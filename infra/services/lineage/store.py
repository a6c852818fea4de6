"""SQLite storage of OpenLineage events, with derived tables for browsing and lineage queries.

`events` keeps every accepted event verbatim (the audit record). From each *new* event the store
derives namespaces, jobs, runs, datasets, dataset versions and `run_io` — one row per
(run, direction, dataset) carrying the version the run read or wrote. Lineage walks follow
`run_io` run by run and version by version, so the upstream of a model version contains only the
runs and artifacts that actually led to it, even when the same jobs ran many times.

Ingestion is idempotent per (runId, eventType, eventTime): a repeated event changes nothing.
A batch is one transaction (WAL journal, executemany), which keeps ingestion well above
1,000 events/s on 2 cores.
"""
from __future__ import annotations

import re
import sqlite3
import threading
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator

from infra.services.lineage.fastjson import dumps as _dumps
from infra.services.lineage.fastjson import loads as _loads

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    event_time TEXT NOT NULL,
    job_namespace TEXT,
    job_name TEXT,
    received_at TEXT NOT NULL,
    payload TEXT NOT NULL,
    -- time first: ingestion appends near the index's end, where (run_id, ...) first wrote a
    -- random leaf page per run to each batch's WAL (lookups use all three columns either way)
    UNIQUE (event_time, run_id, event_type)
);
CREATE INDEX IF NOT EXISTS events_time ON events (event_time);
CREATE TABLE IF NOT EXISTS namespaces (
    name TEXT PRIMARY KEY,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS jobs (
    namespace TEXT NOT NULL,
    name TEXT NOT NULL,
    job_type TEXT,
    facets TEXT NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    latest_run_id TEXT,
    latest_run_time TEXT,
    parent_name TEXT,
    PRIMARY KEY (namespace, name)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    job_namespace TEXT NOT NULL,
    job_name TEXT NOT NULL,
    state TEXT NOT NULL,
    state_time TEXT NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    started_at TEXT,
    ended_at TEXT,
    nominal_start TEXT,
    nominal_end TEXT,
    parent_run_id TEXT,
    root_run_id TEXT,
    facets TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS runs_job ON runs (job_namespace, job_name, created_at);
CREATE TABLE IF NOT EXISTS datasets (
    namespace TEXT NOT NULL,
    name TEXT NOT NULL,
    facets TEXT NOT NULL,
    current_version TEXT,
    version_time TEXT,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    last_modified_at TEXT,
    revision INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (namespace, name)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS dataset_versions (
    namespace TEXT NOT NULL,
    name TEXT NOT NULL,
    version TEXT NOT NULL,
    facets TEXT NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    created_by_run TEXT,
    PRIMARY KEY (namespace, name, version)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS run_io (
    run_id TEXT NOT NULL,
    direction TEXT NOT NULL CHECK (direction IN ('in', 'out')),
    namespace TEXT NOT NULL,
    name TEXT NOT NULL,
    version TEXT NOT NULL,
    job_namespace TEXT NOT NULL,
    job_name TEXT NOT NULL,
    facets TEXT NOT NULL,
    event_time TEXT NOT NULL,
    PRIMARY KEY (run_id, direction, namespace, name)
) WITHOUT ROWID;
"""
# Added to databases made before them by _migrate, when the store opens one. `revision` is the
# highest event id when the row was last written: the graph view caches each dataset's encoded
# object per revision. The walks' steps from datasets to runs read run_io through a covering
# index, not its rows (the same row order as the former run_io_dataset index, which it replaces).
# runs_parent (runs by parent_run_id) served no query and wrote a random leaf page per run to each
# batch's WAL: dropped.
_ADDED_COLUMNS = {"datasets": {"revision": "INTEGER NOT NULL DEFAULT 0"}}
_INDEXES = """
CREATE INDEX IF NOT EXISTS datasets_revision ON datasets (namespace, name, revision);
DROP INDEX IF EXISTS run_io_dataset;
DROP INDEX IF EXISTS runs_parent;
CREATE INDEX IF NOT EXISTS run_io_by_dataset ON run_io (namespace, name, direction, run_id, version, job_namespace,
                                                        job_name);
"""

# OpenLineage event type -> Marquez run state; terminal states outrank RUNNING whatever the arrival order.
RUN_STATES = {"START": "RUNNING", "RUNNING": "RUNNING", "COMPLETE": "COMPLETED", "FAIL": "FAILED",
              "ABORT": "ABORTED"}
_STATE_RANK = {"NEW": 0, "RUNNING": 1, "COMPLETED": 2, "FAILED": 2, "ABORTED": 2}
_TERMINAL = {"COMPLETE", "FAIL", "ABORT"}
_CHUNK = 300  # keys per IN (VALUES ...) query
# ~90 MB of WAL at ~16 kB of rows per event (LineageStore._after_commit): a hot page (an index's, a
# shared dataset's row) is copied once per 6,000 events; at 2,000 the copying was ~52 us of CPU per
# event of ~230, at 6,000 ~23 (30,000 events, direct, loaded machine)
CHECKPOINT_EVENTS = 6000
# the columns of run_io a walk reads (row tuples in this order)
_IO_COLUMNS = "t.run_id, t.namespace, t.name, t.version, t.job_namespace, t.job_name"


class EventError(ValueError):
    """An event that is not a usable OpenLineage event (the message says which field)."""


# already the stored form but for a "+00:00" suffix (what the emitter writes); anything else (a 't' or
# ' ' separator, a week date, an offset) is converted, so that equal times are equal text
_UTC_MICROS = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}(Z|\+00:00)")


def utc_time(value: Any, what: str = "eventTime") -> str:
    """An ISO-8601 timestamp normalised to UTC with microseconds, so that text order is time order."""
    if not isinstance(value, str) or not value:
        raise EventError(f"{what} must be an ISO-8601 string")
    if _UTC_MICROS.fullmatch(value):
        try:  # checked (a real date and time), not converted
            datetime.fromisoformat(value[:26])
            return value[:26] + "Z"
        except ValueError:
            pass
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00") if value.endswith("Z") else value)
    except ValueError:
        raise EventError(f"{what} is not an ISO-8601 timestamp: {value!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _merge_facets(old: dict, old_time: str | None, new: dict, new_time: str) -> dict:
    """Facet-wise merge: the newer side wins per facet; `_deleted: true` removes a facet."""
    merged = {**old, **new} if old_time is None or new_time >= old_time else {**new, **old}
    return {k: v for k, v in merged.items() if not (isinstance(v, dict) and v.get("_deleted") is True)}


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring a database written by an earlier version up to this schema (columns, then indexes), in
    one transaction, so that two processes opening it at once do not both add a column."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        for table, columns in _ADDED_COLUMNS.items():
            have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
            for name, decl in columns.items():
                if name not in have:
                    conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
        for statement in filter(str.strip, _INDEXES.split(";")):
            conn.execute(statement)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


# ----------------------------------------------------------------------------------------------
# Parsing


@dataclass
class _DatasetRef:
    namespace: str
    name: str
    version: str  # "" when the event carries no version facet
    facets: dict
    io_facets: dict  # inputFacets or outputFacets


@dataclass
class _Parsed:
    raw: dict
    time: str
    key_run: str
    event_type: str
    job_namespace: str | None
    job_name: str | None
    job_facets: dict
    run_id: str | None
    run_facets: dict
    inputs: list[_DatasetRef]
    outputs: list[_DatasetRef]


def _str_field(obj: dict, key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise EventError(f"{where}.{key} must be a non-empty string")
    return value


def _facets(obj: dict, key: str, where: str) -> dict:
    value = obj.get(key) or {}
    if not isinstance(value, dict):
        raise EventError(f"{where}.{key} must be an object")
    return value


def _dataset(ds: Any, where: str, io_key: str) -> _DatasetRef:
    if not isinstance(ds, dict):
        raise EventError(f"{where} must be an object")
    facets = _facets(ds, "facets", where)
    version = facets.get("version", {}).get("datasetVersion") if isinstance(facets.get("version"), dict) else None
    return _DatasetRef(_str_field(ds, "namespace", where), _str_field(ds, "name", where),
                       str(version) if version not in (None, "") else "", facets, _facets(ds, io_key, where))


def parse_event(event: Any) -> _Parsed:
    """Check the fields the store relies on (not the whole schema; see tasks.lineage.validate)."""
    if not isinstance(event, dict):
        raise EventError("an event must be a JSON object")
    time = utc_time(event.get("eventTime"))
    event_type = event.get("eventType") or ""
    if not isinstance(event_type, str):
        raise EventError("eventType must be a string")
    job, run = event.get("job"), event.get("run")
    if job is None and isinstance(event.get("dataset"), dict):  # a DatasetEvent: static metadata only
        ds = _dataset(event["dataset"], "dataset", "facets")
        return _Parsed(event, time, f"dataset:{ds.namespace}:{ds.name}", event_type, None, None, {}, None, {},
                       [], [ds])
    if not isinstance(job, dict):
        raise EventError("job must be an object")
    job_ns, job_name = _str_field(job, "namespace", "job"), _str_field(job, "name", "job")
    run_id, run_facets = None, {}
    if run is not None:
        if not isinstance(run, dict):
            raise EventError("run must be an object")
        run_id = _str_field(run, "runId", "run")
        run_facets = _facets(run, "facets", "run")
    inputs, outputs = event.get("inputs") or [], event.get("outputs") or []
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise EventError("inputs and outputs must be arrays")
    return _Parsed(
        event, time, run_id or f"job:{job_ns}:{job_name}", event_type, job_ns, job_name,
        _facets(job, "facets", "job"), run_id, run_facets,
        [_dataset(d, f"inputs[{i}]", "inputFacets") for i, d in enumerate(inputs)],
        [_dataset(d, f"outputs[{i}]", "outputFacets") for i, d in enumerate(outputs)])


# ----------------------------------------------------------------------------------------------
# Node ids

NODE_TYPES = {"dataset": "DATASET", "job": "JOB"}
# scheme://authority[:port][path-without-colon] — the fallback when no stored namespace matches.
_URI_NAMESPACE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*://[^:/]*(?::\d+)?[^:]*):(.+)$")


@dataclass(frozen=True)
class Node:
    type: str  # "DATASET" | "JOB"
    namespace: str
    name: str

    @property
    def id(self) -> str:
        return node_id(self.type, self.namespace, self.name)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)


_ID_PREFIX = {t: prefix for prefix, t in NODE_TYPES.items()}  # "DATASET" -> "dataset"


def node_id(node_type: str, namespace: str, name: str) -> str:
    return f"{_ID_PREFIX.get(node_type) or node_type.lower()}:{namespace}:{name}"


def split_node_id(value: str, known_namespaces: Iterable[str] = ()) -> list[Node]:
    """Candidate parses of a Marquez node id, best first.

    The namespace may itself contain ':' (`mlflow://127.0.0.1:5000`, `s3://bucket`), so the known
    namespaces that prefix the id are tried longest first, then a URI-shaped namespace, then the
    first ':' (plain namespaces such as `file` or `crucible`)."""
    prefix, sep, rest = value.partition(":")
    if not sep or prefix.lower() not in NODE_TYPES or ":" not in rest:
        raise ValueError(f"nodeId must look like dataset:<namespace>:<name> or job:<namespace>:<name>, "
                         f"got {value!r}")
    node_type = NODE_TYPES[prefix.lower()]
    candidates: list[Node] = []
    for ns in sorted(known_namespaces, key=len, reverse=True):
        if rest.startswith(ns + ":") and len(rest) > len(ns) + 1:
            candidates.append(Node(node_type, ns, rest[len(ns) + 1:]))
    if rest.split(":", 1)[1].startswith("//"):
        m = _URI_NAMESPACE.match(rest)
        if m:
            candidates.append(Node(node_type, m.group(1), m.group(2)))
    ns, _, name = rest.partition(":")
    candidates.append(Node(node_type, ns, name))
    unique: list[Node] = []
    for c in candidates:
        if c not in unique:
            unique.append(c)
    return unique


# ----------------------------------------------------------------------------------------------
# Lineage walks


@dataclass
class Walk:
    """The part of the graph reached from a start node: job and dataset nodes, edges, and the runs
    and dataset versions that connect them. `hop` counts job hops from the start."""

    start: Node
    jobs: dict[tuple[str, str], dict] = field(default_factory=dict)
    datasets: dict[tuple[str, str], dict] = field(default_factory=dict)
    edges: set[tuple[str, str]] = field(default_factory=set)
    runs: dict[str, tuple[str, str]] = field(default_factory=dict)  # run id -> job key
    truncated: bool = False

    # called per row a walk reads: the entry is made only when missing (not built for setdefault)
    def add_job(self, key: tuple[str, str], run_id: str | None, hop: int, side: str) -> None:
        info = self.jobs.get(key)
        if info is None:
            info = self.jobs[key] = {"runs": set(), "hop": hop, "sides": set()}
        elif hop < info["hop"]:
            info["hop"] = hop
        info["sides"].add(side)
        if run_id:
            info["runs"].add(run_id)
            self.runs[run_id] = key

    def add_dataset(self, key: tuple[str, str], version: str | None, hop: int, side: str) -> None:
        info = self.datasets.get(key)
        if info is None:
            info = self.datasets[key] = {"versions": set(), "hop": hop, "sides": set()}
        elif hop < info["hop"]:
            info["hop"] = hop
        info["sides"].add(side)
        if version:
            info["versions"].add(version)


def _chunks(items: list, n: int = _CHUNK) -> Iterator[list]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


class _IoIndex:
    """run_io in memory, both ways (dataset -> runs, run -> datasets, per direction), for the walks.

    A walk from a raw file reaches every run that read it: at 100,000 events ~33,000 runs and
    ~130,000 run_io rows, which SQLite queries hop by hop took ~0.8 s to return to Python; dict
    look-ups take a fraction of that. Kept up to date from the events' ids (see
    LineageStore._io_index_current); ~1 kB per run_io row."""

    def __init__(self) -> None:
        self.seen = 0  # the highest event id the index reflects
        self.loaded = False  # run_io read in (seen 0 may mean an empty store or nothing read yet)
        # direction -> dataset key -> run id -> (version, job key); direction -> run id -> key -> version
        self.by_dataset: dict[str, dict[tuple, dict[str, tuple]]] = {"in": {}, "out": {}}
        self.by_run: dict[str, dict[str, dict[tuple, str]]] = {"in": {}, "out": {}}
        self.ids: dict[tuple, str] = {}  # dataset key -> node id
        self.job_ids: dict[tuple, str] = {}  # job key -> node id

    def load(self, rows: list[tuple], replaced_runs: Iterable[str]) -> None:
        """Add run_io rows (run_id, direction, namespace, name, version, job_namespace, job_name),
        first dropping what the index held for `replaced_runs` (their rows are all in `rows`)."""
        for run_id in replaced_runs:
            for direction in ("in", "out"):
                for key in self.by_run[direction].pop(run_id, ()):
                    self.by_dataset[direction][key].pop(run_id, None)
        ids, job_ids = self.ids, self.job_ids
        for run_id, direction, namespace, name, version, job_namespace, job_name in rows:
            key, job = (namespace, name), (job_namespace, job_name)
            if key not in ids:
                ids[key] = node_id("DATASET", namespace, name)
            if job not in job_ids:
                job_ids[job] = node_id("JOB", job_namespace, job_name)
            self.by_dataset[direction].setdefault(key, {})[run_id] = (version, job)
            self.by_run[direction].setdefault(run_id, {})[key] = version

    def walk_side(self, walk: Walk, start: Node, start_runs: list[str], depth: int, side: str) -> None:
        # upstream: dataset <-(out)- run <-(in)- dataset; downstream: dataset -(in)-> run -(out)-> dataset
        to_run, from_run = ("out", "in") if side == "upstream" else ("in", "out")
        seen_runs: set[str] = set()
        seen_versions: set[tuple] = set()
        hop = 0
        if start.type == "DATASET":
            frontier: dict[tuple, set] = {start.key: {None}}
        else:
            for run_id in start_runs:
                walk.add_job(start.key, run_id, 0, side)
            seen_runs.update(start_runs)
            frontier = self._expand_runs(walk, start_runs, from_run, 0, side, seen_versions)
        while frontier and hop < depth:
            hop += 1
            new_runs = self._enter_runs(walk, frontier, to_run, hop, side, seen_runs)
            frontier = self._expand_runs(walk, new_runs, from_run, hop, side, seen_versions)
        by_dataset = self.by_dataset[to_run]
        if any(by_dataset.get(key) for key in frontier):
            walk.truncated = True

    def _enter_runs(self, walk: Walk, frontier: dict[tuple, set], direction: str, hop: int, side: str,
                    seen_runs: set[str]) -> list[str]:
        """One hop from the frontier's dataset versions to the runs that wrote (upstream) or read
        (downstream) them; returns the runs not seen before."""
        up = direction == "out"
        by_dataset, ids, job_ids = self.by_dataset[direction], self.ids, self.job_ids
        new_runs: list[str] = []
        add_job, add_edge = walk.add_job, walk.edges.add
        for key, wanted in frontier.items():
            runs = by_dataset.get(key)
            if not runs:
                continue
            items = runs.items()
            if None not in wanted:
                exact = [r for r in items if r[1][0] in wanted or not r[1][0]]
                # upstream: a producer that recorded another hash still wrote this name; downstream
                # a reader of another version did not read this one
                items = exact or (items if up else [])
            ds_id = ids[key]
            for run_id, (_, job_key) in items:
                add_job(job_key, run_id, hop, side)
                job_id = job_ids[job_key]
                add_edge((job_id, ds_id) if up else (ds_id, job_id))
                if run_id not in seen_runs:
                    seen_runs.add(run_id)
                    new_runs.append(run_id)
        return new_runs

    def _expand_runs(self, walk: Walk, run_ids: list[str], direction: str, hop: int, side: str,
                     seen_versions: set[tuple]) -> dict[tuple, set]:
        frontier: dict[tuple, set] = {}
        add_dataset, add_edge, inputs = walk.add_dataset, walk.edges.add, direction == "in"
        by_run, ids, job_ids, runs_job = self.by_run[direction], self.ids, self.job_ids, walk.runs
        for run_id in run_ids:
            datasets = by_run.get(run_id)
            if not datasets:
                continue
            job_id = job_ids[runs_job[run_id]]  # every run a walk follows is in walk.runs
            for key, version in datasets.items():
                version = version or None
                add_dataset(key, version, hop, side)
                ds_id = ids[key]
                add_edge((ds_id, job_id) if inputs else (job_id, ds_id))
                if (key, version) not in seen_versions:
                    seen_versions.add((key, version))
                    if key in frontier:
                        frontier[key].add(version)
                    else:
                        frontier[key] = {version}
        return frontier


class PagedWalk:
    """A walk from `start` taken one node at a time, in the order graph pages list them, only as far
    as the pages asked for so far (`advance`): at 100,000 events a raw file's downstream walk is
    ~53,000 nodes and ~117,000 edges (~2 s of CPU to walk and order), while its first page is 200.

    Order: breadth-first from the start, a node's fan-out (its neighbours away from the start that
    no one found before) sorted jobs first, then by id; its first `fanout` come at once, the rest
    after everything reachable that way (then again in the same manner), so a page reaches as
    deep as the walk before it lists one job's thousandth output. A node's `via` is the node whose
    fan-out found it. The steps are the walk's (store.walk): run by run and dataset version by
    version, each with its own hop (a job's runs lie at different hops along a chain of resumed
    trainings), `depth` job hops per side. A node is expanded with the runs (job) or versions
    (dataset) that reached it when it is placed, and again with any that reach it later or by a
    shorter path (what those find comes after everything found so far). Each edge is listed once:
    at the later of its ends' places, or at the step that found it when both were placed before.
    Taken to its end it is the whole walk (same nodes, edges and hops). Until `done`, counts (a
    fan-out's remaining nodes, the nodes found, a job's runs) are what it has found: lower bounds."""

    def __init__(self, start: Node, start_runs: list[str], depth: int, direction: str, fanout: int,
                 revision: int):
        self.start, self.depth, self.fanout, self.revision = start, max(depth, 0), max(fanout, 1), revision
        self.ids: list[str] = []  # placed, in page order
        self.pos: dict[str, int] = {}
        self.kinds: dict[str, tuple[str, tuple[str, str]]] = {}  # every node found: (type, key)
        self.via: dict[str, str | None] = {}
        # (node, side) -> run (job) or version (dataset; None: any) that reached it -> its hop
        self.reach: dict[tuple[str, str], dict] = {}
        self.followed: dict[tuple[str, str], dict] = {}  # ... expanded, at that hop
        self.children: dict[str, list[tuple[str, str]]] = {}  # node -> (node, side) it found, in order
        self.edges_at: list[list[tuple[str, str]]] = []  # per place: the edges listed there
        self.pending: dict[str, list[tuple[str, str]]] = {}  # unplaced node -> its edges to list
        self.edge_seen: set[tuple[str, str]] = set()
        self.level: deque = deque()
        self.later: deque = deque()
        self.truncated = False
        self.done = False
        self._fresh: list[tuple[str, str]] = []  # found by the step now being taken (split by fanout)
        self.lock = threading.Lock()  # held while a request takes it further or reads a page of it
        sid = start.id
        self.kinds[sid], self.via[sid] = (start.type, start.key), None
        self.children[sid] = []
        for side in ("upstream", "downstream") if direction == "both" else (direction,):
            self.reach[(sid, side)] = dict.fromkeys(start_runs, 0) if start.type == "JOB" else {None: 0}
            self.followed[(sid, side)] = {}
        self.level.append(sid)

    # -- what a page reads ---------------------------------------------------------------------

    def sides(self, nid: str) -> list[str]:
        return [side for side in ("downstream", "upstream") if (nid, side) in self.reach]

    def hop(self, nid: str) -> int:
        return min((h for side in ("upstream", "downstream") for h in self.reach.get((nid, side), {}).values()),
                   default=0)  # a job without runs is only ever the start

    def items(self, nid: str) -> set:
        """The runs (job) or versions (dataset; None: any) that reached a node, on either side."""
        return set(self.reach.get((nid, "upstream"), ())) | set(self.reach.get((nid, "downstream"), ()))

    # -- taking steps --------------------------------------------------------------------------

    def advance(self, index: "_IoIndex", count: int) -> None:
        """Place nodes until `count` are placed or the walk is done (call with the index current
        for `revision` and locked)."""
        while len(self.ids) < count and not self.done:
            if not self.level:
                self.level, self.later = self.later, deque()
                if not self.level:
                    self.done = True
                    break
            nid = self.level.popleft()
            if nid in self.pos:
                continue
            self.pos[nid] = len(self.ids)
            self.ids.append(nid)
            self.edges_at.append(self.pending.pop(nid, []))
            self._fresh = []
            for side in self.sides(nid):
                self._expand(index, nid, side)
            fresh = sorted(self._fresh, key=lambda f: (self.kinds[f[0]][0] != "JOB", f[0]))
            self.level.extend(n for n, _ in fresh[:self.fanout])
            self.later.extend(n for n, _ in fresh[self.fanout:])

    def _expand(self, index: "_IoIndex", nid: str, side: str) -> None:
        """Follow what reached (nid, side) and was not followed yet (or at a greater hop); what that
        reaches anew, or by a shorter path, and was placed before is followed in turn (worklist)."""
        work = [(nid, side)]
        while work:
            node, s = work.pop()
            key = (node, s)
            node_type, nkey = self.kinds[node]
            followed, dataset = self.followed[key], node_type == "DATASET"
            new = {item: hop for item, hop in self.reach[key].items() if hop < followed.get(item, hop + 1)}
            if dataset and any(hop >= self.depth for hop in new.values()):
                if index.by_dataset["out" if s == "upstream" else "in"].get(nkey):
                    self.truncated = True
                new = {item: hop for item, hop in new.items() if hop < self.depth}
            if not new:
                continue
            followed.update(new)
            # a dataset's versions step together per hop, as the whole walk's frontier does
            groups = {}
            for item, hop in new.items():
                groups.setdefault(hop if dataset else item, {})[item] = hop
            for items in groups.values():
                for child, child_key, item, hop, edge in self._neighbours(index, node_type, nkey, node, s, items):
                    self._edge(edge)
                    ckey = (child, s)
                    if child not in self.kinds:
                        self.kinds[child] = ("JOB" if dataset else "DATASET", child_key)
                        self.via[child] = node
                        self.children[child] = []
                        self.children[node].append((child, s))
                        if node == self.ids[-1]:
                            self._fresh.append((child, s))
                        else:  # found by a node placed before: after everything found so far
                            self.later.append(child)
                    if ckey not in self.reach:
                        self.reach[ckey], self.followed[ckey] = {}, {}
                    reached = self.reach[ckey]
                    if hop < reached.get(item, hop + 1):
                        reached[item] = hop
                        if child in self.pos:
                            work.append(ckey)

    def _neighbours(self, index: "_IoIndex", node_type: str, nkey: tuple, node: str, side: str, items: dict):
        """(node id, key, run or version, its hop, edge) one step from `node` on `side` through
        `items` (runs of a job, or versions of a dataset reached at one hop)."""
        up = side == "upstream"
        if node_type == "DATASET":
            hop = next(iter(items.values())) + 1
            runs = index.by_dataset["out" if up else "in"].get(nkey) or {}
            found = runs.items()
            if None not in items:
                exact = [r for r in found if r[1][0] in items or not r[1][0]]
                # upstream: a producer that recorded another hash still wrote this name; downstream
                # a reader of another version did not read this one
                found = exact or (found if up else [])
            for run_id, (_, job_key) in found:
                job = index.job_ids[job_key]
                yield job, job_key, run_id, hop, ((job, node) if up else (node, job))
        else:
            by_run = index.by_run["in" if up else "out"]
            for run_id, hop in items.items():
                for key, version in (by_run.get(run_id) or {}).items():
                    ds = index.ids[key]
                    yield ds, key, version or None, hop, ((ds, node) if up else (node, ds))

    def _edge(self, edge: tuple[str, str]) -> None:
        if edge in self.edge_seen:
            return
        self.edge_seen.add(edge)
        unplaced = [n for n in edge if n not in self.pos]
        if unplaced:
            self.pending.setdefault(unplaced[0], []).append(edge)
        else:
            self.edges_at[-1].append(edge)


# ----------------------------------------------------------------------------------------------
# The store


class LineageStore:
    """Thread-safe: each thread has its own connection; writes are serialised by a lock."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._write_lock = threading.Lock()
        self._namespaces: list[str] | None = None
        self._io_index = _IoIndex()
        self._io_index_lock = threading.Lock()
        self._checkpoint_due = threading.Event()
        self._checkpointer: threading.Thread | None = None
        self._checkpoint_stop = threading.Event()  # the running checkpointer's; each thread gets its own
        self._since_checkpoint = 0  # events stored since the checkpointer was last woken
        self.checkpoints: list[tuple[int, int, int]] = []  # the checkpointer's (busy, WAL frames, copied), last few
        conn = self._conn()
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(_SCHEMA)
        _migrate(conn)

    # -- connections ---------------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=30)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA temp_store=MEMORY")
            conn.execute("PRAGMA cache_size=-65536")
            conn.execute("PRAGMA busy_timeout=30000")
            # checkpoints (WAL pages copied into the database, both fsynced) took half of ingestion's
            # time at the default 1,000 pages (4 MB): a 64 MB WAL copies the hot index pages once per
            # 16 times as many events (10,000-event ingest ~1,450 -> ~3,000-5,200 ev/s, loaded machine);
            # the file is cut back to 128 MB after each checkpoint. The checkpointer thread copies
            # every CHECKPOINT_EVENTS (~90 MB); this 128 MB bound only acts if it falls behind
            conn.execute("PRAGMA wal_autocheckpoint=32768")
            conn.execute("PRAGMA journal_size_limit=134217728")
            self._local.conn = conn
        return conn

    def close(self) -> None:
        """Close this thread's connection and stop the checkpointer thread (a later ingestion starts another)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            self._checkpoint_stop.set()
            self._checkpoint_due.set()
            checkpointer.join(timeout=5)  # a checkpoint under way finishes first; PASSIVE never waits long

    # -- ingestion -----------------------------------------------------------------------------

    def ingest(self, event: dict) -> bool:
        """Store one event; False when it was already there (same runId, eventType, eventTime)."""
        return self.ingest_batch([event])["ingested"] == 1

    def ingest_batch(self, events: Iterable[dict]) -> dict:
        """Store events in one transaction; all or nothing. Returns received/ingested/duplicates."""
        parsed = []
        for i, event in enumerate(events):
            try:
                parsed.append(parse_event(event))
            except EventError as e:
                raise EventError(f"event {i}: {e}") from None
        received = _now()
        with self._write_lock:
            conn = self._conn()
            conn.execute("BEGIN IMMEDIATE")
            try:
                before = conn.execute("SELECT max(id) FROM events").fetchone()[0] or 0
                seen = set(self._existing(conn, "events", ("run_id", "event_type", "event_time"),
                                          list({(p.key_run, p.event_type, p.time) for p in parsed})))
                new = []
                for p in parsed:
                    key = (p.key_run, p.event_type, p.time)
                    if key not in seen:
                        seen.add(key)
                        new.append(p)
                conn.executemany(
                    "INSERT INTO events (run_id, event_type, event_time, job_namespace, job_name, received_at,"
                    " payload) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [(p.key_run, p.event_type, p.time, p.job_namespace, p.job_name, received, _dumps(p.raw))
                     for p in new])
                io_rows = self._derive(conn, sorted(new, key=lambda p: p.time)) if new else []
                after = conn.execute("SELECT max(id) FROM events").fetchone()[0] or 0
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            if new:
                self._namespaces = None
                self._io_index_advance(before, after, io_rows)
                self._after_commit(len(new))
        return {"received": len(parsed), "ingested": len(new), "duplicates": len(parsed) - len(new)}

    def _after_commit(self, events: int) -> None:
        """Wake the checkpointer every CHECKPOINT_EVENTS stored events. A checkpoint (WAL pages copied
        into the database and both synced) run by the committing writer was ~40 us of each
        event's ~220 us of CPU and its fsyncs were waited for; on its own thread (SQLite lets go of
        the GIL) it overlaps the next batches' parsing and validation. The writer's own
        autocheckpoint at 32,768 pages (128 MB) stays as the bound if this thread falls behind."""
        if self.path == ":memory:":
            return
        self._since_checkpoint += events
        if self._since_checkpoint < CHECKPOINT_EVENTS:
            return
        self._since_checkpoint = 0
        if self._checkpointer is None:
            self._checkpoint_stop = threading.Event()
            self._checkpointer = threading.Thread(target=self._checkpoint_loop, args=(self._checkpoint_stop,),
                                                  name="lineage-checkpoint", daemon=True)
            self._checkpointer.start()
        self._checkpoint_due.set()

    def _checkpoint_loop(self, stop: threading.Event) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=30)
        try:
            conn.execute("PRAGMA busy_timeout=30000")
            while True:
                self._checkpoint_due.wait()
                self._checkpoint_due.clear()
                if stop.is_set():  # close()
                    return
                try:  # PASSIVE: never blocks the writer or readers; what it cannot copy yet waits for the next
                    self.checkpoints = self.checkpoints[-9:] + [tuple(conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                                                                      .fetchone())]
                except sqlite3.Error:  # e.g. the database busy or gone: the writer's autocheckpoint remains
                    continue
        finally:
            conn.close()

    def _io_index_advance(self, before: int, after: int, io_rows: list[tuple]) -> None:
        """Bring the run_io index along with a batch this process just committed (events `before`
        < id <= `after`), so the first walk after ingestion finds it current instead of reading
        the new runs back (or, in a fresh process, all of run_io: ~1 s at 100,000 events). Only
        when the index was current up to the batch: another process's writes in between leave it
        to _io_index_current."""
        with self._io_index_lock:
            index = self._io_index
            if index.seen == before and (before == 0 or index.loaded):
                index.load(io_rows, ())  # run_io rows are only ever added or replaced, key by key
                index.seen, index.loaded = after, True

    def warm(self) -> None:
        """Load the run_io index now (a server's start) rather than in the first graph query."""
        with self._io_index_lock:
            self._io_index_current()

    def _derive(self, conn: sqlite3.Connection, events: list[_Parsed]) -> list[tuple]:
        """Write the rows the events change; returns the run_io rows written, as _IoIndex.load
        takes them."""
        namespaces: dict[str, list[str]] = {}
        jobs: dict[tuple, dict] = {}
        runs: dict[str, dict] = {}
        datasets: dict[tuple, dict] = {}
        versions: dict[tuple, dict] = {}
        io: dict[tuple, dict] = {}

        def touch_ns(ns: str, t: str) -> None:
            span = namespaces.setdefault(ns, [t, t])
            span[1] = t

        for p in events:  # time order, so a later event's facets overwrite an earlier one's
            t = p.time
            if p.job_namespace:
                touch_ns(p.job_namespace, t)
                j = jobs.setdefault((p.job_namespace, p.job_name), {
                    "facets": {}, "created": t, "updated": t, "latest_run": None, "latest_run_time": None,
                    "parent": None})
                j["facets"].update(p.job_facets)
                j["updated"] = t
                if p.run_id:
                    j["latest_run"], j["latest_run_time"] = p.run_id, t
                parent = p.run_facets.get("parent")
                if isinstance(parent, dict) and isinstance(parent.get("job"), dict):
                    j["parent"] = parent["job"].get("name")
            if p.run_id:
                r = runs.setdefault(p.run_id, {
                    "job": (p.job_namespace, p.job_name), "state": "NEW", "state_time": t, "created": t,
                    "updated": t, "started": None, "ended": None, "nominal_start": None, "nominal_end": None,
                    "parent": None, "root": None, "facets": {}})
                r["updated"] = t
                r["facets"].update(p.run_facets)
                state = RUN_STATES.get(p.event_type)
                if state and (_STATE_RANK[state], t) >= (_STATE_RANK[r["state"]], r["state_time"]):
                    r["state"], r["state_time"] = state, t
                if p.event_type == "START" and (r["started"] is None or t < r["started"]):
                    r["started"] = t
                if p.event_type in _TERMINAL and (r["ended"] is None or t > r["ended"]):
                    r["ended"] = t
                nominal = p.run_facets.get("nominalTime")
                if isinstance(nominal, dict):
                    r["nominal_start"] = nominal.get("nominalStartTime") or r["nominal_start"]
                    r["nominal_end"] = nominal.get("nominalEndTime") or r["nominal_end"]
                parent = p.run_facets.get("parent")
                if isinstance(parent, dict):
                    r["parent"] = (parent.get("run") or {}).get("runId") or r["parent"]
                    r["root"] = ((parent.get("root") or {}).get("run") or {}).get("runId") or r["root"]
            for direction, refs in (("in", p.inputs), ("out", p.outputs)):
                for ds in refs:
                    touch_ns(ds.namespace, t)
                    dkey = (ds.namespace, ds.name)
                    d = datasets.setdefault(dkey, {"facets": {}, "created": t, "updated": t, "version": None,
                                                   "version_time": None, "modified": None})
                    d["facets"].update(ds.facets)
                    d["updated"] = t
                    if ds.version:
                        d["version"], d["version_time"] = ds.version, t
                        v = versions.setdefault(dkey + (ds.version,), {"facets": {}, "created": t, "updated": t,
                                                                      "run": None})
                        v["facets"].update(ds.facets)
                        v["updated"] = t
                        if direction == "out" and p.run_id and v["run"] is None:
                            v["run"] = p.run_id
                    if direction == "out" and p.run_id and p.event_type in _TERMINAL | {""}:
                        d["modified"] = t
                    if p.run_id:
                        e = io.setdefault((p.run_id, direction) + dkey, {
                            "version": "", "job": (p.job_namespace, p.job_name), "facets": {}, "time": t})
                        if ds.version:
                            e["version"] = ds.version
                        e["facets"].update(ds.io_facets)
                        e["time"] = t

        self._write_namespaces(conn, namespaces)
        self._write_jobs(conn, jobs)
        self._write_runs(conn, runs)
        self._write_datasets(conn, datasets)
        self._write_versions(conn, versions)
        return self._write_io(conn, io)

    def _existing(self, conn: sqlite3.Connection, table: str, key_cols: tuple[str, ...],
                  keys: list[tuple]) -> dict[tuple, sqlite3.Row]:
        # a join on a VALUES list searches the key index once per key (`(a, b) IN (VALUES ...)` with
        # several rows scans the table); CROSS JOIN keeps the key list as the outer loop
        found: dict[tuple, sqlite3.Row] = {}
        names = ", ".join(f"k{i}" for i in range(len(key_cols)))
        on = " AND ".join(f"t.{c} = k.k{i}" for i, c in enumerate(key_cols))
        one = "(" + ", ".join("?" * len(key_cols)) + ")"
        for chunk in _chunks(keys):
            sql = (f"WITH k({names}) AS (VALUES {', '.join([one] * len(chunk))})"
                   f" SELECT t.* FROM k CROSS JOIN {table} AS t ON {on}")
            for row in conn.execute(sql, [v for k in chunk for v in k]):
                found[tuple(row[c] for c in key_cols)] = row
        return found

    def _write_namespaces(self, conn, namespaces: dict[str, list[str]]) -> None:
        conn.executemany(
            "INSERT INTO namespaces (name, created_at, updated_at) VALUES (?, ?, ?) ON CONFLICT (name) DO UPDATE"
            " SET created_at = min(created_at, excluded.created_at), updated_at = max(updated_at, excluded.updated_at)",
            [(ns, span[0], span[1]) for ns, span in namespaces.items()])

    def _write_jobs(self, conn, jobs: dict[tuple, dict]) -> None:
        old = self._existing(conn, "jobs", ("namespace", "name"), list(jobs))
        rows = []
        for key, j in jobs.items():
            o = old.get(key)
            facets, created, updated = j["facets"], j["created"], j["updated"]
            latest, latest_t, parent = j["latest_run"], j["latest_run_time"], j["parent"]
            if o is not None:
                facets = _merge_facets(_loads(o["facets"]), o["updated_at"], facets, updated)
                created, updated = min(created, o["created_at"]), max(updated, o["updated_at"])
                if o["latest_run_time"] and (latest_t is None or o["latest_run_time"] > latest_t):
                    latest, latest_t = o["latest_run_id"], o["latest_run_time"]
                parent = parent or o["parent_name"]
            job_type = None
            jt = facets.get("jobType")
            if isinstance(jt, dict):
                job_type = jt.get("jobType")
            rows.append((*key, job_type, _dumps(facets), created, updated, latest, latest_t, parent))
        conn.executemany("INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def _write_runs(self, conn, runs: dict[str, dict]) -> None:
        old = self._existing(conn, "runs", ("run_id",), [(k,) for k in runs])
        rows = []
        for run_id, r in runs.items():
            o = old.get((run_id,))
            if o is not None:
                if (_STATE_RANK[o["state"]], o["state_time"]) > (_STATE_RANK[r["state"]], r["state_time"]):
                    r["state"], r["state_time"] = o["state"], o["state_time"]
                r["facets"] = _merge_facets(_loads(o["facets"]), o["updated_at"], r["facets"], r["updated"])
                r["created"], r["updated"] = min(r["created"], o["created_at"]), max(r["updated"], o["updated_at"])
                r["started"] = min(filter(None, (r["started"], o["started_at"])), default=None)
                r["ended"] = max(filter(None, (r["ended"], o["ended_at"])), default=None)
                for k, col in (("nominal_start", "nominal_start"), ("nominal_end", "nominal_end"),
                               ("parent", "parent_run_id"), ("root", "root_run_id")):
                    r[k] = r[k] or o[col]
                r["job"] = (o["job_namespace"], o["job_name"])
            rows.append((run_id, *r["job"], r["state"], r["state_time"], r["created"], r["updated"], r["started"],
                         r["ended"], r["nominal_start"], r["nominal_end"], r["parent"], r["root"],
                         _dumps(r["facets"])))
        conn.executemany("INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def _write_datasets(self, conn, datasets: dict[tuple, dict]) -> None:
        old = self._existing(conn, "datasets", ("namespace", "name"), list(datasets))
        revision = conn.execute("SELECT max(id) FROM events").fetchone()[0]  # this batch's events included
        rows = []
        for key, d in datasets.items():
            o = old.get(key)
            if o is not None:
                d["facets"] = _merge_facets(_loads(o["facets"]), o["updated_at"], d["facets"], d["updated"])
                d["created"], d["updated"] = min(d["created"], o["created_at"]), max(d["updated"], o["updated_at"])
                if o["version_time"] and (d["version_time"] is None or o["version_time"] > d["version_time"]):
                    d["version"], d["version_time"] = o["current_version"], o["version_time"]
                d["modified"] = max(filter(None, (d["modified"], o["last_modified_at"])), default=None)
            rows.append((*key, _dumps(d["facets"]), d["version"], d["version_time"], d["created"], d["updated"],
                         d["modified"], revision))
        conn.executemany("INSERT OR REPLACE INTO datasets VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def _write_versions(self, conn, versions: dict[tuple, dict]) -> None:
        old = self._existing(conn, "dataset_versions", ("namespace", "name", "version"), list(versions))
        rows = []
        for key, v in versions.items():
            o = old.get(key)
            if o is not None:
                v["facets"] = _merge_facets(_loads(o["facets"]), o["updated_at"], v["facets"], v["updated"])
                v["created"], v["updated"] = min(v["created"], o["created_at"]), max(v["updated"], o["updated_at"])
                v["run"] = o["created_by_run"] or v["run"]
            rows.append((*key, _dumps(v["facets"]), v["created"], v["updated"], v["run"]))
        conn.executemany("INSERT OR REPLACE INTO dataset_versions VALUES (?, ?, ?, ?, ?, ?, ?)", rows)

    def _write_io(self, conn, io: dict[tuple, dict]) -> list[tuple]:
        old = self._existing(conn, "run_io", ("run_id", "direction", "namespace", "name"), list(io))
        rows = []
        for key, e in io.items():
            o = old.get(key)
            if o is not None:
                e["facets"] = _merge_facets(_loads(o["facets"]), o["event_time"], e["facets"], e["time"])
                if o["version"] and (not e["version"] or o["event_time"] > e["time"]):
                    e["version"] = o["version"]
                e["time"] = max(e["time"], o["event_time"])
            rows.append((*key, e["version"], *e["job"], _dumps(e["facets"]), e["time"]))
        conn.executemany("INSERT OR REPLACE INTO run_io VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        return [row[:7] for row in rows]  # run_id, direction, namespace, name, version, job_namespace, job_name

    # -- node ids ------------------------------------------------------------------------------

    def namespaces_known(self) -> list[str]:
        if self._namespaces is None:
            self._namespaces = [r[0] for r in self._conn().execute("SELECT name FROM namespaces")]
        return self._namespaces

    def resolve(self, value: str) -> Node:
        """Parse a node id against the stored namespaces; the first candidate that exists wins."""
        candidates = split_node_id(value, self.namespaces_known())
        for c in candidates:
            table = "datasets" if c.type == "DATASET" else "jobs"
            if self._conn().execute(f"SELECT 1 FROM {table} WHERE namespace = ? AND name = ?", c.key).fetchone():
                return c
        return candidates[0]

    def exists(self, node: Node) -> bool:
        table = "datasets" if node.type == "DATASET" else "jobs"
        return self._conn().execute(f"SELECT 1 FROM {table} WHERE namespace = ? AND name = ?",
                                    node.key).fetchone() is not None

    # -- lineage -------------------------------------------------------------------------------

    def _io_rows(self, sql: str, params: list) -> list[tuple]:
        cursor = self._conn().cursor()
        cursor.row_factory = None  # plain tuples: one step of a walk can read thousands of rows
        return cursor.execute(sql, params).fetchall()

    def _io_for_datasets(self, direction: str, keys: list[tuple[str, str]], first_only: bool = False) -> list[tuple]:
        """_IO_COLUMNS of the runs that read ("in") or wrote ("out") the datasets `keys`, in key order
        (first_only: at most one row, to tell whether there is any)."""
        out: list[tuple] = []
        for chunk in _chunks(keys):
            sql = (f"WITH k(ns, name) AS (VALUES {', '.join(['(?, ?)'] * len(chunk))}) SELECT {_IO_COLUMNS}"
                   " FROM k CROSS JOIN run_io AS t ON t.namespace = k.ns AND t.name = k.name AND t.direction = ?"
                   + (" LIMIT 1" if first_only else ""))
            out += self._io_rows(sql, [*(v for k in chunk for v in k), direction])
            if out and first_only:
                break
        return out

    def dataset_revisions(self, keys: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
        """The revision of each stored dataset among `keys`."""
        out: dict[tuple[str, str], int] = {}
        for chunk in _chunks(keys):
            # the planner picks the table (rows of kilobytes, the revision last) without the hint
            sql = (f"WITH k(ns, name) AS (VALUES {', '.join(['(?, ?)'] * len(chunk))})"
                   " SELECT t.namespace, t.name, t.revision FROM k CROSS JOIN datasets AS t"
                   " INDEXED BY datasets_revision ON t.namespace = k.ns AND t.name = k.name")
            out.update(((ns, name), revision) for ns, name, revision in self._io_rows(sql, [v for k in chunk for v in k]))
        return out

    def walk(self, start: Node, depth: int = 20, direction: str = "both") -> Walk:
        """Follow lineage from `start` for up to `depth` job hops: upstream through the runs that
        wrote each dataset version, downstream through the runs that read it."""
        if direction not in ("both", "upstream", "downstream"):
            raise ValueError("direction must be both, upstream or downstream")
        walk = Walk(start)
        start_runs = ([r[0] for r in self._conn().execute(
            "SELECT run_id FROM runs WHERE job_namespace = ? AND job_name = ?", start.key)]
            if start.type == "JOB" else [])
        with self._io_index_lock:
            index = self._io_index_current()
            for side in ("upstream", "downstream"):
                if direction in (side, "both"):
                    index.walk_side(walk, start, start_runs, max(depth, 0), side)
        if start.type == "DATASET":
            walk.add_dataset(start.key, None, 0, "start")
        else:
            walk.add_job(start.key, None, 0, "start")
        return walk

    def paged_walk(self, start: Node, depth: int, direction: str, fanout: int) -> PagedWalk:
        """A PagedWalk from `start` at the store's current revision, no node placed yet."""
        if direction not in ("both", "upstream", "downstream"):
            raise ValueError("direction must be both, upstream or downstream")
        start_runs = ([r[0] for r in self._conn().execute(
            "SELECT run_id FROM runs WHERE job_namespace = ? AND job_name = ?", start.key)]
            if start.type == "JOB" else [])
        with self._io_index_lock:
            revision = self._io_index_current().seen
        return PagedWalk(start, start_runs, depth, direction, fanout, revision)

    def advance(self, walk: PagedWalk, count: int) -> bool:
        """Place `walk`'s nodes up to `count`; False (nothing done) when the store has changed since
        the walk began (its pages would no longer agree: begin again)."""
        with self._io_index_lock:
            index = self._io_index_current()
            if index.seen != walk.revision:
                return False
            walk.advance(index, count)
        return True

    def revision(self) -> int:
        """The highest stored event id (any process's): walks from the same start agree while it holds."""
        with self._io_index_lock:
            return self._io_index_current().seen

    def _io_index_current(self) -> "_IoIndex":
        """The process's run_io index, brought up to the stored events (any process's writes): the
        runs of events newer than the index are read again. Call with _io_index_lock held."""
        conn = self._conn()
        conn.execute("BEGIN")  # one read snapshot: the high-water mark and the rows agree
        try:
            top = conn.execute("SELECT max(id) FROM events").fetchone()[0] or 0
            index = self._io_index
            if top != index.seen:
                cursor = conn.cursor()
                cursor.row_factory = None
                columns = "run_id, direction, namespace, name, version, job_namespace, job_name"
                if index.seen == 0:
                    index.load(cursor.execute(f"SELECT {columns} FROM run_io").fetchall(), ())
                else:
                    runs = [r[0] for r in cursor.execute("SELECT DISTINCT run_id FROM events WHERE id > ?",
                                                         (index.seen,))]
                    rows: list[tuple] = []
                    for chunk in _chunks(runs):
                        rows += cursor.execute(f"SELECT {columns} FROM run_io WHERE run_id IN"
                                               f" ({', '.join('?' * len(chunk))})", chunk).fetchall()
                    index.load(rows, runs)
                index.seen = top
            index.loaded = True
        finally:
            conn.execute("COMMIT")
        return index

    # -- reads ---------------------------------------------------------------------------------

    def query(self, sql: str, params: Iterable = ()) -> list[sqlite3.Row]:
        return self._conn().execute(sql, tuple(params)).fetchall()

    def rows_by_keys(self, table: str, key_cols: tuple[str, ...], keys: list[tuple]) -> dict[tuple, sqlite3.Row]:
        return self._existing(self._conn(), table, key_cols, keys)

    def counts(self) -> dict[str, int]:
        conn = self._conn()
        return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                for t in ("events", "namespaces", "jobs", "runs", "datasets", "dataset_versions", "run_io")}
