"""Ingestion rate and lineage query latency of the lineage service; print the figures and write a
JSON result to benchmarks/results/lineage_service.json.

    .venv/bin/python benchmarks/lineage_service.py [--pipelines 334] [--batch-size 500]

The event log is made with Crucible's own emitter (infra.services.lineage.sample): `--pipelines`
`pretrain` runs of 34 events each, every run resuming training from the previous run's last
checkpoint, so the model versions form one long chain of runs and artifacts, all sharing the
same raw files. Measured:

- ingestion into the store directly (ingest_batch) and over HTTP into a real uvicorn process
  (replay), plus re-ingestion of the same log (all duplicates);
- GET /api/v1/lineage at depth 20, upstream and downstream, from `--queries` randomly chosen
  (seeded) raw files and model versions each: four kinds of query, each reported with its median
  and p99. Downstream from a raw file reaches every run (~5,000 nodes, ~21 MB of JSON); upstream
  from a model version its own chain. The first queries meet a cold cache, as after any ingestion.
  Timed: request sent to the last byte of the answer received; the client's parsing of the JSON
  is reported apart (`client_parse_median_ms`), as it is the client's cost, not the service's.
  `service_cpu_ms_per_query`: the service process's CPU time (/proc, 10 ms ticks) over the series
  divided by its queries, a figure other work on a shared machine inflates far less than latency;
- both directions from the newest model version, and its trace and provenance report.

Targets (issues 7 and 15): ≥ 1,000 events/s ingestion; depth-20 graph queries of every kind
≤ 200 ms median and ≤ 500 ms p99.
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
from infra.services.lineage.store import LineageStore  # noqa: E402
from lineage_helpers import start_service  # noqa: E402
from tasks.core.net import free_port  # noqa: E402
from tasks.lineage.replay import iter_events, replay  # noqa: E402

TARGET_EVENTS_PER_S = 1000
TARGET_QUERY_MS = 200  # median of each kind of depth-20 graph query
TARGET_QUERY_P99_MS = 500
GRAPH_KINDS = {  # kind -> (start, direction)
    "graph_depth20_upstream_random_model": ("model", "upstream"),
    "graph_depth20_downstream_random_model": ("model", "downstream"),
    "graph_depth20_upstream_random_raw_file": ("raw", "upstream"),
    "graph_depth20_downstream_random_raw_file": ("raw", "downstream"),
}


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
    ap.add_argument("--pipelines", type=int, default=334, help="pretrain runs (34 events each)")
    ap.add_argument("--batch-size", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=20, help="repetitions of the newest model's queries")
    ap.add_argument("--queries", type=int, default=100, help="random start nodes per kind of graph query")
    ap.add_argument("--seed", type=int, default=15, help="seed of the start nodes' choice")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "lineage_service.json"))
    ap.add_argument("--keep", action="store_true", help="keep the generated log and stores (temp dir)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lineage-bench-"))
    try:
        return _run(args, work)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> int:
    t0 = time.perf_counter()
    log, pipelines = write_sample_log(work / "runs", pipelines=args.pipelines)
    gen_s = time.perf_counter() - t0
    events = list(iter_events(log))
    n = len(events)
    print(f"generated {n} events ({args.pipelines} pipeline runs) with the emitter in {gen_s:.1f} s")

    load_before = os.getloadavg()
    direct_s, direct_cpu_s, direct = _ingest_direct(work / "direct.db", events, args.batch_size)
    again_s, _, again = _ingest_direct(work / "direct.db", events, args.batch_size)
    assert direct["ingested"] == n and again["duplicates"] == n

    try:
        (work / "token").write_text("bench-token\n")
        proc, base = start_service(work / "http.db", free_port(), timeout=60, token_file=work / "token")
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    try:
        t0 = time.perf_counter()
        http = replay(log, base, batch_size=args.batch_size, token="bench-token")  # validated, as every write
        http_s = time.perf_counter() - t0
        assert http["ingested"] == n, http
        queries, stats = _query_service(base, pipelines, args, proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=10)

    rates = {
        "direct_ingest_batch": round(n / direct_s),
        "direct_ingest_batch_per_cpu_s": round(n / direct_cpu_s),
        "http_replay": round(n / http_s),
        "direct_reingest_duplicates": round(n / again_s),
    }
    result = {
        "benchmark": "lineage_service",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    # the 1/5/15-minute load averages: other work on the machine slows every figure down
                    "load_avg_before": [round(x, 2) for x in load_before],
                    "load_avg_after": [round(x, 2) for x in os.getloadavg()]},
        "events": n,
        "pipelines": args.pipelines,
        "batch_size": args.batch_size,
        "store": stats,
        "generate_s": round(gen_s, 1),
        "ingest_s": {"direct": round(direct_s, 2), "http": round(http_s, 2), "reingest": round(again_s, 2)},
        "events_per_s": rates,
        "queries": queries,
        "targets": {"events_per_s": TARGET_EVENTS_PER_S, "graph_depth20_median_ms": TARGET_QUERY_MS,
                    "graph_depth20_p99_ms": TARGET_QUERY_P99_MS},
        "within_target": {
            "ingest": min(rates["direct_ingest_batch"], rates["http_replay"]) >= TARGET_EVENTS_PER_S,
            # every kind of graph query, the newest model's included, on both figures
            "graph_depth20": all(q["median_ms"] <= TARGET_QUERY_MS and q["p99_ms"] <= TARGET_QUERY_P99_MS
                                 for name, q in queries.items() if name.startswith("graph_depth20")),
        },
    }
    _print_summary(result)
    write_result(args.out, result)
    print(f"wrote {args.out}")
    return 0 if all(result["within_target"].values()) else 1


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _query_service(base: str, pipelines: list, args: argparse.Namespace, pid: int) -> tuple[dict, dict]:
    """Timed graph queries of the running service (the four random kinds, then both directions from
    the newest model version), its trace and report, and the store's stats."""
    client = httpx.Client(base_url=base, timeout=120)
    model = pipelines[-1].model_version_node
    rng = random.Random(args.seed)
    starts = {"model": [p.model_version_node for p in pipelines],
              "raw": sorted({p.file_node(f) for p in pipelines for f in p.raw_files})}
    queries = {kind: _graph_series(client, [rng.choice(starts[start]) for _ in range(args.queries)], direction, pid)
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
    """GET /api/v1/lineage at depth 20 from each node in turn: figures of the time to the answer's
    last byte, the service's CPU time and the client's parse time apart, and the graphs' sizes."""
    times, parse_ms, sizes = [], [], []
    cpu_before = _cpu_seconds(pid)
    for node in nodes:
        t0 = time.perf_counter()
        resp = client.get("/api/v1/lineage", params={"nodeId": node, "depth": 20, "direction": direction})
        times.append((time.perf_counter() - t0) * 1000)
        resp.raise_for_status()
        t0 = time.perf_counter()
        graph = resp.json()["graph"]
        parse_ms.append((time.perf_counter() - t0) * 1000)
        sizes.append({"nodes": len(graph), "jobs": sum(1 for x in graph if x["type"] == "JOB"),
                      "bytes": len(resp.content)})
    cpu_after = _cpu_seconds(pid)
    cpu_ms = None if cpu_before is None or cpu_after is None else round((cpu_after - cpu_before) * 1000 / len(nodes), 1)
    return {**_figures(times), "service_cpu_ms_per_query": cpu_ms,
            "client_parse_median_ms": round(statistics.median(parse_ms), 1),
            "start_nodes": len(set(nodes)), "nodes_min": min(s["nodes"] for s in sizes),
            "nodes_max": max(s["nodes"] for s in sizes), "last": sizes[-1]}


def _print_summary(result: dict) -> None:
    machine, rates, queries, met = (result["machine"], result["events_per_s"], result["queries"],
                                    result["within_target"])
    print(f"store: {result['store']}")
    print(f"machine load average (1/5/15 min) before {machine['load_avg_before']},"
          f" after {machine['load_avg_after']} on {os.cpu_count()} CPUs")
    print(f"{'ingestion':<40}{'events/s':>10}")
    for k, v in rates.items():
        print(f"{k:<40}{v:>10}")
    print(f"{'query':<44}{'runs':>5}{'median ms':>10}{'p99 ms':>9}{'cpu ms':>8}   last result")
    for k, v in queries.items():
        print(f"{k:<44}{v['runs']:>5}{v['median_ms']:>10}{v['p99_ms']:>9}"
              f"{v.get('service_cpu_ms_per_query') or '':>8}   {v['last']}")
    print(f"targets: ingestion ≥ {TARGET_EVENTS_PER_S}/s: {'met' if met['ingest'] else 'MISSED'};"
          f" every depth-20 graph query kind ≤ {TARGET_QUERY_MS} ms median and ≤ {TARGET_QUERY_P99_MS} ms p99:"
          f" {'met' if met['graph_depth20'] else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
