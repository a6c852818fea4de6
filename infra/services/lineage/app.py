"""The lineage service: a Marquez-compatible subset of the API, Crucible's trace and provenance
report endpoints, and the auditors' page at `/`.

    POST /api/v1/lineage                       one OpenLineage event or a JSON array of them
    GET  /api/v1/lineage?nodeId=&depth=        Marquez LineageGraph (also &direction=upstream|downstream), one
                                               bounded page: &limit=&fanout=&maxBytes=&cursor= (see views.graph_page)
    GET  /api/v1/namespaces                    and /namespaces/{ns}, /namespaces/{ns}/jobs[/{job}[/runs]],
                                               /namespaces/{ns}/datasets[/{dataset}[/versions[/{version}]]]
    GET  /api/v1/jobs/runs/{runId}
    GET  /api/v1/search?q=&filter=&sort=&limit=
    GET  /api/v1/events/lineage?limit=&offset=
    GET  /api/v1/crucible/node?nodeId=         detail for the page: object, versions/runs, links
    GET  /api/v1/crucible/trace?nodeId=        upstream raw sources with their licences
    GET  /api/v1/crucible/report?nodeId=&format=md|json
    GET  /api/v1/crucible/stats, /healthz

Path parameters that contain '/' or ':' (namespaces such as `mlflow://127.0.0.1:5000`, file paths
as dataset names) should be percent-encoded, as with Marquez; unencoded ones are resolved against
the stored namespaces and names where that is unambiguous.

Trust: a write needs the write token (`Authorization: Bearer ...`; a service without one refuses
writes), and every event is checked against the OpenLineage spec before anything is stored (an
invalid one gets 400 naming the failing fields; `?validate=false` skips the check for a trusted
bulk load). Reads are public unless the service has a read token; the page, /static and /healthz
always are.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from infra.services.lineage.fastjson import dumps_bytes, loads
from infra.services.lineage.provenance import TRACE_DEPTH, Provenance, report_markdown
from infra.services.lineage.store import EventError, LineageStore, Node, node_id, utc_time
from infra.services.lineage.views import (
    DEFAULT_FANOUT,
    DEFAULT_LIMIT,
    DEFAULT_MAX_BYTES,
    EncodedDatasets,
    Links,
    dataset_links,
    dataset_obj,
    facet_urls,
    graph_answer,
    io_for_runs,
    jobs_objs,
    run_links,
    run_obj,
    unique_links,
    version_obj,
    PagedWalks,
    _ms,
)

class Problem(BaseModel):
    """FastAPI's error body: {"detail": ...} (and, for an invalid event, the schema errors)."""
    detail: Any
    errors: dict | None = None


# documented on every route, so clients (and the fuzzer in tests/test_fuzz.py) know every answer
ERRORS = {status: {"model": Problem, "description": what} for status, what in (
    (400, "malformed request or an event that does not match the OpenLineage spec"),
    (401, "missing or wrong bearer token"), (403, "writes disabled: no write token configured"),
    (404, "no such node, namespace, job, dataset or run"))}

STATIC_DIR = Path(__file__).resolve().parent / "static"
API = "/api/v1"
MAX_DEPTH = 200
MAX_PAGE = 10_000  # rows per page of a listing
MAX_GRAPH_NODES = 1_000_000  # what a client may ask for explicitly (limit, fanout) ...
MAX_GRAPH_BYTES = 1 << 30  # ... and maxBytes
MAX_OFFSET = 2**53  # SQLite's INTEGER holds it (a larger offset was a 500: the fuzzer found it)


def _ok(data, headers: dict | None = None) -> Response:
    """JSON response encoded once (FastAPI's generic encoder is slow on large graphs)."""
    return Response(dumps_bytes(data), media_type="application/json", headers=headers)


def _namespace_obj(row) -> dict:
    return {"name": row["name"], "createdAt": row["created_at"], "updatedAt": row["updated_at"],
            "ownerName": None, "description": None, "isHidden": False}


def bearer(*tokens: str | None, what: str, required: bool = True):
    """A dependency admitting a request whose bearer token is one of `tokens` (none configured and
    required: refused with 403; not required: open)."""
    allowed = [t.encode() for t in tokens if t]

    def check(request: Request) -> None:
        if not allowed:
            if required:
                raise HTTPException(403, f"{what} is disabled: the service has no token for it (--write-token-file)")
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.strip().encode(), t) for t in allowed):
            raise HTTPException(401, f"{what} needs the service's bearer token", headers={"WWW-Authenticate": "Bearer"})
    return check


def create_app(db_path: str | Path, *, prefect_ui_url: str | None = None, mlflow_ui_url: str | None = None,
               spec_dir: str | Path | None = None, write_token: str | None = None,
               read_token: str | None = None) -> FastAPI:
    """The app over the SQLite store at `db_path` (created if missing).

    prefect_ui_url / mlflow_ui_url: base URLs for links in the page and reports (optional; model
    versions in `mlflow://host:port` namespaces link to that host without it). spec_dir: the
    OpenLineage spec copy events are validated against (default: the shared data copy).
    write_token: what a POST must send (None: writes refused); read_token: what API reads must send
    (None: public reads; the write token also reads)."""
    store = LineageStore(db_path)
    store.warm()  # the walks' run_io index, read here rather than by the first graph query
    links = Links(prefect_ui_url=prefect_ui_url, mlflow_ui_url=mlflow_ui_url)
    app = FastAPI(title="Crucible lineage", version="1.0",
                  description="OpenLineage store with a Marquez-compatible API and provenance reports.")
    app.state.store = store
    app.state.links = links
    reads = [Depends(bearer(read_token, write_token if read_token else None, what="reading", required=False))]
    app.include_router(_page_router(store, reads))
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.include_router(_ingest_router(store, spec_dir), dependencies=[Depends(bearer(write_token, what="writing"))])
    for router in (_graph_router(store), _namespace_router(store), _browse_router(store),
                   _crucible_router(store, links, Provenance(store, links))):
        app.include_router(router, dependencies=reads)
    return app


def _node_or_error(store: LineageStore, value: str) -> Node:
    """The stored node a request names (400: not a node id, 404: not stored)."""
    try:
        node = store.resolve(value)
    except ValueError as e:
        raise HTTPException(400, str(e)) from None
    if not store.exists(node):
        raise HTTPException(404, f"node not found: {value}")
    return node


def _page_router(store: LineageStore, reads: list) -> APIRouter:
    """The auditors' page, health and counts."""
    router = APIRouter(responses=ERRORS)

    @router.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @router.get("/healthz")
    def healthz() -> dict:
        store.query("SELECT 1")
        return {"status": "ok"}

    @router.get(f"{API}/crucible/stats", dependencies=reads)
    def stats() -> dict:
        return store.counts()

    return router


def _ingest_router(store: LineageStore, spec_dir: str | Path | None) -> APIRouter:
    """POST /api/v1/lineage: one event or a JSON array, optionally checked against the schemas."""
    router = APIRouter(responses=ERRORS)

    def parse_check_store(raw: bytes, validate: bool) -> JSONResponse:
        try:
            body = loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise HTTPException(400, f"body is not JSON: {e}") from None
        events = body if isinstance(body, list) else [body]
        if validate:
            from tasks.lineage.validate import event_errors

            errors = {i: errs for i, e in enumerate(events)
                      if (errs := event_errors(e, spec_dir) if isinstance(e, dict) else ["not an object"])}
            if errors:  # nothing of the request is stored
                first = next(iter(errors.items()))
                return JSONResponse({"detail": f"event {first[0]} does not match the OpenLineage schema: "
                                               f"{first[1][0]}",
                                     "errors": {str(i): errs[:20] for i, errs in errors.items()}}, 400)
        try:
            return JSONResponse(store.ingest_batch(events), 201)
        except EventError as e:
            raise HTTPException(400, str(e)) from None

    @router.post(f"{API}/lineage", status_code=201)
    async def post_lineage(request: Request, validate: bool = True) -> JSONResponse:
        # parsed, validated and stored on a worker thread: the event loop meanwhile receives the
        # next request's body, and SQLite (which lets go of the GIL) writes one batch while the
        # next is parsed and validated (replay keeps two batches in flight)
        return await run_in_threadpool(parse_check_store, await request.body(), validate)

    return router


def _cursor(node: Node, depth: int, direction: str, fanout: int, at: str) -> str:
    """An opaque cursor: a position in the query's pages (views.parse_position), tied to the query."""
    query = hashlib.sha256(f"{node.id}|{depth}|{direction}|{fanout}".encode()).hexdigest()[:16]
    return base64.urlsafe_b64encode(f"{at}.{query}".encode()).decode().rstrip("=")


def _cursor_position(cursor: str, node: Node, depth: int, direction: str, fanout: int) -> str:
    try:
        at = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode().rsplit(".", 1)[0]
    except (ValueError, UnicodeDecodeError):
        raise HTTPException(400, "cursor is not one this service gave") from None
    if _cursor(node, depth, direction, fanout, at) != cursor:
        raise HTTPException(400, "cursor belongs to another query (nodeId, depth, direction and fanout must match)")
    return at


def _graph_router(store: LineageStore) -> APIRouter:
    """GET /api/v1/lineage: Marquez's lineage graph around a node, one bounded page at a time."""
    router = APIRouter(responses=ERRORS)
    encoded = EncodedDatasets()
    walks = PagedWalks()

    @router.get(f"{API}/lineage")
    def get_lineage(node_id_value: str = Query(..., alias="nodeId"), depth: int = Query(20, ge=0, le=MAX_DEPTH),
                    direction: str = Query("both", pattern="^(both|upstream|downstream)$"),
                    limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_GRAPH_NODES,
                                       description="nodes per page"),
                    fanout: int = Query(DEFAULT_FANOUT, ge=1, le=MAX_GRAPH_NODES,
                                        description="a node's neighbours shown before its fan-out's 'N more' group"),
                    max_bytes: int = Query(DEFAULT_MAX_BYTES, alias="maxBytes", ge=10_000, le=MAX_GRAPH_BYTES),
                    cursor: str | None = Query(None, max_length=200,
                                               description="page.nextCursor or a group's cursor")) -> Response:
        node = _node_or_error(store, node_id_value)
        at = _cursor_position(cursor, node, depth, direction, fanout) if cursor else "0"
        try:
            body = graph_answer(store, walks, encoded, node, depth=depth, direction=direction, fanout=fanout, at=at,
                                limit=limit, max_bytes=max_bytes,
                                cursor_for=lambda pos: _cursor(node, depth, direction, fanout, pos))
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        return Response(body, media_type="application/json")

    return router


def _namespace_router(store: LineageStore) -> APIRouter:
    """Namespaces and, under them, jobs (with runs) and datasets (with versions)."""
    router = APIRouter(responses=ERRORS)

    @router.get(f"{API}/namespaces")
    def namespaces(limit: int = Query(100, ge=1, le=MAX_PAGE),
                   offset: int = Query(0, ge=0, le=MAX_OFFSET)) -> dict:
        rows = store.query("SELECT * FROM namespaces ORDER BY name LIMIT ? OFFSET ?", (limit, offset))
        return {"namespaces": [_namespace_obj(r) for r in rows],
                "totalCount": store.query("SELECT count(*) FROM namespaces")[0][0]}

    @router.get(API + "/namespaces/{rest:path}")
    def namespace_routes(request: Request, rest: str, limit: int = Query(100, ge=1, le=MAX_PAGE),
                         offset: int = Query(0, ge=0, le=MAX_OFFSET)) -> Response:
        ns, segs = _split_namespace_path(request, rest, store.namespaces_known())
        if ns is None:
            raise HTTPException(404, f"namespace not found in {rest!r}")
        if not segs:
            return _namespace_obj(store.query("SELECT * FROM namespaces WHERE name = ?", (ns,))[0])
        kind = segs[0]
        if kind == "jobs" and len(segs) == 1:
            rows = store.query("SELECT * FROM jobs WHERE namespace = ? ORDER BY name LIMIT ? OFFSET ?",
                               (ns, limit, offset))
            total = store.query("SELECT count(*) FROM jobs WHERE namespace = ?", (ns,))[0][0]
            return _ok({"jobs": jobs_objs(store, rows), "totalCount": total})
        if kind == "datasets" and len(segs) == 1:
            rows = store.query("SELECT * FROM datasets WHERE namespace = ? ORDER BY name LIMIT ? OFFSET ?",
                               (ns, limit, offset))
            total = store.query("SELECT count(*) FROM datasets WHERE namespace = ?", (ns,))[0][0]
            return _ok({"datasets": [dataset_obj(r) for r in rows], "totalCount": total})
        if kind not in ("jobs", "datasets"):
            raise HTTPException(404, f"unknown resource {kind!r}")
        table = "jobs" if kind == "jobs" else "datasets"
        for name, sub in _name_candidates(segs[1:], ("runs",) if kind == "jobs" else ("versions",)):
            row = store.query(f"SELECT * FROM {table} WHERE namespace = ? AND name = ?", (ns, name))
            if not row:
                continue
            if kind == "jobs":
                return _job_resource(store, ns, name, row, sub, limit, offset)
            return _dataset_resource(store, ns, name, row, sub, limit, offset)
        raise HTTPException(404, f"{kind[:-1]} not found in namespace {ns!r}: {'/'.join(segs[1:])}")

    return router


def _job_resource(store: LineageStore, ns: str, name: str, row: list, sub: tuple[str, ...], limit: int,
                  offset: int):
    """/namespaces/{ns}/jobs/{job}[/runs]."""
    if not sub:
        return jobs_objs(store, row)[0]
    runs = store.query("SELECT * FROM runs WHERE job_namespace = ? AND job_name = ?"
                       " ORDER BY created_at DESC LIMIT ? OFFSET ?", (ns, name, limit, offset))
    io = io_for_runs(store, [r["run_id"] for r in runs])
    total = store.query("SELECT count(*) FROM runs WHERE job_namespace = ? AND job_name = ?",
                        (ns, name))[0][0]
    return _ok({"runs": [run_obj(r, io[r["run_id"]]) for r in runs], "totalCount": total})


def _dataset_resource(store: LineageStore, ns: str, name: str, row: list, sub: tuple[str, ...], limit: int,
                      offset: int):
    """/namespaces/{ns}/datasets/{dataset}[/versions[/{version}]]."""
    if not sub:
        return dataset_obj(row[0])
    version = sub[1] if len(sub) > 1 else None
    sql, params = "SELECT * FROM dataset_versions WHERE namespace = ? AND name = ?", [ns, name]
    if version:
        sql, params = sql + " AND version = ?", params + [version]
    rows = store.query(sql + " ORDER BY created_at DESC LIMIT ? OFFSET ?", params + [limit, offset])
    objs = [version_obj(r, _run_or_none(store, r["created_by_run"])) for r in rows]
    if version:
        if not objs:
            raise HTTPException(404, f"version not found: {version}")
        return objs[0]
    return {"versions": objs, "totalCount": len(objs) if len(objs) < limit else store.query(
        "SELECT count(*) FROM dataset_versions WHERE namespace = ? AND name = ?", (ns, name))[0][0]}


def _browse_router(store: LineageStore) -> APIRouter:
    """A run by id, search over jobs and datasets, and the stored events."""
    router = APIRouter(responses=ERRORS)

    @router.get(API + "/jobs/runs/{run_id}")
    def get_run(run_id: str) -> dict:
        rows = store.query("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        if not rows:
            raise HTTPException(404, f"run not found: {run_id}")
        return run_obj(rows[0], io_for_runs(store, [run_id])[run_id])

    @router.get(f"{API}/search")
    def search(q: str = Query(..., min_length=1), filter: str | None = None, sort: str = "name",
               limit: int = Query(10, ge=1, le=1000), namespace: str | None = None) -> dict:
        return _search(store, q, filter, sort, limit, namespace)

    @router.get(f"{API}/events/lineage")
    def events(limit: int = Query(100, ge=1, le=MAX_PAGE), offset: int = Query(0, ge=0, le=MAX_OFFSET),
               before: str | None = None,
               after: str | None = None, sortDirection: str = "desc") -> Response:
        where, params = [], []
        try:
            if before:
                where, params = where + ["event_time < ?"], params + [utc_time(before, "before")]
            if after:
                where, params = where + ["event_time > ?"], params + [utc_time(after, "after")]
        except EventError as e:
            raise HTTPException(400, str(e)) from None
        clause = (" WHERE " + " AND ".join(where)) if where else ""
        order = "ASC" if sortDirection.lower() == "asc" else "DESC"
        rows = store.query(f"SELECT payload FROM events{clause} ORDER BY event_time {order}, id {order}"
                           " LIMIT ? OFFSET ?", params + [limit, offset])
        total = store.query(f"SELECT count(*) FROM events{clause}", params)[0][0]
        return _ok({"events": [loads(r["payload"]) for r in rows], "totalCount": total})

    return router


def _search(store: LineageStore, q: str, kind: str | None, sort: str, limit: int, namespace: str | None) -> dict:
    """Marquez's search: datasets and/or jobs whose name matches `q` (`%`/`_` wildcards)."""
    pattern = f"%{q}%"
    parts, params = [], []
    if kind is None or kind.upper() == "DATASET":
        parts.append("SELECT 'DATASET' AS type, namespace, name, updated_at, current_version AS version,"
                     " json_extract(facets, '$.crucible_source.licence') AS licence FROM datasets"
                     " WHERE (name LIKE ? OR namespace || ':' || name LIKE ?)"
                     + (" AND namespace = ?" if namespace else ""))
        params += [pattern, pattern] + ([namespace] if namespace else [])
    if kind is None or kind.upper() == "JOB":
        parts.append("SELECT 'JOB' AS type, namespace, name, updated_at, NULL AS version, NULL AS licence"
                     " FROM jobs WHERE (name LIKE ? OR namespace || ':' || name LIKE ?)"
                     + (" AND namespace = ?" if namespace else ""))
        params += [pattern, pattern] + ([namespace] if namespace else [])
    if not parts:
        raise HTTPException(400, "filter must be DATASET or JOB")
    union = " UNION ALL ".join(parts)
    order = "updated_at DESC" if sort.lower() in ("updated_at", "updatedat") else "name"
    total = store.query(f"SELECT count(*) FROM ({union})", params)[0][0]
    rows = store.query(f"SELECT * FROM ({union}) ORDER BY {order} LIMIT ?", params + [limit])
    return {"totalCount": total, "results": [
        {"type": r["type"], "name": r["name"], "updatedAt": r["updated_at"], "namespace": r["namespace"],
         "nodeId": node_id(r["type"], r["namespace"], r["name"]), "version": r["version"],
         "licence": r["licence"]} for r in rows]}


def _crucible_router(store: LineageStore, links: Links, prov: Provenance) -> APIRouter:
    """Crucible's own endpoints: node detail for the page, the source trace, the provenance report."""
    router = APIRouter(responses=ERRORS)

    @router.get(f"{API}/crucible/node")
    def node_detail(node_id_value: str = Query(..., alias="nodeId")) -> Response:
        node = _node_or_error(store, node_id_value)
        return _ok(_node_detail(store, node, links))

    @router.get(f"{API}/crucible/trace")
    def trace(node_id_value: str = Query(..., alias="nodeId"),
              depth: int = Query(TRACE_DEPTH, ge=0, le=MAX_DEPTH)) -> Response:
        node = _node_or_error(store, node_id_value)
        return _ok(prov.trace(node.id, depth))

    @router.get(f"{API}/crucible/report")
    def report(node_id_value: str = Query(..., alias="nodeId"), format: str = Query("json", pattern="^(md|json)$"),
               download: bool = False, depth: int = Query(TRACE_DEPTH, ge=0, le=MAX_DEPTH)) -> Response:
        node = _node_or_error(store, node_id_value)
        data = prov.report(node.id, depth)
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", f"provenance_{node.name}").strip("_")[:120]
        headers = {"Content-Disposition": f'attachment; filename="{stem}.{format}"'} if download else {}
        if format == "md":
            return PlainTextResponse(report_markdown(data), media_type="text/markdown; charset=utf-8",
                                     headers=headers)
        return _ok(data, headers)

    return router


def _run_or_none(store: LineageStore, run_id: str | None) -> dict | None:
    if not run_id:
        return None
    rows = store.query("SELECT * FROM runs WHERE run_id = ?", (run_id,))
    return run_obj(rows[0], io_for_runs(store, [run_id])[run_id]) if rows else None


def _split_namespace_path(request: Request, rest: str, known: list[str]) -> tuple[str | None, list[str]]:
    """(namespace, remaining path segments) from /namespaces/<...>, percent-encoded or not."""
    raw = request.scope.get("raw_path") or b""
    raw_text = raw.decode("latin-1")
    marker = f"{API}/namespaces/"
    if marker in raw_text:
        segs = raw_text.split(marker, 1)[1].split("/")
        first = unquote(segs[0])
        if first in known:
            return first, [unquote(s) for s in segs[1:]]
    for ns in sorted(known, key=len, reverse=True):
        if rest == ns:
            return ns, []
        if rest.startswith(ns + "/"):
            return ns, rest[len(ns) + 1:].split("/")
    return None, []


def _name_candidates(segs: list[str], subs: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
    """Readings of <name>[/<sub>[/<id>]] when the name itself may contain unencoded '/'."""
    out = [("/".join(segs), ())]
    for i in range(len(segs) - 1, 0, -1):
        if segs[i] in subs and len(segs) - i <= 2:
            out.append(("/".join(segs[:i]), tuple(segs[i:])))
    if len(segs) >= 2 and segs[1] in subs:
        out.insert(0, (segs[0], tuple(segs[1:])))
    elif len(segs) == 1:
        out = [(segs[0], ())]
    # an unencoded absolute path (file namespace) lost its leading '/' to the separator
    return out + [("/" + name, sub) for name, sub in out if not name.startswith("/")]


def _node_detail(store: LineageStore, node: Node, links: Links) -> dict:
    if node.type == "JOB":
        row = store.query("SELECT * FROM jobs WHERE namespace = ? AND name = ?", node.key)
        job = jobs_objs(store, row)[0]
        runs = store.query("SELECT * FROM runs WHERE job_namespace = ? AND job_name = ? ORDER BY created_at DESC"
                           " LIMIT 50", node.key)
        io = io_for_runs(store, [r["run_id"] for r in runs])
        run_list = []
        for r in runs:
            facets = loads(r["facets"])
            run_list.append({"runId": r["run_id"], "state": r["state"], "startedAt": r["started_at"],
                             "endedAt": r["ended_at"], "durationMs": _ms(r["started_at"], r["ended_at"]),
                             "inputs": sum(1 for x in io[r["run_id"]] if x["direction"] == "in"),
                             "outputs": sum(1 for x in io[r["run_id"]] if x["direction"] == "out"),
                             "error": (facets.get("errorMessage") or {}).get("message"),
                             "links": run_links(r["run_id"], row[0]["job_type"], facets, links)})
        return {"nodeId": node.id, "type": "JOB", "namespace": node.namespace, "name": node.name, "data": job,
                "jobType": row[0]["job_type"], "runs": run_list,
                "links": unique_links(facet_urls(job["facets"]) + (run_list[0]["links"] if run_list else []))}
    row = store.query("SELECT * FROM datasets WHERE namespace = ? AND name = ?", node.key)[0]
    data = dataset_obj(row)
    io_rows = store.query(
        "SELECT io.*, r.state, r.ended_at FROM run_io io JOIN runs r ON r.run_id = io.run_id"
        " WHERE io.namespace = ? AND io.name = ? ORDER BY io.event_time DESC LIMIT 100", node.key)
    job_types = {(r["namespace"], r["name"]): r["job_type"] for r in store.rows_by_keys(
        "jobs", ("namespace", "name"), list({(r["job_namespace"], r["job_name"]) for r in io_rows})).values()}

    def use(r) -> dict:
        facets = loads(r["facets"])
        return {"runId": r["run_id"], "job": r["job_name"], "jobNamespace": r["job_namespace"],
                "jobId": node_id("JOB", r["job_namespace"], r["job_name"]), "version": r["version"] or None, "state": r["state"], "at": r["event_time"], "ioFacets": facets}

    producers = [use(r) for r in io_rows if r["direction"] == "out"]
    consumers = [use(r) for r in io_rows if r["direction"] == "in"]
    rows_count = None
    for u in producers + consumers:
        for name in ("outputStatistics", "dataQualityMetrics", "inputStatistics"):
            f = u["ioFacets"].get(name)
            if isinstance(f, dict) and f.get("rowCount") is not None:
                rows_count = rows_count if rows_count is not None else {"rows": f.get("rowCount"),
                                                                         "bytes": f.get("bytes") or f.get("size")}
    versions = store.query("SELECT * FROM dataset_versions WHERE namespace = ? AND name = ?"
                           " ORDER BY created_at DESC LIMIT 50", node.key)
    source = data["facets"].get("crucible_source")
    run_link_list = []
    for p in producers[:3]:
        rr = store.query("SELECT facets FROM runs WHERE run_id = ?", (p["runId"],))
        if rr:
            run_link_list += run_links(p["runId"], job_types.get((p["jobNamespace"], p["job"])),
                                       loads(rr[0]["facets"]), links)
    return {
        "nodeId": node.id, "type": "DATASET", "namespace": node.namespace, "name": node.name, "data": data,
        "version": row["current_version"],
        "source": {k: v for k, v in source.items() if not k.startswith("_")} if isinstance(source, dict) else None,
        "rowCount": rows_count,
        "isModelVersion": node.namespace.startswith("mlflow://") and node.name.startswith("models/"),
        "versions": [{"version": v["version"], "createdAt": v["created_at"], "createdByRun": v["created_by_run"]}
                     for v in versions],
        "producers": producers[:20], "consumers": consumers[:20],
        "links": unique_links(dataset_links(node.namespace, node.name, data["facets"], links) + run_link_list),
    }
