"""Ingestion rate and lineage query latency of the lineage service; print the figures and write a
JSON result to benchmarks/results/lineage_service.json.

    .venv/bin/python benchmarks/lineage_service.py [--pipelines 334] [--batch-size 500]

The event log is made with Crucible's own emitter (infra.services.lineage.sample): `--pipelines`
`pretrain` runs of 34 events each, every run resuming training from the previous run's last
checkpoint, so the model versions form one long chain of runs and artifacts, all sharing the
same raw files. Measured:

- ingestion into the store directly (ingest_batch) and over HTTP into a real uvicorn process
  (replay), plus re-ingestion of the same log (all duplicates);
- GET /api/v1/lineage at depth 20 from the newest model version (Marquez's default: both
  directions), upstream only, and downstream from a raw file (which reaches every run);
- the trace and the provenance report of the newest model version.

Targets (issue 7): ≥ 1,000 events/s ingestion; ≤ 200 ms for a depth-20 graph query.
"""
from __future__ import annotations

import argparse
import os
import platform
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
TARGET_QUERY_MS = 200


def _timed(fn, repeat: int) -> dict:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return {"median_ms": round(statistics.median(times), 1), "p95_ms": round(times[int(0.95 * (len(times) - 1))], 1),
            "max_ms": round(times[-1], 1), "runs": repeat, "last": out}


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
    ap.add_argument("--repeat", type=int, default=20, help="repetitions per query")
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
        queries, stats = _query_service(base, pipelines[-1], args.repeat)
    finally:
        proc.terminate()
        proc.wait(timeout=10)

    rates = {
        "direct_ingest_batch": round(n / direct_s),
        "direct_ingest_batch_per_cpu_s": round(n / direct_cpu_s),
        "http_replay": round(n / http_s),
        "direct_reingest_duplicates": round(n / again_s),
    }
    q20 = queries["graph_depth20_both_newest_model"]["median_ms"]
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
        "targets": {"events_per_s": TARGET_EVENTS_PER_S, "graph_depth20_ms": TARGET_QUERY_MS},
        "within_target": {
            "ingest": min(rates["direct_ingest_batch"], rates["http_replay"]) >= TARGET_EVENTS_PER_S,
            "graph_depth20": q20 <= TARGET_QUERY_MS,
        },
    }
    _print_summary(result)
    write_result(args.out, result)
    print(f"wrote {args.out}")
    return 0 if all(result["within_target"].values()) else 1


def _query_service(base: str, newest, repeat: int) -> tuple[dict, dict]:
    """Timed queries of the running service around the newest pipeline run's model version (graph
    both ways and upstream, downstream from a raw file, trace, report), and the store's stats."""
    client = httpx.Client(base_url=base, timeout=120)
    model = newest.model_version_node
    raw = newest.file_node(newest.raw_files[0])

    def graph(node: str, direction: str, depth: int = 20):
        resp = client.get("/api/v1/lineage", params={"nodeId": node, "depth": depth, "direction": direction})
        resp.raise_for_status()
        g = resp.json()["graph"]
        return {"nodes": len(g), "jobs": sum(1 for x in g if x["type"] == "JOB"),
                "bytes": len(resp.content)}

    def trace():
        t = client.get("/api/v1/crucible/trace", params={"nodeId": model}).json()
        return {"sources": len(t["sources"]), "truncated": t["truncated"]}

    def report():
        r = client.get("/api/v1/crucible/report", params={"nodeId": model, "format": "md"})
        r.raise_for_status()
        return {"bytes": len(r.content)}

    few = max(3, repeat // 4)  # the slow queries
    queries = {
        "graph_depth20_both_newest_model": _timed(lambda: graph(model, "both"), repeat),
        "graph_depth20_upstream_newest_model": _timed(lambda: graph(model, "upstream"), repeat),
        "graph_depth20_downstream_raw_file": _timed(lambda: graph(raw, "downstream"), few),
        "trace_full_depth_newest_model": _timed(trace, few),
        "report_md_full_depth_newest_model": _timed(report, few),
    }
    stats = client.get("/api/v1/crucible/stats").json()
    client.close()
    return queries, stats


def _print_summary(result: dict) -> None:
    machine, rates, queries, met = (result["machine"], result["events_per_s"], result["queries"],
                                    result["within_target"])
    print(f"store: {result['store']}")
    print(f"machine load average (1/5/15 min) before {machine['load_avg_before']},"
          f" after {machine['load_avg_after']} on {os.cpu_count()} CPUs")
    print(f"{'ingestion':<40}{'events/s':>10}")
    for k, v in rates.items():
        print(f"{k:<40}{v:>10}")
    print(f"{'query':<40}{'median ms':>10}{'p95 ms':>9}   result")
    for k, v in queries.items():
        print(f"{k:<40}{v['median_ms']:>10}{v['p95_ms']:>9}   {v['last']}")
    print(f"targets: ingestion ≥ {TARGET_EVENTS_PER_S}/s: {'met' if met['ingest'] else 'MISSED'};"
          f" depth-20 graph ≤ {TARGET_QUERY_MS} ms: {'met' if met['graph_depth20'] else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
