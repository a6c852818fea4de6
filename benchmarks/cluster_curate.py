"""Ingest + curate on the stack's 2-node Ray cluster vs local Ray, at equal cores.

The 8 docs-crawl WARCs (../shared/data/web/docs-crawl-0000[0-7].warc.gz, 6,984 pages) go
through `run_ingest` then `run_curate` with the default config's ingest and curate steps:
  local:   a local Ray started by the run (`ray.num_cpus: 2`), as `crucible run` does;
  cluster: the stack's cluster, started by infra/stack.py's own `up_ray` (a 0-CPU head and two
           1-CPU worker nodes, token auth) and attached to with `ray.address`.
Each run is a fresh Python process with a fresh run_root, as a user runs it; runs alternate
(local, cluster, local, ...) and the medians are reported. Timed separately: the cluster's
start (`up_ray`, before its run; it is stopped after it, so the local runs share the machine
with no idle cluster), the run's Ray start-up or attach (`init_ray`), and each stage.

Where the cluster's extra time goes, per stage, from the stage summaries: the map's wall time on
its workers vs the seconds inside the jobs (`JobRunner.job_report`: the rest is worker start-up,
scheduling, transfers and waiting for the last jobs), the bytes of results moved to the driver
(inline or through the object store: on the cluster they cross from a worker node to the head),
and the driver's own work in curate (decontamination index, line counts, dedup, writing). The
decontamination index, shipped once to each worker node's object store, is sized too.
The outputs of every run are compared: ingested and curated documents (ids and texts, in
order) and the dropped-document log must be identical.

Writes benchmarks/results/cluster_curate.json.

    python benchmarks/cluster_curate.py [--repeats 2] [--files 8] [--max-docs N]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import add_int_options, data_root, write_result

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TARGET_OVERHEAD = 0.10  # the cluster path may cost at most 10 % over local Ray at equal cores
CORES = 2  # local ray.num_cpus; the cluster: 2 worker nodes of 1 CPU, a 0-CPU head


def pipeline(run_root: Path, files: int, max_docs: int | None, address: str | None):
    """The default config (ingest and curate steps) over the first `files` docs-crawl WARCs."""
    from tasks.config import PipelineConfig, RayConfig, SourceConfig

    source = SourceConfig(name="docs_crawl", uri=f"web/docs-crawl-0000[0-{files - 1}].warc.gz", format="warc",
                          licence="GPL-2.0+ OR CC-BY-SA-3.0; PSF-2.0; GPL-2.0", provenance="shared/data",
                          max_docs=max_docs)
    return PipelineConfig(name="cluster-curate-bench", sources=[source], data_root=str(data_root()),
                          run_root=str(run_root), ray=RayConfig(address=address, num_cpus=CORES))


def _digest_docs(shards: list[str]) -> str:
    """sha256 over the documents' ids and texts, in order."""
    from tasks.core.documents import iter_docs

    h = hashlib.sha256()
    for d in iter_docs(shards):
        h.update(d["id"].encode() + b"\0" + d["text"].encode() + b"\0")
    return h.hexdigest()


def _stage(summary: dict, docs_in: int) -> dict:
    return {"docs_in": docs_in, "docs_out": summary["docs_out"], "seconds": summary["seconds"],
            "docs_per_s": round(docs_in / summary["seconds"], 1), "nodes": summary.get("nodes"),
            "jobs": summary.get("jobs"), "timings": summary.get("timings")}


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (every core, every process: /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_once(run_root: Path, files: int, max_docs: int | None, address: str | None) -> dict:
    """One run in this process: Ray start-up/attach, ingest, curate (each timed), output digests."""
    import ray

    from tasks.core.ray_utils import init_ray
    from tasks.curate import run_curate
    from tasks.curate.run import _decontam_index
    from tasks.ingest import run_ingest

    cfg = pipeline(run_root, files, max_docs, address)
    t0 = time.perf_counter()
    init_ray(cfg.ray)
    ray_s = time.perf_counter() - t0
    cpu0, driver0 = machine_cpu_s(), time.process_time()
    ingested = run_ingest(cfg, run_root / "ingest")
    curated = run_curate(cfg, [Path(s) for s in ingested["shards"]], run_root / "curate")
    cpu = {"machine_busy_s": round(machine_cpu_s() - cpu0, 2), "driver_s": round(time.process_time() - driver0, 2)}
    t1 = time.perf_counter()
    ray.shutdown()
    out = {"ray_init_s": round(ray_s, 3), "ray_shutdown_s": round(time.perf_counter() - t1, 3),
           "ingest": _stage(ingested, ingested["docs_in"]), "curate": _stage(curated, curated["docs_in"]),
           "stages_s": round(ingested["seconds"] + curated["seconds"], 3)}
    out["records_per_s"] = round(ingested["docs_in"] / out["stages_s"], 1)
    out["with_ray_init_s"] = round(ray_s + out["stages_s"], 3)
    # the machine's busy CPU seconds over both stages: in the jobs, in the driver, the rest (Ray's
    # daemons, worker start-up, object transfers; and anything else running on a shared machine)
    jobs_cpu = sum((s["timings"] or {}).get("jobs", {}).get("compute_s", 0) for s in (out["ingest"], out["curate"]))
    out["cpu"] = {**cpu, "jobs_wall_s": round(jobs_cpu, 2),
                  "rest_s": round(cpu["machine_busy_s"] - cpu["driver_s"] - jobs_cpu, 2)}
    out["digests"] = {"ingested_docs": _digest_docs(ingested["shards"]), "curated_docs": _digest_docs(curated["shards"]),
                      "dropped_log": hashlib.sha256(Path(curated["dropped_file"]).read_bytes()).hexdigest(),
                      "dropped": curated["dropped"], "quarantined": ingested.get("quarantined")}
    index = _decontam_index(cfg)  # cached: the one this run shipped to the workers
    out["decontam_index_bytes"] = len(pickle.dumps(index, protocol=5)) if index is not None else 0
    return out


def _child(args) -> None:
    result = run_once(Path(args.run_root), args.files, args.max_docs or None, args.address)
    Path(args.result).write_text(json.dumps(result))


def _run_in_process(kind: str, files: int, max_docs: int | None, address: str | None, env: dict) -> dict:
    """One run in a fresh Python process with a fresh run_root (removed afterwards)."""
    work = Path(tempfile.mkdtemp(prefix=f"crucible-bench-{kind}-"))
    try:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--run-root", str(work / "run"),
               "--result", str(work / "result.json"), "--files", str(files), "--max-docs", str(max_docs or 0)]
        if address:
            cmd += ["--address", address]
        subprocess.run(cmd, check=True, env=env, cwd=REPO)
        return json.loads((work / "result.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _local_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # init_ray starts its own Ray


START_ATTEMPTS = 3  # Ray's own processes take random ports: one may take a node's health port first


def start_cluster(state: Path):
    """The stack's cluster on free ports, started by `up_ray` as `crucible up --ray` does:
    (its StackConfig, seconds to start). A start whose port was taken meanwhile is stopped and
    tried again on other ports."""
    from infra import stack

    t0 = time.perf_counter()
    cfg = stack.up_ray_on_free_ports(str(state), attempts=START_ATTEMPTS, ray_workers=2, ray_head_cpus=0,
                                     ray_worker_cpus=1, start_timeout=120, stop_timeout=15)
    return cfg, time.perf_counter() - t0


def cluster_run(files: int, max_docs: int | None) -> dict:
    """Start the stack's cluster (timed), run once attached to it, stop it."""
    from infra import stack

    state = Path(tempfile.mkdtemp(prefix="crucible-bench-stack-"))
    cfg = None
    try:
        cfg, start_s = start_cluster(state)
        env = {**_local_env(), **stack.ray_client_env(cfg)}
        result = _run_in_process("cluster", files, max_docs, stack.cluster_address(cfg), env)
        result["cluster_start_s"] = round(start_s, 2)
        return result
    finally:
        if cfg is not None:
            t1 = time.perf_counter()
            stack.down_ray(cfg)
            print(f"  cluster stopped in {time.perf_counter() - t1:.1f}s", file=sys.stderr)
        shutil.rmtree(state, ignore_errors=True)


def _median(runs: list[dict], *path: str) -> float | None:
    values = []
    for r in runs:
        v = r
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        if v is not None:
            values.append(v)
    return round(statistics.median(values), 3) if values else None


STAGE_FIGURES = {"seconds": ("seconds",), "docs_per_s": ("docs_per_s",),
                 "map_wall_s": ("timings", "jobs", "map_wall_s"), "compute_s": ("timings", "jobs", "compute_s"),
                 "idle_share": ("timings", "jobs", "idle_share"), "result_bytes": ("timings", "jobs", "result_bytes"),
                 "result_bytes_via_object_store": ("timings", "jobs", "result_bytes_via_object_store")}
CURATE_DRIVER = ("decontam_index_s", "line_counts_s", "dedup_s", "write_s")


def summarise(runs: list[dict]) -> dict:
    """Medians over the runs of one path."""
    out = {"runs": len(runs), "ray_init_s": _median(runs, "ray_init_s"), "stages_s": _median(runs, "stages_s"),
           "records_per_s": _median(runs, "records_per_s"), "with_ray_init_s": _median(runs, "with_ray_init_s"),
           "cpu": {k: _median(runs, "cpu", k) for k in ("machine_busy_s", "driver_s", "jobs_wall_s", "rest_s")}}
    if runs and "cluster_start_s" in runs[0]:
        out["cluster_start_s"] = _median(runs, "cluster_start_s")
    for stage in ("ingest", "curate"):
        out[stage] = {k: _median(runs, stage, *path) for k, path in STAGE_FIGURES.items()}
        out[stage]["nodes"] = [r[stage]["nodes"] for r in runs]
    out["curate"]["driver"] = {k: _median(runs, "curate", "timings", k) for k in CURATE_DRIVER}
    return out


def where_it_goes(local: dict, cluster: dict) -> dict:
    """Cluster minus local (medians, seconds) per part of the stage time; the stage seconds not in
    a part are the stage's own planning, merging and output writing."""
    def delta(a, b):
        return round(b - a, 3) if a is not None and b is not None else None

    parts = {"ray_init_s (not in stages_s)": delta(local["ray_init_s"], cluster["ray_init_s"]),
             "stages_s": delta(local["stages_s"], cluster["stages_s"]),
             "machine_cpu_s": {k: delta(local["cpu"][k], cluster["cpu"][k]) for k in local["cpu"]}}
    for stage in ("ingest", "curate"):
        loc, clu = local[stage], cluster[stage]
        parts[stage] = {"seconds": delta(loc["seconds"], clu["seconds"]),
                        "map_wall_s": delta(loc["map_wall_s"], clu["map_wall_s"]),
                        "compute_s (sum over jobs)": delta(loc["compute_s"], clu["compute_s"]),
                        "idle_share (of the workers' map time)": delta(loc["idle_share"], clu["idle_share"]),
                        "result_mb_via_object_store (cluster)": round((clu["result_bytes_via_object_store"] or 0) / 1e6, 2),
                        "result_mb (cluster)": round((clu["result_bytes"] or 0) / 1e6, 2)}
    parts["curate"]["driver"] = {k: delta(local["curate"]["driver"][k], cluster["curate"]["driver"][k])
                                 for k in CURATE_DRIVER}
    return parts


def identical_outputs(runs: list[dict]) -> dict:
    """Whether every run (both paths, every repeat) gave the same documents and drops."""
    keys = ("ingested_docs", "curated_docs", "dropped_log", "dropped", "quarantined")
    first = runs[0]["digests"]
    same = {k: all(r["digests"][k] == first[k] for r in runs) for k in keys}
    return {**same, "all": all(same.values()), "curated_docs_sha256": first["curated_docs"]}


def _print_run(kind: str, r: dict) -> None:
    start = f"cluster start {r['cluster_start_s']}s, " if "cluster_start_s" in r else ""
    print(f"  {kind}: {start}ray init {r['ray_init_s']}s, ingest {r['ingest']['seconds']}s "
          f"({r['ingest']['docs_per_s']} records/s, nodes {r['ingest']['nodes']}), curate {r['curate']['seconds']}s "
          f"({r['curate']['docs_per_s']} docs/s, nodes {r['curate']['nodes']}), stages {r['stages_s']}s",
          file=sys.stderr)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_int_options(p, repeats=2, files=8, max_docs=0)
    p.add_argument("--out", default=str(HERE / "results" / "cluster_curate.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one run, in this process
    p.add_argument("--run-root", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    if not 1 <= args.files <= 8:
        p.error("--files: 1 to 8 docs-crawl WARCs")
    runs: dict[str, list[dict]] = {"local": [], "cluster": []}
    for i in range(args.repeats):  # alternating, so drift on a shared machine hits both paths alike
        print(f"repeat {i + 1}/{args.repeats}", file=sys.stderr)
        runs["local"].append(_run_in_process("local", args.files, args.max_docs or None, None, _local_env()))
        _print_run("local", runs["local"][-1])
        runs["cluster"].append(cluster_run(args.files, args.max_docs or None))
        _print_run("cluster", runs["cluster"][-1])
    local, cluster = summarise(runs["local"]), summarise(runs["cluster"])
    overhead = cluster["stages_s"] / local["stages_s"] - 1
    result = {
        "cpu_count": os.cpu_count(), "cores": CORES, "files": args.files, "max_docs": args.max_docs or None,
        "records_in": runs["local"][0]["ingest"]["docs_in"], "docs_out": runs["local"][0]["curate"]["docs_out"],
        "setup": {"local": f"local Ray, ray.num_cpus={CORES}",
                  "cluster": "stack cluster: head 0 CPUs + 2 worker nodes x 1 CPU (infra/stack.py up_ray), token auth"},
        "local": local, "cluster": cluster,
        "overhead_pct": round(100 * overhead, 1), "target_pct": round(100 * TARGET_OVERHEAD),
        "within_target": overhead <= TARGET_OVERHEAD,
        "overhead_basis": "median ingest + curate stage seconds (Ray start-up/attach and cluster start excluded)",
        "where_the_difference_goes": where_it_goes(local, cluster),
        "decontam_index_mb_shipped_per_node": round(runs["local"][0]["decontam_index_bytes"] / 1e6, 2),
        "identical_outputs": identical_outputs(runs["local"] + runs["cluster"]),
        "runs": runs,
    }
    for r in result["runs"]["local"] + result["runs"]["cluster"]:
        r.pop("digests")
    print(f"{result['records_in']} records -> {result['docs_out']} docs; stage time median: local {local['stages_s']}s "
          f"({local['records_per_s']} records/s), cluster {cluster['stages_s']}s ({cluster['records_per_s']} records/s): "
          f"overhead {result['overhead_pct']} % (target <= {result['target_pct']} %: "
          f"{'met' if result['within_target'] else 'NOT met'}); ray init local {local['ray_init_s']}s, "
          f"cluster attach {cluster['ray_init_s']}s, cluster start {cluster['cluster_start_s']}s; "
          f"outputs identical: {result['identical_outputs']['all']}")
    write_result(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
