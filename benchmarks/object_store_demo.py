"""The demo on an object store vs on local disk: `crucible run configs/tiny.yaml`, as a user runs
it, once with its sources and run_root on local disk and once with both on S3 (moto's server mode,
a separate process on 127.0.0.1: every byte goes over HTTP with SigV4 signing, as to a real store).

Both kinds run against the same stack (brought up once before the first run, so its start-up is
in neither), each a fresh `crucible` process with a fresh run_root; runs alternate (local, s3,
local, ...) and the medians of the wall times are compared. Target: the S3 demo within 1.3× of
the local one. Per stage the seconds of each kind are reported, and for the S3 runs the objects
and bytes in the bucket afterwards, so where the extra time goes is visible.

The outputs are compared too: the curated documents' count and the trained steps must agree.

Writes benchmarks/results/object_store_demo.json.

    python benchmarks/object_store_demo.py [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from _common import code_commit, data_root, write_result
from tasks.core.net import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TARGET_RATIO = 1.3
CRUCIBLE = [sys.executable, "-m", "infra.cli"]
KEY_VAR, SECRET_VAR = "CRUCIBLE_BENCH_S3_KEY", "CRUCIBLE_BENCH_S3_SECRET"


def start_moto(tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=open(tmp / "moto.log", "w"), stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def s3_config(tmp: Path, endpoint: str) -> Path:
    """configs/tiny.yaml with every source uploaded to s3://crawl (same keys as data_root paths)."""
    import boto3

    env_opts = {"endpoint_url": endpoint, "key": "${%s}" % KEY_VAR, "secret": "${%s}" % SECRET_VAR}
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
    for bucket in ("crawl", "runs"):
        client.create_bucket(Bucket=bucket)
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    root = data_root()
    for s in raw["sources"]:
        files = sorted(root.glob(s["uri"]))
        for f in files:
            client.upload_file(str(f), "crawl", str(f.relative_to(root)))
        s["uri"] = f"s3://crawl/{s['uri']}"
        s["storage_options"] = env_opts
    raw["storage"] = {"options": env_opts, "cache_dir": str(tmp / "cache")}
    path = tmp / "tiny-s3.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def bucket_size(endpoint: str) -> dict:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
    n = size = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="runs"):
        for o in page.get("Contents", []):
            n, size = n + 1, size + o["Size"]
    return {"objects": n, "bytes": size}


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_demo(config: Path, sets: list[str], summary: Path, env: dict) -> dict:
    """One `crucible run`: its wall time, and the CPU seconds (user + sys) of that process and the
    children it waited for (torchrun's ranks, a local Ray; not the stack's own processes: its Ray
    cluster and workers run outside the process tree), next to the wall time because the
    machine may be loaded by other work."""
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    proc = subprocess.run(CRUCIBLE + ["run", str(config), *sets, "--summary", str(summary)], cwd=REPO, env=env,
                          capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"crucible run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    s = json.loads(summary.read_text())
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load_avg_1m": round(os.getloadavg()[0], 2),
            "stages_s": s["timings_s"],
            "curated_docs": s["stages"]["curate"].get("docs_out"), "steps": s["stages"]["train"].get("steps")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "object_store_demo.json"))
    args = ap.parse_args()
    commit = code_commit()
    tmp = Path(tempfile.mkdtemp(prefix="crucible-bench-s3-"))
    moto, endpoint = start_moto(tmp)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "AWS_"))}
    env.update({KEY_VAR: "bench", SECRET_VAR: "bench", "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_DEFAULT_REGION": "us-east-1"})
    ports = [f"stack.state_dir={tmp / 'state'}", f"stack.prefect_port={free_port()}",
             f"stack.mlflow_port={free_port()}", f"lineage.service_port={free_port()}",
             f"stack.worker_port={free_port()}", f"deploy.port={free_port()}"]
    sets = [a for o in ports for a in ("--set", o)]
    runs: dict[str, list[dict]] = {"local": [], "s3": []}
    try:
        config_s3 = s3_config(tmp, endpoint)
        subprocess.run(CRUCIBLE + ["up", "--config", str(REPO / "configs" / "tiny.yaml"), *sets], cwd=REPO, env=env,
                       check=True, capture_output=True)
        for i in range(args.repeats):
            for kind in ("local", "s3"):
                config = REPO / "configs" / "tiny.yaml" if kind == "local" else config_s3
                root = str(tmp / f"runs-{i}") if kind == "local" else f"s3://runs/bench-{i}"
                r = run_demo(config, sets + ["--set", f"run_root={root}"], tmp / f"summary-{kind}-{i}.json", env)
                runs[kind].append(r)
                print(f"{kind} #{i + 1}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU  stages {r['stages_s']}",
                      flush=True)
        stored = bucket_size(endpoint)
    finally:
        subprocess.run(CRUCIBLE + ["down", *sets], cwd=REPO, env=env, capture_output=True)
        moto.terminate()
        moto.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(r["wall_s"] for r in v) for k, v in runs.items()}
    med_cpu = {k: statistics.median(r["cpu_s"] for r in v) for k, v in runs.items()}
    ratio = med["s3"] / med["local"]
    same = all(a["curated_docs"] == b["curated_docs"] and a["steps"] == b["steps"]
               for a, b in zip(runs["local"], runs["s3"]))
    stages = sorted({k for v in runs.values() for r in v for k in r["stages_s"]})
    per_stage = {st: {k: statistics.median(r["stages_s"].get(st, 0.0) for r in v) for k, v in runs.items()}
                 for st in stages}
    result = {"benchmark": "object_store_demo", "command": "crucible run configs/tiny.yaml (sources + run_root on S3 vs local)",
              "store": "moto_server (separate process, HTTP, SigV4)", "repeats": args.repeats,
              # both ends: a shared checkout may move while the runs go (each run imports the code it finds)
              "code_commit": {"start": commit, "end": code_commit()}, "cpus": os.cpu_count(),
              "median_wall_s": med, "median_cpu_s_run_process_tree": med_cpu,
              "ratio": round(ratio, 3), "target_ratio": TARGET_RATIO,
              "within_target": ratio <= TARGET_RATIO, "outputs_agree": same, "per_stage_median_s": per_stage,
              "bucket_after_s3_runs": stored, "runs": runs}
    write_result(args.out, result)
    print(f"median wall: local {med['local']:.1f} s, s3 {med['s3']:.1f} s, ratio {ratio:.3f} "
          f"(target <= {TARGET_RATIO}); outputs agree: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
