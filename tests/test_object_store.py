"""run_root on an object store: a whole `crucible run` (the lean demo) with its sources and its
run_root on a real S3-compatible server (moto's server mode, IAM authentication on) and its Ray
stages on the stack's 2-node Ray cluster; nothing is written under a local runs/, every artifact
is in the bucket, the workers on the cluster's nodes read their inputs from the store, and lineage
names the objects as the OpenLineage naming spec says, raw s3:// sources with their licence."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from infra import stack
from s3_helpers import moto_s3, object_requests
from infra.settings import load_config
from tasks.core.net import free_port
from test_e2e import CRUCIBLE, REPO
from test_postgres import LEAN, TINY

DATA = REPO.parent / "shared" / "data"
RAW = {"cc/cc-main-2019-30-sample.jsonl.gz": "web/cc-main-2019-30-sample.jsonl.gz",
       "cc/cc-net-head-sample.jsonl.gz": "web/cc-net-head-sample.jsonl.gz"}


def _client_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}


def _config(tmp: Path, s3) -> Path:
    """tiny.yaml with its JSONL sources read from s3://crawl (same files, same licences)."""
    raw = yaml.safe_load(Path(TINY).read_text())
    sources = []
    for s in raw["sources"]:
        if s["format"] != "jsonl":
            continue
        key = next(k for k, v in RAW.items() if v == s["uri"])
        sources.append({**s, "uri": f"s3://crawl/{key}", "storage_options": s3.options})
    raw["sources"] = sources
    raw["storage"] = {"options": s3.options, "cache_dir": str(tmp / "cache")}
    path = tmp / "lean-s3.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def s3_demo():
    tmp = Path(tempfile.mkdtemp(prefix="crucible-s3-demo-"))
    with moto_s3(tmp, buckets=["runs", "crawl"]) as s3:
        # versions keep every push of a file: what the store held while training ran stays visible
        s3.client.put_bucket_versioning(Bucket="runs", VersioningConfiguration={"Status": "Enabled"})
        for key, name in RAW.items():
            s3.client.upload_file(str(DATA / name), "crawl", key)
        # the cluster's nodes start with the credentials in their environment, as on a real cluster
        ray_cfg = stack.up_ray_on_free_ports(str(tmp / "state"), ray_workers=2, ray_head_cpus=0, ray_worker_cpus=1,
                                             ray_object_store_mb=128, start_timeout=120, stop_timeout=15)
        config = _config(tmp, s3)
        overrides = [f"stack.prefect_port={free_port()}", f"stack.mlflow_port={free_port()}",
                     f"lineage.service_port={free_port()}", "run_root=s3://runs/crucible", "stack.ray=cluster",
                     f"stack.ray_port={ray_cfg.ray_port}", f"stack.ray_client_port={ray_cfg.ray_client_port}",
                     f"stack.ray_agent_port={ray_cfg.ray_agent_port}", "stack.ray_worker_cpus=1",
                     f"stack.worker_port={free_port()}", *LEAN,
                     "stack.triggers=true"]  # the checkpoint events name s3:// objects: the worker's flows take them
        sets = [a for o in overrides for a in ("--set", o)]
        cfg = load_config(config, overrides + [f"stack.state_dir={tmp / 'state'}"])
        workdir = tmp / "cwd"
        workdir.mkdir()
        try:
            t0 = time.monotonic()
            with object_requests("GET") as gets:  # of every process: the driver, the nodes' workers
                proc = subprocess.run(CRUCIBLE + ["--state-dir", str(tmp / "state"), "run", str(config), *sets,
                                                  "--summary", str(tmp / "summary.json")],
                                      cwd=workdir, env=_client_env(), capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
            print(f"\nlean demo on S3 + Ray cluster: {time.monotonic() - t0:.0f}s")
            yield {"s3": s3, "tmp": tmp, "cfg": cfg, "summary": json.loads((tmp / "summary.json").read_text()),
                   "workdir": workdir, "gets": gets}
        finally:
            stack.down(cfg.stack)
            stack.down_ray(ray_cfg)
            shutil.rmtree(tmp, ignore_errors=True)


def test_every_artifact_is_in_the_bucket_and_nothing_under_local_runs(s3_demo):
    s3, summary = s3_demo["s3"], s3_demo["summary"]
    run = summary["run_name"]
    assert summary["status"] == "COMPLETED" and summary["run_uri"] == f"s3://runs/crucible/{run}"
    keys = set(s3.keys("runs", f"crucible/{run}/"))
    rel = {k.split("/", 2)[2] for k in keys}
    for expected in ("config.json", "summary.json", "lineage.jsonl", "ingest/manifest.json", "curate/manifest.json",
                     "tokenizer/tokenizer.json", "tokens/index.json", "plan/plan.json"):
        assert expected in rel, (expected, sorted(rel))
    assert any(r.startswith("ingest/shard-") for r in rel) and any(r.startswith("curate/shard-") for r in rel)
    # the jobs' parts, which the worker nodes left on the store (never in the working copy), went
    # with each stage's manifest
    assert not [r for r in rel if "/_parts/" in r or r.startswith("tokens/parts/")], sorted(rel)
    assert any(r.startswith("tokens/") and r.endswith(".bin") for r in rel)
    ckpts = {r.split("/")[2] for r in rel if r.startswith("train/checkpoints/step-")}
    assert ckpts, "no checkpoint in the store"
    assert any(r.startswith("evaluate/") and r.endswith(".json") for r in rel)
    # the stored summary is the run's (the store is the record)
    stored = json.loads(s3.client.get_object(Bucket="runs", Key=f"crucible/{run}/summary.json")["Body"].read())
    assert stored["status"] == "COMPLETED"
    # the dedup index lives under run_root too
    assert any("dedup" in k or "index" in k for k in s3.keys("runs", "crucible/")), "no dedup index in the store"
    # nothing under a local runs/: not beside the working directory, not in the repository
    assert not (s3_demo["workdir"] / "runs").exists()
    assert not list(s3_demo["workdir"].rglob("*")), list(s3_demo["workdir"].rglob("*"))[:5]


def test_the_cluster_workers_ran_the_stages_from_the_store(s3_demo):
    stages = s3_demo["summary"]["stages"]
    for name in ("ingest", "curate"):
        nodes = stages[name]["nodes"]
        assert set(nodes) <= {"worker-1", "worker-2"} and sum(nodes.values()) > 0, (name, nodes)
    assert len(stages["curate"]["nodes"]) == 2 or len(stages["ingest"]["nodes"]) == 2
    # the worker nodes read their inputs from the store, never the driver's working copy: every
    # curate job on them downloaded its ingest shard (a GET each: no node cache), and no job's
    # folder is left on a node
    run = s3_demo["summary"]["run_name"]
    shard_gets = sum(n for k, n in s3_demo["gets"].items() if k.startswith(f"crucible/{run}/ingest/shard-"))
    assert shard_gets >= stages["curate"]["jobs"] - stages["curate"].get("resumed_jobs", 0), shard_gets
    left = [p for p in (Path(tempfile.gettempdir()) / "crucible-stage").glob(f"*/jobs/*/*/{run}")]
    assert not left, left


def test_training_read_its_tokens_from_the_store_and_wrote_checkpoints_there(s3_demo):
    """The train stage's ranks stage the token files from the store (not the working copy) and DCP's
    fsspec writer puts each checkpoint in the bucket; the train stage names them by their URIs and
    nothing copies them back: the driver's working copy holds no checkpoint file, the evaluations
    read them on the store. The triggered evaluation took the checkpoint the event named (an s3://
    object) from the store and pushed its report."""
    s3, summary = s3_demo["s3"], s3_demo["summary"]
    run, train = summary["run_name"], summary["stages"]["train"]
    prefix = f"s3://runs/crucible/{run}/train/checkpoints/step-"
    assert train["checkpoints"] and all(u.startswith(prefix) for u in train["checkpoints"]), train
    evaluated = summary["stages"]["evaluate"]["checkpoints"]
    assert evaluated and all(e["checkpoint"].startswith(prefix) for e in evaluated), evaluated
    working_copy = s3_demo["tmp"] / "cache" / "s3" / "runs" / "crucible" / run
    assert working_copy.is_dir() and not list((working_copy / "train").rglob("*.safetensors")), \
        sorted((working_copy / "train").rglob("*"))[:10]
    log = s3.client.get_object(Bucket="runs", Key=f"crucible/{run}/train/torchrun.log")["Body"].read().decode()
    assert f"[tokens] s3://runs/crucible/{run}/tokens/index.json: staged in" in log, log[:2000]
    index = json.loads(s3.client.get_object(Bucket="runs", Key=f"crucible/{run}/tokens/index.json")["Body"].read())
    cached = {p.name for p in (s3_demo["tmp"] / "cache" / "node" / "tokens").glob("*.bin")}
    assert f"{index['splits']['train']['sha256']}-{Path(index['splits']['train']['path']).name}" in cached, cached
    rel = {k.split("/", 2)[2] for k in s3.keys("runs", f"crucible/{run}/")}
    last = Path(train["checkpoints"][-1]).name
    assert f"train/checkpoints/{last}/crucible_checkpoint.json" in rel and "train/checkpoints/checkpoints.json" in rel
    assert f"train/checkpoints/{last}/shard-00001-model-00001-of-00001.safetensors" in rel  # safetensors, no pickle
    assert f"evaluate/triggered/{last}.json" in rel, sorted(r for r in rel if r.startswith("evaluate"))


def test_the_store_had_the_torchrun_start_while_training_ran(s3_demo):
    """The train stage pushes the lineage log before torchrun starts: a triggered flow on another
    machine finds there the training run that wrote the checkpoint it was sent."""
    s3, run = s3_demo["s3"], s3_demo["summary"]["run_name"]
    key = f"crucible/{run}/lineage.jsonl"
    states = []
    for version in s3.client.list_object_versions(Bucket="runs", Prefix=key)["Versions"]:
        body = s3.client.get_object(Bucket="runs", Key=key, VersionId=version["VersionId"])["Body"].read()
        events = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        states.append({e["eventType"] for e in events if e["job"]["name"].endswith(".torchrun")})
    assert {"START"} in states, states  # a version with the torchrun job started and not yet complete


def test_lineage_names_objects_by_the_naming_spec_and_raw_sources_keep_their_licence(s3_demo):
    s3, summary = s3_demo["s3"], s3_demo["summary"]
    body = s3.client.get_object(Bucket="runs", Key=f"crucible/{summary['run_name']}/lineage.jsonl")["Body"].read()
    events = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
    datasets = {(d["namespace"], d["name"]): d for e in events for d in e.get("inputs", []) + e.get("outputs", [])}
    assert not [k for k in datasets if k[0] == "file" and "/cache/" in k[1]], "a working-copy path in lineage"
    shard = [k for k in datasets if k[0] == "s3://runs" and k[1].startswith(f"crucible/{summary['run_name']}/curate/shard-")]
    assert shard, sorted(datasets)[:20]
    raw = datasets[("s3://crawl", "cc/cc-net-head-sample.jsonl.gz")]
    facet = raw["facets"]["crucible_source"]
    assert facet["source"] == "cc_net_head" and "Common Crawl" in facet["licence"]
    assert raw["facets"]["version"]["datasetVersion"]  # the ETag
