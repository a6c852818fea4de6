"""Ingestion rate and lineage query latency of the lineage service at one or more sizes of event
log; print the figures and write a JSON result to benchmarks/results/lineage_service.json.

    .venv/bin/python benchmarks/lineage_service.py [--pipelines 334 3340] [--batch-size 500]
        [--log-dir DIR]   # keep (and on a later run reuse) the generated logs there

Each log is made with Crucible's own emitter (infra.services.lineage.sample): `--pipelines`
`pretrain` runs of 34 events each (334: ~11,000 events, 3340: ~113,000), every run resuming
training from the previous run's last checkpoint, so the model versions form one long chain of
runs and artifacts, all sharing the same raw files. Measured per size:

- ingestion into the store directly (ingest_batch) and over HTTP into a real uvicorn process
  (`replay`, as `crucible lineage replay` sends a log: signatures checked, batches of 500, two in
  flight; every event validated by the service), plus re-ingestion of the same log (all
  duplicates); with the CPU time per event of the store, the service and the client;
- GET /api/v1/lineage at depth 20 with the default bounds (one page: 200 nodes, 2 MB), as a
  client sees it: from sending the request to the parsed JSON, one figure. Every kind of query:
  upstream, downstream and both from `--queries` randomly chosen (seeded) raw files and model
  versions each, and both from the newest model version. Unbounded, downstream from a raw file
  reaches every run (5,354 nodes and 21.9 MB at 10,000 events; 53,450 nodes at 100,000). A page
  takes the walk only as far as it shows (`total_nodes`: the nodes found by then, `complete`:
  the walk done). The first queries meet cold caches, as after any ingestion; the service keeps
  the walks of recent queries while the store is unchanged (the next pages continue them), so the
  first query from each start is also reported apart (`first_query_per_start_*`: the sample has
  5 raw files). `service_cpu_ms_per_query`: the service process's CPU time
  (/proc, 10 ms ticks) over the series divided by its queries, a figure other work on a shared
  machine inflates far less than latency;
- the trace and provenance report of the newest model version.

Targets (issues 7, 15 and 27): at ~10,000 events every kind of depth-20 graph query <= 200 ms
median and <= 500 ms p99; at ~100,000 events <= 500 ms median and ingestion >= 3,000 events/s.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # lineage_helpers: the tests' launcher of a real service process

from _common import write_result  # noqa: E402
from infra.services.lineage.sample import write_sample_log  # noqa: E402
from infra.services.lineage.store import LineageStore, node_id  # noqa: E402
from infra.services.lineage.views import DEFAULT_FANOUT, DEFAULT_LIMIT, DEFAULT_MAX_BYTES  # noqa: E402
from lineage_helpers import start_service  # noqa: E402
from tasks.core.net import free_port  # noqa: E402
from tasks.lineage.replay import iter_events, replay  # noqa: E402

# events in the log -> (median ms, p99 ms or None) of every kind of depth-20 graph query, ingestion events/s
TARGETS = {10_000: (200, 500, 1000), 100_000: (500, None, 3000)}
GRAPH_KINDS = {  # kind -> (start, direction)
    "graph_depth20_upstream_random_model": ("model", "upstream"),
    "graph_depth20_downstream_random_model": ("model", "downstream"),
    "graph_depth20_both_random_model": ("model", "both"),
    "graph_depth20_upstream_random_raw_file": ("raw", "upstream"),
    "graph_depth20_downstream_random_raw_file": ("raw", "downstream"),
    "graph_depth20_both_random_raw_file": ("raw", "both"),
}


def _targets(events: int) -> tuple[int, int | None, int]:
    """The targets of the nearest size at or below `events` (a log is ~10 k or ~100 k events)."""
    return TARGETS[max([size for size in TARGETS if size <= events * 1.2] or [min(TARGETS)])]


def _percentile(sorted_times: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of 100 queries: the second slowest)."""
    return sorted_times[max(math.ceil(q * len(sorted_times)) - 1, 0)]


def _figures(times: list[float]) -> dict:
    times = sorted(times)
    return {"median_ms": round(statistics.median(times), 1), "p95_ms": round(_percentile(times, 0.95), 1),
            "p99_ms": round(_percentile(times, 0.99), 1), "max_ms": round(times[-1], 1), "runs": len(times)}


def _timed(fn, repeat: int) -> dict:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1000)
    return {**_figures(times), "last": out}


def _ingest_direct(db: Path, events: list[dict], batch_size: int) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds of this process, counts)."""
    store = LineageStore(db)
    totals = {"ingested": 0, "duplicates": 0}
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, len(events), batch_size):
        r = store.ingest_batch(events[i:i + batch_size])
        totals["ingested"] += r["ingested"]
        totals["duplicates"] += r["duplicates"]
    return time.perf_counter() - t0, time.process_time() - c0, totals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipelines", type=int, nargs="+", default=[334, 3340],
                    help="pretrain runs (34 events each) per size of log")
    ap.add_argument("--batch-size", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=20, help="repetitions of the newest model's queries")
    ap.add_argument("--queries", type=int, nargs="+", default=[100, 40],
                    help="random start nodes per kind of graph query, per size (the last for the rest)")
    ap.add_argument("--seed", type=int, default=15, help="seed of the start nodes' choice")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "lineage_service.json"))
    ap.add_argument("--log-dir", default=None,
                    help="where the generated logs stay (<dir>/<pipelines>/lineage.jsonl, reused when there)")
    args = ap.parse_args()
    sizes = {}
    for i, pipelines in enumerate(args.pipelines):
        work = Path(tempfile.mkdtemp(prefix="lineage-bench-"))
        try:
            sizes[str(pipelines)] = _run(args, pipelines, work, args.queries[min(i, len(args.queries) - 1)])
        finally:
            shutil.rmtree(work, ignore_errors=True)
    result = {
        "benchmark": "lineage_service",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "graph_query_bounds": {"limit": DEFAULT_LIMIT, "fanout": DEFAULT_FANOUT, "maxBytes": DEFAULT_MAX_BYTES},
        "timing": "graph queries: request sent to the answer parsed as JSON by the client (httpx, orjson)",
        "sizes": sizes,
        "within_target": all(all(size["within_target"].values()) for size in sizes.values()),
    }
    write_result(args.out, result)
    print(f"wrote {args.out}")
    return 0 if result["within_target"] else 1


def _sample_log(args: argparse.Namespace, pipelines: int, work: Path) -> tuple[Path, float | None]:
    """(the log, seconds to generate it; None when reused from --log-dir)."""
    folder = Path(args.log_dir) / str(pipelines) if args.log_dir else work / "runs"
    if (folder / "lineage.jsonl").exists():
        return folder / "lineage.jsonl", None
    t0 = time.perf_counter()
    log, _ = write_sample_log(folder, pipelines=pipelines)
    return log, time.perf_counter() - t0


def _run(args: argparse.Namespace, pipelines: int, work: Path, n_queries: int) -> dict:
    log, gen_s = _sample_log(args, pipelines, work)
    events = list(iter_events(log))
    n = len(events)
    print(f"{n} events ({pipelines} pipeline runs)" + (f", generated with the emitter in {gen_s:.1f} s" if gen_s else
                                                        f" from {log}"))
    load_before = os.getloadavg()
    direct_s, direct_cpu_s, direct = _ingest_direct(work / "direct.db", events, args.batch_size)
    again_s, _, again = _ingest_direct(work / "direct.db", events, args.batch_size)
    assert direct["ingested"] == n and again["duplicates"] == n
    del events
    (work / "token").write_text("bench-token\n")
    proc, base = start_service(work / "http.db", free_port(), timeout=60, token_file=work / "token")
    try:
        # validated, as every write; replay as `crucible lineage replay` runs it (two batches in flight)
        cpu0, client0, load_http = _cpu_seconds(proc.pid), time.process_time(), os.getloadavg()
        t0 = time.perf_counter()
        http = replay(log, base, batch_size=args.batch_size, token="bench-token")
        http_s = time.perf_counter() - t0
        service_cpu_s, client_cpu_s = _cpu_seconds(proc.pid) - cpu0, time.process_time() - client0
        assert http["ingested"] == n, http
        queries, stats = _query_service(base, LineageStore(work / "http.db"), args, n_queries, proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    rates = {
        "direct_ingest_batch": round(n / direct_s),
        "direct_ingest_batch_per_cpu_s": round(n / direct_cpu_s),
        "http_replay": round(n / http_s),
        "direct_reingest_duplicates": round(n / again_s),
    }
    median_ms, p99_ms, events_per_s = _targets(n)
    graphs = [q for name, q in queries.items() if name.startswith("graph_depth20")]
    result = {
        "events": n,
        "pipelines": pipelines,
        "batch_size": args.batch_size,
        # the 1/5/15-minute load averages: other work on the machine slows every figure down
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "store": stats,
        "generate_s": round(gen_s, 1) if gen_s else None,
        "ingest_s": {"direct": round(direct_s, 2), "http": round(http_s, 2), "reingest": round(again_s, 2)},
        "events_per_s": rates,
        # CPU time per event (what other work on the machine inflates far less than the rates):
        # direct: store only; http: the service process (parse, validate, store) and the client
        # (read, check signatures, post), with the load average when the HTTP replay began
        "cpu_us_per_event": {"direct_ingest_batch": round(direct_cpu_s / n * 1e6),
                             "http_service": round(service_cpu_s / n * 1e6),
                             "http_client": round(client_cpu_s / n * 1e6)},
        "load_avg_http_replay": [round(x, 2) for x in load_http],
        "queries": queries,
        "targets": {"events_per_s": events_per_s, "graph_depth20_median_ms": median_ms,
                    "graph_depth20_p99_ms": p99_ms, "graph_answer_bytes": DEFAULT_MAX_BYTES},
        "within_target": {
            "ingest": min(rates["direct_ingest_batch"], rates["http_replay"]) >= events_per_s,
            # every kind of graph query, the newest model's included
            "graph_depth20": all(q["median_ms"] <= median_ms and (p99_ms is None or q["p99_ms"] <= p99_ms)
                                 for q in graphs),
            "graph_answer_bytes": all(q["bytes_max"] <= DEFAULT_MAX_BYTES for q in graphs),
        },
    }
    _print_summary(result)
    return result


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_nodes(store: LineageStore) -> dict[str, list[str]]:
    """The raw files (a crucible_source facet that is not derived) and the model versions (oldest
    first), read from the store the service wrote."""
    raw = [node_id("DATASET", r[0], r[1]) for r in store.query(
        "SELECT namespace, name FROM datasets WHERE json_extract(facets, '$.crucible_source.licence') IS NOT NULL"
        " AND coalesce(json_extract(facets, '$.crucible_source.derived'), 0) = 0 ORDER BY namespace, name")]
    models = sorted(((r[0], r[1]) for r in store.query(
        "SELECT namespace, name FROM datasets WHERE namespace LIKE 'mlflow://%' AND name LIKE 'models/%'")),
        key=lambda k: int(k[1].rsplit("/", 1)[1]))
    return {"raw": raw, "model": [node_id("DATASET", *k) for k in models]}


def _query_service(base: str, store: LineageStore, args: argparse.Namespace, n_queries: int,
                   pid: int) -> tuple[dict, dict]:
    """Timed graph queries of the running service (the random kinds, then both directions from the
    newest model version), its trace and report, and the store's stats."""
    client = httpx.Client(base_url=base, timeout=120)
    starts = _start_nodes(store)
    model = starts["model"][-1]
    rng = random.Random(args.seed)
    queries = {kind: _graph_series(client, [rng.choice(starts[start]) for _ in range(n_queries)], direction, pid)
               for kind, (start, direction) in GRAPH_KINDS.items()}
    queries["graph_depth20_both_newest_model"] = _graph_series(client, [model] * args.repeat, "both", pid)

    def trace():
        t = client.get("/api/v1/crucible/trace", params={"nodeId": model}).json()
        return {"sources": len(t["sources"]), "truncated": t["truncated"]}

    def report():
        r = client.get("/api/v1/crucible/report", params={"nodeId": model, "format": "md"})
        r.raise_for_status()
        return {"bytes": len(r.content)}

    few = max(3, args.repeat // 4)
    queries["trace_full_depth_newest_model"] = _timed(trace, few)
    queries["report_md_full_depth_newest_model"] = _timed(report, few)
    stats = client.get("/api/v1/crucible/stats").json()
    client.close()
    return queries, stats


def _graph_series(client: httpx.Client, nodes: list[str], direction: str, pid: int) -> dict:
    """GET /api/v1/lineage at depth 20 (default bounds) from each node in turn: figures of the time
    from the request to the parsed answer, the service's CPU time, and the answers' sizes."""
    times, sizes, first = [], [], {}
    cpu_before, client_cpu = _cpu_seconds(pid), time.process_time()
    for node in nodes:
        t0 = time.perf_counter()
        resp = client.get("/api/v1/lineage", params={"nodeId": node, "depth": 20, "direction": direction})
        resp.raise_for_status()
        answer = resp.json()
        times.append((time.perf_counter() - t0) * 1000)
        first.setdefault(node, times[-1])
        graph, page = answer["graph"], answer["page"]
        sizes.append({"nodes": len(graph), "jobs": sum(1 for x in graph if x["type"] == "JOB"),
                      "groups": len(answer["groups"]), "total_nodes": page["totalNodes"],
                      "complete": page["complete"], "bytes": len(resp.content)})
    client_cpu_ms = round((time.process_time() - client_cpu) * 1000 / len(nodes), 1)
    cpu_after = _cpu_seconds(pid)
    cpu_ms = None if cpu_before is None or cpu_after is None else round((cpu_after - cpu_before) * 1000 / len(nodes), 1)
    # the service keeps recent walks while the store is unchanged (for the next pages): a start's
    # first query walks, a repeated one does not
    # CPU times: what the query costs without other work on the machine (the client's: request and parse)
    return {**_figures(times), "service_cpu_ms_per_query": cpu_ms, "client_cpu_ms_per_query": client_cpu_ms,
            "start_nodes": len(first),
            "first_query_per_start_median_ms": round(statistics.median(first.values()), 1),
            "first_query_per_start_max_ms": round(max(first.values()), 1),
            "nodes_max": max(s["nodes"] for s in sizes), "total_nodes_max": max(s["total_nodes"] for s in sizes),
            "bytes_max": max(s["bytes"] for s in sizes), "last": sizes[-1]}


def _print_summary(result: dict) -> None:
    rates, queries, met, targets = result["events_per_s"], result["queries"], result["within_target"], result["targets"]
    print(f"store: {result['store']}")
    print(f"machine load average (1/5/15 min) before {result['load_avg_before']},"
          f" after {result['load_avg_after']} on {os.cpu_count()} CPUs")
    print(f"{'ingestion':<40}{'events/s':>10}")
    for k, v in rates.items():
        print(f"{k:<40}{v:>10}")
    print(f"CPU us per event: {result['cpu_us_per_event']} (load average at the HTTP replay"
          f" {result['load_avg_http_replay']})")
    print(f"{'query':<44}{'runs':>5}{'median ms':>10}{'p99 ms':>9}{'cpu ms':>8}   last result")
    for k, v in queries.items():
        print(f"{k:<44}{v['runs']:>5}{v['median_ms']:>10}{v['p99_ms']:>9}"
              f"{v.get('service_cpu_ms_per_query') or '':>8}   {v['last']}")
    print(f"targets at {result['events']} events: ingestion >= {targets['events_per_s']}/s:"
          f" {'met' if met['ingest'] else 'MISSED'}; every depth-20 graph query kind <="
          f" {targets['graph_depth20_median_ms']} ms median" +
          (f" and <= {targets['graph_depth20_p99_ms']} ms p99" if targets["graph_depth20_p99_ms"] else "") +
          f": {'met' if met['graph_depth20'] else 'MISSED'}; answers <= {DEFAULT_MAX_BYTES} bytes:"
          f" {'met' if met['graph_answer_bytes'] else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
