"""RunStore's working copy and the reads of a store run where it lives, against moto's S3 server."""
from __future__ import annotations

from pathlib import Path

from s3_helpers import moto_s3
from tasks.core import storage


def test_prune_cache_drops_the_least_recently_used_files_beyond_the_bound(tmp_path):
    import os
    import time

    bound = storage.CacheBound(max_bytes=1000, min_age_s=600)
    now = time.time()
    ages = {"a": 5000, "b": 4000, "c": 3000, "d": 2000, "recent": 10}  # seconds since last use
    for name, age in ages.items():
        (tmp_path / name).write_bytes(b"x" * 300)
        os.utime(tmp_path / name, (now - age, now - age))
    stats = storage.prune_cache(tmp_path, bound, force=True)
    # 1,500 bytes > 1,000: the oldest go until at most 800 remain
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "recent"], stats
    assert stats["removed"] == 3 and stats["removed_bytes"] == 900
    assert storage.prune_cache(tmp_path, bound, force=True)["removed"] == 0  # within the bound now
    assert storage.prune_cache(tmp_path, storage.CacheBound(max_bytes=1, min_age_s=600)) == {}  # once a minute
    # files used within min_age_s stay, whatever the size
    assert storage.prune_cache(tmp_path, storage.CacheBound(max_bytes=1, min_age_s=1000), force=True)["removed"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["recent"]


def test_a_job_on_another_node_reads_its_inputs_from_the_store_and_its_node_keeps_nothing(tmp_path, monkeypatch):
    """A job on a node other than the driver's gets its working-copy inputs downloaded from the store
    into a folder of its own (never the driver's files), removed with the job: no node cache."""
    monkeypatch.setattr(storage, "_STORES", {})
    monkeypatch.setattr(storage.tempfile, "tempdir", str(tmp_path / "tmp"))  # node_root's $TMPDIR
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        s3.client.put_object(Bucket="runs", Key="crucible/r1/ingest/shard-0.parquet", Body=b"shard")
        node = storage.node_root("other")

        def read(path: str) -> tuple[bytes, bool]:
            return open(path, "rb").read(), Path(path).is_relative_to(node)

        for _ in range(2):  # each job downloads its input again
            got, _ = storage.Staging((store,), "driver").run(read, (str(store.local_root / "r1" / "ingest" /
                                                                          "shard-0.parquet"),), "other")
            assert got == (b"shard", True)
            assert not [p for p in node.rglob("*") if p.is_file()]  # nothing kept on the node
        assert not (store.local_root / "r1").exists()  # nor brought into the driver's working copy


def test_the_record_is_kept_per_run_and_a_run_s_updates_leave_the_others_alone(tmp_path, monkeypatch):
    """A job's outputs left on the store in one run rewrite that run's record only."""
    monkeypatch.setattr(storage, "_STORES", {})
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        for run in ("r1", "r2"):
            (store.local_root / run / "curate").mkdir(parents=True)
            (store.local_root / run / "curate" / "part-0.parquet").write_bytes(run.encode())
        (store.local_root / ".continue").mkdir()
        (store.local_root / ".continue" / "ledger.sqlite").write_bytes(b"ledger")
        assert store.push()["uploaded"] == 3
        records = store.local_root / ".crucible-store"
        assert sorted(p.name for p in records.glob("*.json")) == [".continue.json", "r1.json", "r2.json"]
        assert not [k for k in s3.keys("runs", "crucible/") if ".crucible-store" in k]  # never pushed
        before = (records / "r1.json").stat().st_ino  # a rewrite renames a new file into place
        s3.client.put_object(Bucket="runs", Key="crucible/r2/curate/part-0.parquet", Body=b"job")
        storage.left_on_store([str(store.local_root / "r2" / "curate" / "part-0.parquet")])  # another node's
        assert (records / "r1.json").stat().st_ino == before
        assert not store.recorded("r2/curate/part-0.parquet") and store.recorded("r1/curate/part-0.parquet")
        assert not (store.local_root / "r2" / "curate" / "part-0.parquet").exists()  # the stale copy is gone
        assert store.push()["deleted"] == 0  # and the store's new object stays
        assert s3.client.get_object(Bucket="runs", Key="crucible/r2/curate/part-0.parquet")["Body"].read() == b"job"


def test_a_job_on_another_node_leaves_its_parts_on_the_store_and_the_driver_reads_them_there(tmp_path,
                                                                                             monkeypatch):
    """A job that ran on a node other than the driver's: its files go to the store and stay there
    (the driver's working copy never gets them), its stored result is recorded by the sha256s the
    node computed as it uploaded, verified on the store when reused (a part changed there is
    refused), the driver's merge reads the parts on the store, and the stage's manifest takes the
    store's `_parts` with it."""
    from tasks.core.executor import ResumableOutput
    from tasks.core.hashing import sha256_text
    from tasks.core.resume import JobStore
    from tasks.dedup.stages import concat_files

    monkeypatch.setattr(storage, "_STORES", {})
    monkeypatch.setattr(storage.tempfile, "tempdir", str(tmp_path / "tmp"))  # node_root's $TMPDIR
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        output = ResumableOutput(store.local_root / "r1" / "ingest", "run-key", [])
        parts = output.start(resume=True)

        def job(part_dir: str) -> dict:
            Path(part_dir).mkdir(parents=True, exist_ok=True)  # as a job's writers do
            (Path(part_dir) / "000-q.jsonl").write_text('{"id": 1}\n')
            return {"parts": [str(Path(part_dir) / "000-q.jsonl")]}

        result, written = storage.Staging((store,), "driver").run(job, (str(parts.dir),), "other-node")
        part = parts.dir / "000-q.jsonl"
        assert result == {"parts": [str(part)]} and written == {str(part): sha256_text('{"id": 1}\n')}
        storage.left_on_store(written)
        assert not part.exists()  # not downloaded ...
        assert s3.keys("runs", "crucible/r1/ingest/_parts/") == ["crucible/r1/ingest/_parts/000-q.jsonl"]  # ... there
        parts.save("000", "k", result, written)
        assert JobStore(parts.dir).load("000", "k") == result  # verified on the store
        concat_files([part, part], output.dir / "q.jsonl")
        assert (output.dir / "q.jsonl").read_text() == '{"id": 1}\n' * 2
        s3.client.put_object(Bucket="runs", Key="crucible/r1/ingest/_parts/000-q.jsonl", Body=b'{"id": 2}\n')
        assert JobStore(parts.dir).load("000", "k") is None  # changed on the store: the job runs again
        output.publish({"shards": []})
        assert s3.keys("runs", "crucible/r1/ingest/_parts/") == [] and not parts.dir.exists()



def test_a_part_replaced_on_the_store_after_its_job_reported_it_is_never_merged(tmp_path, monkeypatch):
    """Attack: a writer of the store replaces a job's part after the driver recorded it (or after a
    resumed run reused it). Each merge that reads parts there holds them, on the read that copies
    them, to the sha256 the job reported: concat_files (ingest's quarantine), ingest's shard link
    and the tokens stage's concatenation raise StorageError and put nothing in place."""
    import numpy as np
    import pytest

    from tasks.core.executor import ResumableOutput
    from tasks.core.fs import StorageError
    from tasks.core.resume import JobStore
    from tasks.dedup.stages import concat_files
    from tasks.ingest.run import _link
    from tasks.tokens.prepare import SPLITS, _concatenate

    monkeypatch.setattr(storage, "_STORES", {})
    monkeypatch.setattr(storage.tempfile, "tempdir", str(tmp_path / "tmp"))
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        output = ResumableOutput(store.local_root / "r1" / "ingest", "run-key", [])
        parts = output.start(resume=True)

        def job(part_dir: str) -> dict:
            Path(part_dir).mkdir(parents=True, exist_ok=True)
            (Path(part_dir) / "000-q.jsonl").write_text('{"id": 1}\n')
            (Path(part_dir) / "000-shard.bin").write_bytes(b"\x01\x00" * 4)
            return {"parts": [str(Path(part_dir) / n) for n in ("000-q.jsonl", "000-shard.bin")]}

        result, written = storage.Staging((store,), "driver").run(job, (str(parts.dir),), "other-node")
        storage.left_on_store(written)
        parts.save("000", "k", result, written)
        quarantine, shard = (Path(p) for p in result["parts"])
        for name, planted in (("000-q.jsonl", b'{"id": "planted"}\n'), ("000-shard.bin", b"\x02\x00" * 4)):
            s3.client.put_object(Bucket="runs", Key=f"crucible/r1/ingest/_parts/{name}", Body=planted)

        with pytest.raises(StorageError, match="not those its job reported"):
            concat_files([quarantine], output.dir / "q.jsonl", parts.part_sha256)
        with pytest.raises(StorageError, match="not those its job reported"):
            _link(shard, output.dir / "shard-00000.parquet", parts.part_sha256)
        split_files = {s: output.dir / f"{s}.bin" for s in SPLITS}
        token_part = {"sources": ["a"], "paths": {s: str(shard) for s in SPLITS},
                      "sha256": {s: written[str(shard)] for s in SPLITS},
                      "doc_lens": {s: np.array([4], dtype=np.int64).tobytes() for s in SPLITS},
                      "doc_sources": {s: np.zeros(1, dtype=np.uint16).tobytes() for s in SPLITS},
                      "stats": {s: {"tokens": 4, "docs": 1, "bytes": 8} for s in SPLITS}}
        with pytest.raises(StorageError, match="not those its job reported"):
            _concatenate([token_part], split_files, {s: output.dir / f"{s}.starts.npy" for s in SPLITS},
                         {s: output.dir / f"{s}.sources.npy" for s in SPLITS})
        assert not (output.dir / "q.jsonl").exists() and not (output.dir / "shard-00000.parquet").exists()
        assert sorted(p.name for p in output.dir.iterdir() if p.name.startswith(".")) == []  # no temp left

        # a resumed run: the record verifies now (the store's bytes are the job's again), the part is
        # replaced after that, and the merge still refuses it
        s3.client.put_object(Bucket="runs", Key="crucible/r1/ingest/_parts/000-q.jsonl", Body=b'{"id": 1}\n')
        reused = JobStore(parts.dir)
        assert reused.load("000", "k") is None  # the shard is still the planted one: redone
        s3.client.put_object(Bucket="runs", Key="crucible/r1/ingest/_parts/000-shard.bin", Body=b"\x01\x00" * 4)
        assert reused.load("000", "k") == result
        s3.client.put_object(Bucket="runs", Key="crucible/r1/ingest/_parts/000-q.jsonl",
                             Body=b'{"id": "planted"}\n')
        with pytest.raises(StorageError, match="not those its job reported"):
            concat_files([quarantine], output.dir / "q.jsonl", reused.part_sha256)
        with pytest.raises(StorageError, match="no sha256 recorded"):  # a part its job never reported
            concat_files([output.dir / "_parts" / "other.jsonl"], output.dir / "q.jsonl", reused.part_sha256)
        _link(shard, output.dir / "shard-00000.parquet", reused.part_sha256)  # the genuine one goes in
        assert (output.dir / "shard-00000.parquet").read_bytes() == b"\x01\x00" * 4


def test_the_tokens_stage_holds_its_store_parts_to_the_sha256_their_jobs_reported(base, tmp_path, monkeypatch):
    """The tokens stage keeps no job records: the sha256 each encoding job on another node reported
    as it uploaded its parts is kept with the part (JobRunner.written), so a part replaced on the
    store before the concatenation is refused, not concatenated into the split."""
    import pytest
    import ray

    from lm_helpers import corpus_shards, tiny_cfg, tokenizer_artifact
    from tasks.core.fs import StorageError
    from tasks.tokens import prepare

    shards, tokenizer = corpus_shards(base), Path(tokenizer_artifact(base)["path"])
    monkeypatch.setattr(storage, "_STORES", {})
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        # every job runs as on a node other than the driver's: its parts go to the store only
        monkeypatch.setattr(storage.Staging, "for_driver", classmethod(lambda cls: cls((store,), "another-node")))
        concatenate = prepare._concatenate

        def replaced_first(parts, *args):
            assert not Path(parts[0]["paths"]["train"]).exists()  # the part is on the store only
            key = store.rel(parts[0]["paths"]["train"])
            s3.client.put_object(Bucket="runs", Key=f"crucible/{key}", Body=b"\x00\x00" * 8)
            return concatenate(parts, *args)

        monkeypatch.setattr(prepare, "_concatenate", replaced_first)
        try:
            with pytest.raises(StorageError, match="not those its job reported"):
                prepare.prepare_tokens(tiny_cfg(tokens={"ray": True}, ray={"num_cpus": 2}), tokenizer, shards,
                                       store.local_root / "r1" / "tokens")
        finally:
            ray.shutdown()


def test_ingest_holds_every_part_its_tasks_read_on_the_store_to_its_job_s_sha256(tmp_path, monkeypatch):
    """Ingest's merge on a store run whose jobs ran on other nodes: the duplicate-id tasks read the
    jobs' id files and parts on the store, and a file replaced there after its job reported it (here
    a genuine id file of another job: valid Parquet, wrong duplicates) is refused, not merged."""
    import json

    import pytest
    import ray

    import tasks.core.ray_utils as ray_utils
    import tasks.ingest.run as ingest_run
    from tasks.config import IngestConfig, PipelineConfig, RayConfig, SourceConfig
    from tasks.core.fs import StorageError

    monkeypatch.setattr(storage, "_STORES", {})
    folder = tmp_path / "src"
    folder.mkdir()
    for f, keys in enumerate((["a", "b", "c"], ["b", "d"])):
        (folder / f"f{f}.jsonl").write_text("".join(json.dumps({"id": k, "text": f"text {k}"}) + "\n" for k in keys))
    cfg = PipelineConfig(name="planted", ray=RayConfig(num_cpus=2), ingest=IngestConfig(shard_docs=2),
                         sources=[SourceConfig(name="s", uri=str(folder / "*.jsonl"), format="jsonl",
                                               licence="test-licence", provenance="test")])
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        monkeypatch.setattr(storage.Staging, "for_driver", classmethod(lambda cls: cls((store,), "another-node")))
        monkeypatch.setattr(ray_utils, "only_this_node", lambda: False)  # the tasks read the store's prefix
        merge = ingest_run._merge
        prefix = "crucible/r1/ingest/_parts/"

        def planted(plan, results, *args):
            ids = sorted(k for k in s3.keys("runs", prefix) if "-ids/" in k)
            assert len(ids) == 2 and not list((store.local_root / "r1" / "ingest" / "_parts").rglob("*.parquet"))
            body = s3.client.get_object(Bucket="runs", Key=ids[1])["Body"].read()
            s3.client.put_object(Bucket="runs", Key=ids[0], Body=body)
            return merge(plan, results, *args)

        monkeypatch.setattr(ingest_run, "_merge", planted)
        try:
            with pytest.raises(StorageError, match="not those its job reported"):
                ingest_run.run_ingest(cfg, store.local_root / "r1" / "ingest")
        finally:
            ray.shutdown()


def test_a_job_part_named_with_dotdot_is_never_another_run_s_object(tmp_path, monkeypatch):
    """A part path with `..` resolves (RunStore.rel) to an object outside the job store's folder,
    e.g. another run's: it is never recorded as the job's, and a record that names one (signed as
    the stack signs results) is not reused, even though the object there has the recorded sha256."""
    import json

    import pytest

    from tasks.core.hashing import sha256_text
    from tasks.core.resume import JOB_PURPOSE, JOB_SUFFIX, JobStore
    from tasks.core.signing import sign_record

    monkeypatch.setattr(storage, "_STORES", {})
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        s3.client.put_object(Bucket="runs", Key="crucible/r2/ingest/shard-00000.parquet", Body=b"other run")
        parts = JobStore(store.local_root / "r1" / "ingest" / "_parts")
        parts.dir.mkdir(parents=True)
        escaping = str(parts.dir / ".." / ".." / ".." / "r2" / "ingest" / "shard-00000.parquet")
        assert storage.read_location(escaping)[0] == "s3://runs/crucible/r2/ingest/shard-00000.parquet"
        with pytest.raises(ValueError, match="outside"):
            parts.save("000", "k", {"parts": [escaping]}, {escaping: sha256_text("other run")})
        body = {"key": "k", "part_sha256": {escaping: sha256_text("other run")}, "result": {"parts": [escaping]}}
        (parts.dir / f"000{JOB_SUFFIX}").write_text(json.dumps(sign_record(body, JOB_PURPOSE)))
        assert parts.load("000", "k") is None and parts.part_sha256 == {}


def test_a_stage_s_store_parts_go_only_once_its_manifest_is_on_the_store(tmp_path, monkeypatch):
    """publish: a reader of the store (a resume on another machine) must never find neither the
    parts nor the manifest, so the manifest and the merged files are pushed before the store's
    `_parts` are deleted."""
    from tasks.core.executor import ResumableOutput

    monkeypatch.setattr(storage, "_STORES", {})
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        output = ResumableOutput(store.local_root / "r1" / "ingest", "run-key", [])
        output.start(resume=True)
        s3.client.put_object(Bucket="runs", Key="crucible/r1/ingest/_parts/000-q.jsonl", Body=b"part")
        seen = []
        remove_tree = storage.remove_tree

        def noting(at, options=None):
            seen.append((str(at), s3.keys("runs", "crucible/r1/ingest/")))
            return remove_tree(at, options)

        monkeypatch.setattr(storage, "remove_tree", noting)
        output.publish({"shards": []})
        assert [at for at, _ in seen] == ["s3://runs/crucible/r1/ingest/_parts"]
        assert "crucible/r1/ingest/manifest.json" in seen[0][1]  # on the store before the parts went
        assert s3.keys("runs", "crucible/r1/ingest/") == ["crucible/r1/ingest/manifest.json"]


def test_a_stage_started_afresh_clears_its_store_parts_and_records(tmp_path, monkeypatch):
    """start(resume=False): the parts and signed job records an earlier run left on the store (jobs
    on other nodes wrote them there only) go with the local ones, so a later resume never reuses them."""
    from tasks.core.executor import ResumableOutput

    monkeypatch.setattr(storage, "_STORES", {})
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        for name in ("000-shard.parquet", "000.job.json"):
            s3.client.put_object(Bucket="runs", Key=f"crucible/r1/ingest/_parts/{name}", Body=b"old")
        output = ResumableOutput(store.local_root / "r1" / "ingest", "run-key", [])
        (output.parts_dir).mkdir()
        (output.parts_dir / "001.job.json").write_text("old")
        output.start(resume=False)
        assert s3.keys("runs", "crucible/r1/ingest/_parts/") == []
        assert output.parts_dir.is_dir() and list(output.parts_dir.iterdir()) == []


def test_a_run_pulled_to_resume_on_another_machine_leaves_its_checkpoints_on_the_store(tmp_path, monkeypatch):
    """Resuming a run another machine started brings its records into the working copy, never its
    checkpoints: those are read where they are, by URI (a pull of them would download every step)."""
    from tasks.core.layout import RunLayout

    monkeypatch.setattr(storage, "_STORES", {})
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        for key in ("r1/config.json", "r1/curate/manifest.json", "r1/train/checkpoints/step-000010/model.safetensors",
                    "r1/train/checkpoints-old.json"):
            s3.client.put_object(Bucket="runs", Key=f"crucible/{key}", Body=b"x")
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        layout = RunLayout.for_run(store.local_root, "r1")
        assert store.pull_run(layout) == 3  # what open_run calls for a run another machine started
        got = sorted(p.relative_to(store.local_root).as_posix() for p in store.local_root.rglob("*")
                     if p.is_file() and ".crucible-store" not in p.as_posix())
        assert got == ["r1/config.json", "r1/curate/manifest.json", "r1/train/checkpoints-old.json"], got


def test_tree_sha256_of_a_store_prefix_is_the_local_trees_and_downloads_nothing(tmp_path, monkeypatch):
    """One tree hash for a checkpoint wherever it lives: its objects are streamed, never copied to disk."""
    from tasks.core import fs
    from tasks.core.hashing import sha256_tree
    from tasks.train import checkpoint

    tree = tmp_path / "step-000002"
    for rel, body in {"a.bin": b"x" * 3000, "b/c.json": b"{}", "b/d/e": b"e", "b10": b"z"}.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(body)

    def no_download(*a, **k):
        raise AssertionError("the tree was downloaded to be hashed")

    monkeypatch.setattr(fs, "download", no_download)
    monkeypatch.setattr(checkpoint, "download", no_download)
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        for p in tree.rglob("*"):
            if p.is_file():
                s3.client.upload_file(str(p), "runs", f"r/step-000002/{p.relative_to(tree).as_posix()}")
        uri = "s3://runs/r/step-000002"
        assert fs.tree_sha256(uri, s3.options) == sha256_tree(tree) == fs.tree_sha256(tree)
        assert fs.tree_sha256(f"{uri}/b/c.json", s3.options) == sha256_tree(tree / "b" / "c.json")
        (tree / "crucible_checkpoint.json").write_text("{}")  # checkpoint_problem's completeness check
        s3.client.upload_file(str(tree / "crucible_checkpoint.json"), "runs", "r/step-000002/crucible_checkpoint.json")
        assert checkpoint.checkpoint_problem(uri, expected_tree_sha256=sha256_tree(tree), storage_options=s3.options) is None


def test_a_checkpoint_named_by_its_uri_has_its_run_layout_and_lineage_name(tmp_path, monkeypatch):
    """A checkpoint on a store is named by its URI: its run's files (reports, gate) are laid out in
    the store's working copy, and lineage names and versions the object without a local copy."""
    import pytest

    from tasks.core.fs import tree_sha256
    from tasks.core.layout import RunLayout
    from tasks.lineage.emitter import dataset_for_path, file_node

    monkeypatch.setattr(storage, "_STORES", {})
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        uri = "s3://runs/crucible/r1/train/checkpoints/step-000002"
        s3.client.put_object(Bucket="runs", Key="crucible/r1/train/checkpoints/step-000002/a.json", Body=b"{}")
        assert RunLayout.of_checkpoint(uri) == RunLayout(store.local_root / "r1")
        for outside in ("s3://runs/crucible/../x/r1/train/checkpoints/step-1", "s3://other/r1/train/checkpoints/step-1"):
            assert not RunLayout.is_run_checkpoint(outside)
        ds = dataset_for_path(uri, output=True)
        assert (ds.namespace, ds.name) == ("s3://runs", "crucible/r1/train/checkpoints/step-000002")
        assert ds.facets["version"].datasetVersion == tree_sha256(uri, s3.options)
        assert file_node(uri) == "dataset:s3://runs:crucible/r1/train/checkpoints/step-000002"
        assert not list(store.local_root.rglob("*.json"))
        with pytest.raises(ValueError):
            RunLayout.of_checkpoint("s3://runs/crucible/r1/step-000002")


def test_a_store_champion_keeps_its_replay_pool_and_tokenizer(tmp_path, monkeypatch):
    """A champion of an object-store run names its token index and tokenizer by URI: the yardstick's
    "old" part and a continued cycle's replay read them on the store (Path(uri).is_file() is always
    False: they were dropped without a word), still held to their signed hashes."""
    import hashlib
    import json
    from pathlib import Path

    from lm_helpers import tokenizer_artifact
    from tasks.continued.mix import replay_pool, verified_index
    from tasks.core import fs

    monkeypatch.setattr(storage, "_STORES", {})
    tok_file = tokenizer_artifact(tmp_path / "data")["path"]
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        index, body = store.uri("r1/tokens/index.json"), json.dumps({"splits": {}}).encode()
        fs.write_bytes(index, body, s3.options)
        signed = hashlib.sha256(body).hexdigest()
        assert replay_pool(index, signed) == [index] and verified_index(index, signed) == index
        assert replay_pool(index, "0" * 64) == [] and verified_index(index, "0" * 64) is None
        from tasks.deploy.yardstick import champion_tokenizer

        tok = store.uri("r1/tokenizer/tokenizer.json")
        fs.write_bytes(tok, Path(tok_file).read_bytes(), s3.options)
        tags = {"tokenizer": tok, "tokenizer_sha256": fs.sha256(tok_file)}
        assert champion_tokenizer(tags).encode("hello").ids
        assert champion_tokenizer({**tags, "tokenizer_sha256": "0" * 64}) is None
