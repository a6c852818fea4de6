"""The dedup shuffles and the MinHash index with an object-store run_root (moto's S3 server, IAM
auth on) and the stack's 2-node Ray cluster (a 0-CPU head, where this driver runs, and two 1-CPU
workers): the MinHash clustering (with the exact-Jaccard verifier reading the part files) and the
line counting take their Ray path and give the in-process result, while their spill files go from
task to task through the bucket (never the driver's working copy; deleted at the end) and the
worker nodes read their inputs on the store directly (ranged GETs, no copies staged on the node);
spill files written to a store prefix read back as the local ones. `index_dir` as an s3://
URI: the index is written to the bucket, and a second run on another machine (a fresh working
copy) reads it back and drops the duplicates; a bucket that does not exist fails naming the
setting. The bucket keeps versions, so the spill objects written and deleted stay visible."""
from __future__ import annotations

import gzip
import json
import os
import random
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from infra import stack
from s3_helpers import moto_s3, object_requests
from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT, LineDedupConfig, RayConfig
from tasks.core import storage
from tasks.core.documents import write_docs
from tasks.dedup.minhash import MinHasher

DATA = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
CC_MAIN = DATA / "web" / "cc-main-2019-30-sample.jsonl.gz"
pytestmark = pytest.mark.skipif(not CC_MAIN.exists(), reason=f"no data under {DATA}")
RUN_ROOT = "s3://runs/crucible"


def _texts(n: int) -> list[str]:
    with gzip.open(CC_MAIN, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    return [t for t in texts if len(t.split()) > 200][:n]


def _near_copies(texts: list[str], k: int, seed: int) -> list[str]:
    """`texts` and a near copy (2 % of the words replaced) of every third of its first `k`."""
    rng = random.Random(seed)
    out = list(texts)
    for t in texts[:k:3]:
        words = t.split()
        for i in rng.sample(range(len(words)), len(words) // 50):
            words[i] = f"w{rng.randrange(10**6)}"
        out.append(" ".join(words))
    return out


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dedup-store")
    with moto_s3(tmp, buckets=["runs", "index"]) as server:
        # versions keep what was written and deleted: the spill objects stay visible to the test
        server.client.put_bucket_versioning(Bucket="runs", VersioningConfiguration={"Status": "Enabled"})
        yield server


@pytest.fixture
def run_store(s3, tmp_path, monkeypatch):
    """run_root on the bucket, registered in this process only for the test, its working copy in
    `tmp_path/cache`."""
    monkeypatch.setattr(storage, "_STORES", {})
    return storage.open_store(RUN_ROOT, s3.options, str(tmp_path / "cache"), check_timeout=20)


@pytest.fixture(scope="module")
def cluster(s3, tmp_path_factory):
    """The stack's cluster, started after the server so that its nodes have the credentials in
    their environment (as on a real cluster); this process attached as its driver."""
    import ray

    from tasks.core.ray_utils import init_ray

    ray.shutdown()
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    cfg = stack.up_ray_on_free_ports(str(tmp_path_factory.mktemp("state")), ray_workers=2, ray_head_cpus=0,
                                     ray_worker_cpus=1, ray_object_store_mb=128, start_timeout=120, stop_timeout=15)
    try:
        os.environ.update(stack.ray_client_env(cfg))
        init_ray(RayConfig(address=stack.cluster_address(cfg)))
        yield cfg
    finally:
        ray.shutdown()
        stack.down_ray(cfg)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _written_and_deleted(s3, prefix: str) -> set[str]:
    """Keys under `prefix` (relative to it) that were written to the bucket and are deleted now."""
    versions = s3.client.list_object_versions(Bucket="runs", Prefix=prefix)
    written = {v["Key"][len(prefix):] for v in versions.get("Versions", [])}
    assert not s3.keys("runs", prefix), "spill objects left in the store"
    return written


def test_minhash_clustering_on_two_nodes_spills_through_the_store(s3, run_store, cluster):
    from tasks.dedup.cluster import cluster_signatures
    from tasks.dedup.verify import JaccardVerifier, ListTexts, ParquetTexts

    t0 = time.monotonic()
    corpus = _near_copies(_texts(30), 30, seed=1)
    sigs = MinHasher(seed=1).signatures(corpus)
    local, _ = cluster_signatures(sigs, 14, 8, method="local", verify=JaccardVerifier(ListTexts(corpus), 0.8),
                                  representative_threshold=0.7)
    assert sum(r != i for i, r in enumerate(local)) >= 5  # the copies were found
    run = f"run-{uuid.uuid4().hex[:8]}"
    parts_dir = run_store.local_root / run / "curate" / "_parts"
    # the part files the verifier reads: written on this node, in the working copy only
    files = write_docs([{"id": str(i), "text": t} for i, t in enumerate(corpus)], parts_dir, shard_docs=15, prefix="part")
    texts = ParquetTexts(files, [15, 15, len(corpus) - 30])
    with object_requests() as reads:
        got, stats = cluster_signatures(sigs, 14, 8, method="ray", work_dir=parts_dir, partitions=3,
                                        verify=JaccardVerifier(texts, 0.8), representative_threshold=0.7)
    assert got == local
    assert stats["candidate_pairs"] > 0 and stats["representative_check"]["pairs_checked"] > 0
    # every partition's spill files went through the bucket and were deleted there; none were in
    # the working copy (nor is their folder)
    spilled = _written_and_deleted(s3, f"crucible/{run}/curate/_parts/_lsh/")
    assert {k.split("/")[0] for k in spilled} == {"p-00000", "p-00001", "p-00002"}, spilled
    assert not (parts_dir / "_lsh").exists()
    recorded = {k for p in (run_store.local_root / ".crucible-store").glob("*.json") for k in json.loads(p.read_text())}
    assert not [k for k in recorded if "/_lsh/" in k]
    # the worker nodes read the part files on the store (the driver pushed them first) and the
    # spill files there: every partition's, and no copy was staged on a node
    assert {f"crucible/{run}/curate/_parts/{f.name}" for f in files} <= set(s3.keys("runs", f"crucible/{run}/"))
    read = {k.split(f"crucible/{run}/curate/_parts/", 1)[-1] for k in reads}
    assert {f.name for f in files} & read, read
    assert {k.split("/")[1] for k in read if k.startswith("_lsh/")} == {"p-00000", "p-00001", "p-00002"}, read
    print(f"\nMinHash clustering through the store: {time.monotonic() - t0:.1f}s, {stats}")


def _line_counts_locally_and_on_ray(run_store, n_texts: int, shard_docs: int, partitions: int):
    """A run's ingest shards in the working copy (every other document with a shared footer), and
    their frequent lines counted in process and on Ray: (run, shards, local, on_ray)."""
    from tasks.dedup.lines import count_frequent_lines

    footer = "Copyright 2019 Example Corp. All rights reserved.\nHome | About | Contact"
    docs = [{"id": str(i), "text": f"{t}\n{footer}" if i % 2 else t} for i, t in enumerate(_texts(n_texts))]
    run = f"run-{uuid.uuid4().hex[:8]}"
    shards = write_docs(docs, run_store.local_root / run / "ingest", shard_docs=shard_docs)
    cfg = LineDedupConfig(max_docs=5, partitions=partitions)
    local = count_frequent_lines(shards, cfg, run_store.local_root / run / "local", method="local")
    work = run_store.local_root / run / "curate" / "_parts"
    return run, shards, local, count_frequent_lines(shards, cfg, work, method="ray", spill_task_docs=shard_docs)


def test_line_counts_on_two_nodes_spill_through_the_store(s3, run_store, cluster):
    t0 = time.monotonic()
    with object_requests() as reads:
        run, shards, local, on_ray = _line_counts_locally_and_on_ray(run_store, 60, 20, 3)
    work = run_store.local_root / run / "curate" / "_parts"
    assert len(local.hashes) >= 2 and np.array_equal(on_ray.hashes, local.hashes)
    assert on_ray.stats["line_rows"] == local.stats["line_rows"] and on_ray.stats["spill_tasks"] == 3
    spilled = _written_and_deleted(s3, f"crucible/{run}/curate/_parts/_lines/")
    assert {k.split("/")[0] for k in spilled} == {"p-00000", "p-00001", "p-00002"}, spilled
    assert not (work / "_lines").exists()
    # every input shard was read on the store by the tasks (ranged GETs), none staged on a node
    assert {f"crucible/{run}/ingest/{p.name}" for p in shards} <= set(reads), sorted(reads)
    print(f"\nline counts through the store: {time.monotonic() - t0:.1f}s")


def test_spill_files_on_a_store_prefix_read_back_as_the_local_ones(s3, run_store, tmp_path):
    """A shuffle's spill written to a prefix on the store (each file one PUT) and a partition read
    back from there give the pairs of a local spill; dropping the spill deletes the prefix."""
    from tasks.dedup.cluster import drop_spill, partition_pairs, spill_shard

    corpus = _near_copies(_texts(20), 20, seed=3)
    sigs = np.stack(MinHasher(seed=1).signatures(corpus))
    run = f"run-{uuid.uuid4().hex[:8]}"
    source = tmp_path / "sigs.npy"
    np.save(source, sigs)
    s3.client.put_object(Bucket="runs", Key=f"crucible/{run}/sigs.npy", Body=source.read_bytes())
    spill = run_store.uri(f"{run}/_lsh")
    rows = spill_shard(run_store.uri(f"{run}/sigs.npy"), 0, 14, 8, 2, spill, 0, run_store.options)
    assert rows == 14 * len(corpus) and not (run_store.local_root / run).exists()  # nothing in the working copy
    assert sorted(s3.keys("runs", f"crucible/{run}/_lsh/")) == [f"crucible/{run}/_lsh/p-0000{p}/s-000000.parquet"
                                                               for p in (0, 1)]
    on_store = [partition_pairs(f"{spill}/p-{p:05d}", run_store.options) for p in (0, 1)]
    spill_shard(str(source), 0, 14, 8, 2, str(tmp_path / "lsh"), 0)
    local = [partition_pairs(str(tmp_path / "lsh" / f"p-{p:05d}")) for p in (0, 1)]
    assert sum(len(p) for p in local) > 0
    assert all(np.array_equal(a, b) for a, b in zip(on_store, local))
    drop_spill(spill, run_store.options)
    assert not s3.keys("runs", f"crucible/{run}/_lsh/")


@pytest.mark.parametrize("index_dir", [f"{RUN_ROOT}/dedup-index", "s3://index/minhash"],
                         ids=["under run_root", "own bucket"])
def test_index_dir_on_the_store_is_read_back_by_the_next_run(s3, run_store, tmp_path, monkeypatch, index_dir):
    from tasks.dedup.index import MinHashIndex

    params = (14, 8, 1, "affine32", "fast")
    texts = _texts(30)  # without the sample's own near duplicates
    unique = MinHashIndex(*params).add([str(i) for i in range(len(texts))], MinHasher(seed=1).signatures(texts))
    corpus = [t for t, dup in zip(texts, unique) if dup is None][:24]
    sigs = MinHasher(seed=1).signatures(corpus)
    first = MinHashIndex.open(index_dir, *params)
    assert first.add([f"a{i}" for i in range(len(corpus))], sigs) == [None] * len(corpus)
    first.save(index_dir)
    bucket, prefix = index_dir[len("s3://"):].split("/", 1)
    keys = {k[len(prefix) + 1:] for k in s3.keys(bucket, prefix + "/")}
    assert {"meta.json", "gen-000001/keys.npy", "gen-000001/ids.arrow"} <= keys, keys
    assert not Path("s3:").exists()

    # the next run, on another machine: nothing of the first working copy
    monkeypatch.setattr(storage, "_STORES", {})
    storage.open_store(RUN_ROOT, s3.options, str(tmp_path / "cache-2"), check_timeout=20)
    second = MinHashIndex.open(index_dir, *params)
    assert second.docs == len(corpus) and second.generation == 1
    copies = _near_copies(corpus, 24, seed=2)[len(corpus):]
    found = second.add([f"b{i}" for i in range(len(copies))], MinHasher(seed=1).signatures(copies))
    assert found == [f"a{i}" for i in range(0, 24, 3)]  # each near copy is dropped for its original
    second.save(index_dir)
    keys = {k[len(prefix) + 1:] for k in s3.keys(bucket, prefix + "/")}
    assert "gen-000002/keys.npy" in keys and not [k for k in keys if k.startswith("gen-000001/")]
    meta = json.loads(s3.client.get_object(Bucket=bucket, Key=f"{prefix}/meta.json")["Body"].read())
    assert meta["generation"] == 2 and meta["docs"] == len(corpus)


def test_index_dir_in_a_missing_bucket_fails_naming_the_setting(s3, run_store):
    from tasks.core.fs import StorageError
    from tasks.dedup.index import MinHashIndex

    with pytest.raises(StorageError, match=r"^curate\.dedup\.minhash\.index_dir s3://no-such-bucket/idx: .*"
                                           r"'no-such-bucket' does not exist"):
        MinHashIndex.open("s3://no-such-bucket/idx", 14, 8, 1, "affine32", "fast")


def test_index_dir_on_the_store_with_a_local_run_root_uses_the_storage_options(s3, tmp_path, monkeypatch):
    """A run whose run_root is local and whose index is on a store: the index's store is opened with
    the config's storage.options (the endpoint, the credential references) before the run starts,
    and curate's index then reads and saves through it."""
    from tasks.config import PipelineConfig
    from tasks.dedup.index import check_index_store
    from tasks.dedup.index import MinHashIndex

    monkeypatch.setattr(storage, "_STORES", {})
    cfg = PipelineConfig.model_validate({"name": "t", "sources": [
        {"name": "s", "uri": "text/x", "format": "text", "licence": "test", "provenance": "test"}],
        "run_root": str(tmp_path / "runs"), "storage": {
        "options": s3.options, "cache_dir": str(tmp_path / "cache")},
        "curate": {"dedup": {"minhash": {"index_dir": "s3://index/local-run"}}}})
    check_index_store(cfg)
    index = MinHashIndex.open("s3://index/local-run", 14, 8, 1, "affine32", "fast")
    index.add(["x"], MinHasher(seed=1).signatures(_texts(1)))
    index.save("s3://index/local-run")
    assert "local-run/meta.json" in s3.keys("index", "local-run/")
    assert (tmp_path / "cache").is_dir()


def test_a_save_on_a_stale_generation_of_the_store_is_refused(s3, run_store, tmp_path, monkeypatch):
    """Two machines open the same store index at one generation; once the first saved, the second's
    save is refused (the store's meta.json is the arbiter, not the second's stale working copy)."""
    from tasks.dedup.index import MinHashIndex

    index_dir, params = f"{RUN_ROOT}/stale-index-{uuid.uuid4().hex[:6]}", (14, 8, 1, "affine32", "fast")
    sigs = MinHasher(seed=1).signatures(_texts(4))
    first = MinHashIndex.open(index_dir, *params)
    first.add(["a0", "a1"], sigs[:2])
    first.save(index_dir)  # generation 1
    a = MinHashIndex.open(index_dir, *params)
    monkeypatch.setattr(storage, "_STORES", {})  # another machine: a working copy of its own
    storage.open_store(RUN_ROOT, s3.options, str(tmp_path / "cache-b"), check_timeout=20)
    b = MinHashIndex.open(index_dir, *params)
    assert a.generation == b.generation == 1
    b.add(["b0"], sigs[2:3])
    b.save(index_dir)  # generation 2 on the store
    monkeypatch.setattr(storage, "_STORES", {})
    storage.open_store(RUN_ROOT, s3.options, run_store.cache_dir, check_timeout=20)
    a.add(["a2"], sigs[3:4])
    with pytest.raises(RuntimeError, match="at generation 2, this one was opened at 1"):
        a.save(index_dir)
    bucket, prefix = index_dir[len("s3://"):].split("/", 1)
    meta = json.loads(s3.client.get_object(Bucket=bucket, Key=f"{prefix}/meta.json")["Body"].read())
    assert meta["generation"] == 2 and meta["docs"] == 3


def _dedup_jobs(folder: Path, corpus: list[str], per_job: int) -> list:
    """The curate jobs' files of `corpus` under `folder` (meta with exact keys, URL keys, MinHash
    signatures; one part file a job): documents 28.. share their URL with 8.., exact copies of
    the first three at the end."""
    import hashlib

    from tasks.dedup.stages import JobDocs, write_meta

    sigs = MinHasher(seed=1).signatures(corpus)
    jobs = []
    for j, lo in enumerate(range(0, len(corpus), per_job)):
        rows = range(lo, min(lo + per_job, len(corpus)))
        part = write_docs([{"id": f"d{i}", "text": corpus[i]} for i in rows], folder, shard_docs=per_job,
                          prefix=f"part-{j:03d}")[0]
        meta = folder / f"meta-{j:03d}.parquet"
        digest = (lambda text: hashlib.sha256(text.encode()).digest())
        write_meta(meta, {"id": [f"d{i}" for i in rows], "key": [digest(corpus[i]) for i in rows],
                          "nbytes": [len(corpus[i].encode()) for i in rows], "source": ["web"] * len(rows),
                          "score": [None] * len(rows),
                          "url_key": [digest(f"https://ex.com/{i if i < 28 else i - 20}") for i in rows],
                          "crawl_time": [float(i) for i in rows], "sig": [sigs[i].tobytes() for i in rows]})
        jobs.append(JobDocs(f"{j:03d}", str(meta), (str(part),), len(rows), lo))
    return jobs


def _run_dedup_stages(jobs: list, parts_dir: Path, out_dir: Path, after_start=None) -> dict:
    """The curate stage's URL, exact and MinHash (Ray clustering, exact-Jaccard verifier) dedup
    over `jobs`, its filter pass and report: what they decided and wrote."""
    import ray

    from tasks.config import MinHashConfig
    from tasks.dedup.stages import DedupStages, dedup_report_task, filter_pass, part_counts
    from tasks.dedup.verify import JaccardVerifier, ParquetTexts

    stages = DedupStages(jobs, parts_dir / "_dedup", partitions=3, block_docs=12)
    if after_start:
        after_start()
    stages.key_step("url_dedup", "url_key", "url")
    stages.key_step("exact_dedup", "key", "first")
    mh = MinHashConfig(clustering="ray", partitions=3)
    parts = [(p, n) for j in jobs for p, n in zip(j.docs, part_counts(j))]
    verify = JaccardVerifier(ParquetTexts([p for p, _ in parts], [n for _, n in parts]), 0.8)
    clustering = stages.minhash_step(mh, verify, "ray")
    out = filter_pass(stages, out_dir, 10)
    report = ray.get(ray.remote(num_cpus=1)(dedup_report_task).remote(
        stages.drop_files(), {"web": sum(j.kept for j in jobs)}, sum(j.kept for j in jobs), stages.jobs, mh, mh.ngram))
    lines = b"".join(Path(p).read_bytes() for p in stages.dropped_lines())
    from tasks.core.documents import iter_docs

    return {"steps": [st.to_dict() | {"seconds": 0} for st in stages.steps], "lines": lines,
            "kept": [d["id"] for d in iter_docs(out["shards"])], "report": report,
            "pairs": clustering["candidate_pairs"]}


def test_dedup_stages_on_two_nodes_pass_their_files_through_the_store(s3, run_store, cluster, tmp_path):
    """Curate's URL, exact and MinHash dedup stages, filter pass and report on the 2-node cluster
    with run_root on the bucket decide as on a local disk, while every per-job and per-partition
    file of theirs goes through the store: the jobs' meta and part files are removed from the
    working copy once the stages start (a node elsewhere never had them), the partition tasks
    read their spill files on the bucket, and nothing of `_dedup` is left in the working copy."""
    t0 = time.monotonic()
    corpus = _near_copies(_texts(24), 24, seed=4)
    corpus += corpus[:3]  # exact copies
    local = _run_dedup_stages(_dedup_jobs(tmp_path / "local", corpus, 12), tmp_path / "local", tmp_path / "out-local")
    assert {"url_dedup", "exact_dedup", "minhash_dedup"} <= {s for st in local["steps"] for s in st["dropped"]}

    run = f"run-{uuid.uuid4().hex[:8]}"
    parts_dir = run_store.local_root / run / "curate" / "_parts"
    jobs = _dedup_jobs(parts_dir, corpus, 12)

    def working_copy_gone():  # the jobs' files, pushed by the stages: only the store has them now
        for j in jobs:
            for f in (j.meta, *j.docs):
                Path(f).unlink()

    with object_requests() as reads:
        got = _run_dedup_stages(jobs, parts_dir, tmp_path / "out-store", working_copy_gone)
    assert got == local
    prefix = f"crucible/{run}/curate/_parts/_dedup/"
    written = {v["Key"][len(prefix):] for v in
               s3.client.list_object_versions(Bucket="runs", Prefix=prefix).get("Versions", [])}
    for step in ("url_dedup", "exact_dedup", "minhash_dedup"):  # every partition spilled on the store
        assert {k.split("/")[2] for k in written if k.startswith(f"{step}/_spill/")} == {
            "p-00000", "p-00001", "p-00002"}, sorted(written)
        assert {k[len(prefix):].split("/")[2] for k in reads if k.startswith(f"{prefix}{step}/_spill/")} == {
            "p-00000", "p-00001", "p-00002"}, sorted(reads)
    assert {"url_dedup/j-000.parquet", "minhash_dedup/j-000.jsonl", "kept_per_job.npy"} <= written, sorted(written)
    assert any(k.startswith("_report/chain-0/") for k in written), sorted(written)
    assert not [k for k in s3.keys("runs", prefix) if "_spill/" in k or "_report/" in k]  # dropped once read
    assert {f"crucible/{run}/curate/_parts/meta-000.parquet"} <= set(reads)  # the jobs' files, read there
    left = [p for p in (parts_dir / "_dedup").rglob("*") if p.is_file()]
    assert [p.name for p in left] == ["dropped-lines.jsonl"], left  # only what the driver fetched to write
    print(f"\ndedup stages through the store: {time.monotonic() - t0:.1f}s, {got['steps']}")


def test_curated_shards_written_on_other_nodes_reach_the_store_and_the_manifest_verifies(s3, run_store, cluster,
                                                                                         tmp_path):
    """The filter pass on the 2-node cluster with run_root on the bucket: the working copy is the
    driver's disk, which the worker nodes do not share, so each shard task writes its curated shard
    to the store itself (PUT by the tasks, before any push). The driver gets them into its working
    copy as the store's: the stage's push uploads none again and deletes none (one version each),
    a stale shard of an earlier, longer run is gone, and the manifest written from the working copy
    verifies against the store's objects."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.core.resume import write_manifest

    corpus = _near_copies(_texts(24), 24, seed=4) + _texts(24)[:3]
    local = _run_dedup_stages(_dedup_jobs(tmp_path / "local", corpus, 12), tmp_path / "local", tmp_path / "out-local")
    run = f"run-{uuid.uuid4().hex[:8]}"
    stage_dir = run_store.local_root / run / "curate"
    prefix = f"crucible/{run}/curate/"
    s3.client.put_object(Bucket="runs", Key=f"{prefix}shard-00099.parquet", Body=b"an earlier run's")
    jobs = _dedup_jobs(stage_dir / "_parts", corpus, 12)
    with object_requests("PUT") as puts:
        got = _run_dedup_stages(jobs, stage_dir / "_parts", stage_dir)
    assert got["kept"] == local["kept"] and got["steps"] == local["steps"]
    shards = sorted(stage_dir.glob("shard-*.parquet"))
    assert len(shards) == -(-len(got["kept"]) // 10) >= 2
    # written to the store by the shard tasks themselves (the driver has not pushed anything yet)
    assert {f"{prefix}{p.name}" for p in shards} <= set(puts), sorted(puts)
    assert f"{prefix}shard-00099.parquet" not in s3.keys("runs", prefix)
    summary = {"shards": [str(p) for p in shards]}
    write_manifest(stage_dir, "key", summary, summary["shards"], [])
    with object_requests("PUT") as pushed:
        run_store.push(stage_dir)
    assert not [k for k in pushed if "/shard-" in k], pushed  # not uploaded again
    manifest = json.loads(s3.client.get_object(Bucket="runs", Key=f"{prefix}manifest.json")["Body"].read())
    on_store = {e["path"]: e for e in manifest["files"]}
    assert sorted(on_store) == [p.name for p in shards]
    for name, entry in on_store.items():
        versions = s3.client.list_object_versions(Bucket="runs", Prefix=f"{prefix}{name}")["Versions"]
        assert len(versions) == 1, versions  # neither overwritten by the push nor deleted
        body = s3.client.get_object(Bucket="runs", Key=f"{prefix}{name}")["Body"].read()
        assert hashlib.sha256(body).hexdigest() == entry["sha256"]
        assert pq.ParquetFile(pa.BufferReader(body)).metadata.num_rows == entry["docs"]


def test_on_a_one_node_ray_the_shuffle_spills_on_the_driver_disk_not_the_store(s3, run_store):
    """A local Ray shares the driver's disk: the line counts' spill files stay there (the same
    counts), and nothing of the shuffle goes to the bucket. Runs last: it leaves the cluster."""
    import ray

    from tasks.core.ray_utils import init_ray

    ray.shutdown()
    init_ray(RayConfig(num_cpus=1))
    try:
        run, _, local, on_ray = _line_counts_locally_and_on_ray(run_store, 20, 10, 2)
        work = run_store.local_root / run / "curate" / "_parts"
        assert np.array_equal(on_ray.hashes, local.hashes) and on_ray.stats["spill_tasks"] == 2
        assert not s3.client.list_object_versions(Bucket="runs", Prefix=f"crucible/{run}/").get("Versions")
        assert not (work / "_lines").exists()
    finally:
        ray.shutdown()


def test_an_index_save_on_the_store_holds_its_lock_and_waits_for_another_writer(s3, run_store, monkeypatch):
    """A save takes the index's lock object (a conditional write) around the generation check and
    the upload: another writer's fresh lock makes it wait, then fail naming the setting and the
    holder; a lock left by a holder that died an hour ago is taken over; none is left behind."""
    from tasks.core.fs import StorageError
    from tasks.dedup import index as index_module
    from tasks.dedup.index import MinHashIndex

    index_dir, params = f"{RUN_ROOT}/locked-{uuid.uuid4().hex[:6]}", (14, 8, 1, "affine32", "fast")
    lock_key = f"{index_dir[len('s3://runs/'):]}/.save.lock"
    sigs = MinHasher(seed=1).signatures(_texts(2))
    index = MinHashIndex.open(index_dir, *params)
    index.add(["a0"], sigs[:1])
    held_during_upload = []
    upload = index_module._upload_generation

    def upload_seeing_the_lock(*args):
        held_during_upload.append(lock_key in s3.keys("runs", lock_key))
        return upload(*args)

    monkeypatch.setattr(index_module, "_upload_generation", upload_seeing_the_lock)
    index.save(index_dir)
    assert held_during_upload == [True] and lock_key not in s3.keys("runs", lock_key)

    monkeypatch.setattr(index_module, "LOCK_TIMEOUT_S", 2.0)
    other = {"host": "node-b", "pid": 4242, "since": time.time()}
    s3.client.put_object(Bucket="runs", Key=lock_key, Body=json.dumps(other).encode())
    again = MinHashIndex.open(index_dir, *params)
    again.add(["a1"], sigs[1:])
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=r"^curate\.dedup\.minhash\.index_dir .*held since .* by pid 4242 on node-b"):
        again.save(index_dir)
    assert 2.0 <= time.monotonic() - t0 < 10
    assert json.loads(s3.client.get_object(Bucket="runs", Key=lock_key)["Body"].read()) == other  # not taken

    s3.client.put_object(Bucket="runs", Key=lock_key, Body=json.dumps({**other, "since": time.time() - 7200}).encode())
    again.save(index_dir)  # the dead holder's lock is taken over
    assert MinHashIndex.open(index_dir, *params).generation == 2 and lock_key not in s3.keys("runs", lock_key)
