"""Resumable curate: a run killed with SIGKILL part-way through its jobs, then re-run, gives
byte-identical output to an uninterrupted run, never shows a partial file, and reuses the jobs
that had finished (their parts verified by sha256); a complete output is returned as is."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT, IngestConfig, PipelineConfig, RayConfig, SourceConfig
from tasks.core.documents import write_docs
from tasks.core.resume import JobStore

DATA = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
WEB = DATA / "web"
pytestmark = pytest.mark.skipif(not (WEB / "cc-main-2019-30-sample.jsonl.gz").exists(), reason=f"no data under {DATA}")

RUNNER = """
import json, sys
from pathlib import Path
from tasks.config import PipelineConfig
from tasks.curate import run_curate
cfg = PipelineConfig.model_validate_json(Path(sys.argv[1]).read_text())
shards = json.loads(Path(sys.argv[2]).read_text())
run_curate(cfg, [Path(s) for s in shards], Path(sys.argv[3]))
"""
OUTPUT_FILES = ("dropped.jsonl", "decontam_report.json", "DATASET_CARD.md")


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _output(out: Path) -> dict[str, str]:
    files = sorted(out.glob("shard-*.parquet")) + [out / n for n in OUTPUT_FILES if (out / n).exists()]
    return {p.name: _sha(p) for p in files}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tasks.ingest.process import process_file_range

    root = tmp_path_factory.mktemp("resume")
    path = str(WEB / "cc-main-2019-30-sample.jsonl.gz")
    src = SourceConfig(name="cc_main", uri=path, format="jsonl", licence="cc-tou", provenance="dolma sample")
    docs = process_file_range(src, path, IngestConfig(), 0, 320)["docs"]
    shards = write_docs(docs, root / "in", shard_docs=40)  # 8 one-row-group shards: 8 jobs
    cfg = PipelineConfig(name="resume-test", sources=[src], data_root=str(DATA), ray=RayConfig(num_cpus=1),
                         curate={"shard_docs": 150})
    return root, cfg, [str(s) for s in shards], len(docs)


def _kill_after_parts(stage: str, runner: str, args: list[Path], out: Path, n_done: int) -> int:
    """Run `runner` (a stage writing to `out`) in a subprocess; SIGKILL it once `n_done` job parts
    are in out/_parts. Returns how many parts were done."""
    proc = subprocess.Popen([sys.executable, "-c", runner, *map(str, args), str(out)], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    parts = out / "_parts"
    deadline = time.monotonic() + 240
    try:
        while True:
            done = len(list(parts.glob("*.job.json"))) if parts.is_dir() else 0
            if done >= n_done:
                os.kill(proc.pid, signal.SIGKILL)
                break
            if proc.poll() is not None:
                pytest.fail(f"{stage} finished (rc {proc.returncode}) before it could be killed: "
                            f"{proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {stage} job finished in time")
            time.sleep(0.005)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        return done
    finally:
        try:  # the Ray processes this subprocess started share its session
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        proc.stderr.close()


def _kill_when_jobs_done(root: Path, cfg: PipelineConfig, shards: list[str], out: Path, n_done: int) -> int:
    (root / "cfg.json").write_text(cfg.model_dump_json())
    (root / "shards.json").write_text(json.dumps(shards))
    return _kill_after_parts("curate", RUNNER, [root / "cfg.json", root / "shards.json"], out, n_done)


def test_sigkill_then_resume_is_identical(setup):
    import ray

    from tasks.core.ray_utils import init_ray
    from tasks.curate import run_curate

    root, cfg, shards, n_docs = setup
    out = root / "killed"
    killed_after = _kill_when_jobs_done(root, cfg, shards, out, n_done=3)
    # nothing partial is visible: no manifest, no output shard, only complete parts
    assert not (out / "manifest.json").exists()
    assert not list(out.glob("shard-*.parquet"))
    for p in (out / "_parts").glob("*.parquet"):
        pq.ParquetFile(p).metadata  # a visible part is a complete Parquet file
    assert len(list((out / "_parts").glob("*.job.json"))) >= killed_after

    init_ray(RayConfig(num_cpus=2))
    try:
        resumed = run_curate(cfg, [Path(s) for s in shards], out)
        fresh = run_curate(cfg, [Path(s) for s in shards], root / "fresh")
        again = run_curate(cfg, [Path(s) for s in shards], out)  # complete: verified, nothing redone
    finally:
        ray.shutdown()
    assert 3 <= resumed["resumed_jobs"] < len(shards)
    assert fresh["resumed_jobs"] == 0
    assert _output(out) == _output(root / "fresh")
    assert not list(out.glob(".*")) and not (out / "_parts").exists()
    for k in ("docs_in", "docs_out", "dropped", "languages", "pii", "sources"):
        assert resumed[k] == fresh[k], k
    for k in ("docs_dropped", "items_hit", "index_ngrams"):
        assert resumed["decontam"][k] == fresh["decontam"][k], k
    print("timings killed+resumed / fresh:", resumed["timings"], resumed["seconds"], fresh["timings"], fresh["seconds"])
    assert [{**st, "seconds": 0} for st in resumed["steps"]] == [{**st, "seconds": 0} for st in fresh["steps"]]
    assert resumed["docs_out"] + sum(resumed["dropped"].values()) == resumed["docs_in"] == n_docs
    assert again["resumed_complete"] and again["shards"] == resumed["shards"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert {f["path"]: f["sha256"] for f in manifest["files"]} == _output(out)
    assert sum(f.get("docs", 0) for f in manifest["files"]) == resumed["docs_out"]


def test_damaged_part_is_redone(setup, tmp_path):
    """A finished job whose part no longer matches its sha256 is recomputed, not trusted."""
    import ray

    from tasks.core.ray_utils import init_ray
    from tasks.curate import run_curate
    from tasks.curate import run as curate_run

    root, cfg, shards, _ = setup
    # the jobs are built here as run_curate builds them without line dedup (its keys hold the line counts)
    dedup = cfg.curate.dedup.model_copy(update={"lines": cfg.curate.dedup.lines.model_copy(update={"enabled": False})})
    cfg = cfg.model_copy(update={"curate": cfg.curate.model_copy(update={"decontam": cfg.curate.decontam.model_copy(
        update={"enabled": False}), "dedup": dedup})})
    shards = shards[:3]
    init_ray(RayConfig(num_cpus=1))
    try:
        first = run_curate(cfg, [Path(s) for s in shards], tmp_path / "a")
        # simulate a crash after the map: results and parts exist, no manifest
        out = tmp_path / "b"
        parts = out / "_parts"
        parts.mkdir(parents=True)
        jobs = list(curate_run.plan_jobs(shards, parts, curate_run.job_base_key(cfg, None)))
        worker = curate_run.CurateWorker(cfg.curate, curate_run.source_policies(cfg), None)
        for job in jobs:
            JobStore(parts).save(job.name, job.key, worker.process(*job.args))
        victim = sorted(parts.glob("*.parquet"))[1]
        victim.write_bytes(victim.read_bytes()[:-10] + b"0123456789")
        second = run_curate(cfg, [Path(s) for s in shards], out)
    finally:
        ray.shutdown()
    assert second["resumed_jobs"] == len(jobs) - 1
    assert _output(tmp_path / "a") == _output(out)
    assert second["docs_out"] == first["docs_out"]


# ------------------------------------------------------------------ ingest

INGEST_RUNNER = """
import sys
from pathlib import Path
from tasks.config import PipelineConfig
from tasks.ingest import run_ingest
cfg = PipelineConfig.model_validate_json(Path(sys.argv[1]).read_text())
run_ingest(cfg, Path(sys.argv[2]))
"""
INGEST_FILES = ("quarantine.jsonl",)


@pytest.fixture(scope="module")
def ingest_setup(tmp_path_factory):
    """Ten source files (eight JSONL.gz slices of a real Common Crawl sample, one with a broken
    line, and two copies of a real wget WARC) in two sources: ten ingest jobs."""
    import gzip
    import shutil

    root = tmp_path_factory.mktemp("ingest-resume")
    src_dir = root / "src"
    src_dir.mkdir()
    with gzip.open(WEB / "cc-main-2019-30-sample.jsonl.gz", "rt", encoding="utf-8") as f:
        lines = f.readlines()
    per = len(lines) // 8 + 1
    for i in range(8):
        chunk = lines[i * per:(i + 1) * per]
        if i == 3:
            chunk = chunk[:5] + ['{"id": "broken", "text": \n'] + chunk[5:]
        with gzip.open(src_dir / f"cc-{i:02d}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(chunk)
    for i in range(2):
        shutil.copy(WEB / "wget-sample-0001.warc.gz", src_dir / f"wget-{i}.warc.gz")
    sources = [SourceConfig(name="cc", uri=str(src_dir / "cc-*.jsonl.gz"), format="jsonl", licence="cc-tou",
                            provenance="dolma sample, sliced"),
               SourceConfig(name="wget", uri=f"file://{src_dir}/wget-*.warc.gz", format="warc", licence="apache",
                            provenance="dolma wget sample, copied")]
    cfg = PipelineConfig(name="ingest-resume", sources=sources, data_root=str(DATA), ray=RayConfig(num_cpus=1),
                         ingest={"shard_docs": 200})
    return root, cfg


def _ingest_output(out: Path) -> dict[str, str]:
    files = sorted(out.glob("shard-*.parquet")) + [out / n for n in INGEST_FILES if (out / n).exists()]
    return {p.name: _sha(p) for p in files}


def test_ingest_sigkill_then_resume_is_identical(ingest_setup):
    import ray

    from tasks.core.ray_utils import init_ray
    from tasks.ingest import run_ingest

    root, cfg = ingest_setup
    out = root / "killed"
    (root / "cfg.json").write_text(cfg.model_dump_json())
    _kill_after_parts("ingest", INGEST_RUNNER, [root / "cfg.json"], out, n_done=3)
    # nothing partial is visible
    assert not (out / "manifest.json").exists() and not list(out.glob("shard-*.parquet"))
    assert not (out / "quarantine.jsonl").exists()

    calls: list[tuple[int, int, str]] = []
    init_ray(RayConfig(num_cpus=2))
    try:
        resumed = run_ingest(cfg, out, progress=lambda d, t, n: calls.append((d, t, n)))
        fresh = run_ingest(cfg, root / "fresh")
        again = run_ingest(cfg, out)  # complete: verified, nothing redone
    finally:
        ray.shutdown()
    assert 3 <= resumed["resumed_jobs"] < 10 and fresh["resumed_jobs"] == 0
    assert _ingest_output(out) == _ingest_output(root / "fresh")
    assert not list(out.glob(".*")) and not (out / "_parts").exists()
    for k in ("docs_in", "docs_out", "dropped", "quarantined", "skipped_records", "sources"):
        assert resumed[k] == fresh[k], k
    assert resumed["quarantined"] == {"bad_json": 1}
    assert resumed["dropped"]["duplicate_id"] == resumed["sources"]["wget"]["docs_out"]  # the copy of the WARC
    assert again["resumed_complete"] and again["shards"] == resumed["shards"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert {f["path"]: f["sha256"] for f in manifest["files"]} == _ingest_output(out)
    # progress: counted in source files, monotonic, ends at 10/10
    assert calls[-1][:2] == (10, 10) and all(t == 10 for _, t, _ in calls)
    assert [d for d, _, _ in calls] == sorted(d for d, _, _ in calls)
    assert "resumed" in calls[0][2]


def test_ingest_changed_source_is_reread(ingest_setup, tmp_path):
    """A complete output is reused only while its sources are unchanged (size/mtime in the key)."""
    import gzip
    import shutil

    import ray

    from tasks.core.ray_utils import init_ray
    from tasks.ingest import run_ingest

    root, cfg = ingest_setup
    src = tmp_path / "src"
    src.mkdir()
    for name in ("cc-00.jsonl.gz", "cc-01.jsonl.gz"):
        shutil.copy(root / "src" / name, src / name)
    cfg = cfg.model_copy(update={"sources": [cfg.sources[0].model_copy(update={"uri": str(src / "cc-*.jsonl.gz")})]})
    out = tmp_path / "out"
    init_ray(RayConfig(num_cpus=1))
    try:
        first = run_ingest(cfg, out)
        assert run_ingest(cfg, out).get("resumed_complete")
        with gzip.open(src / "cc-01.jsonl.gz", "at", encoding="utf-8") as f:
            f.write(json.dumps({"id": "new-doc", "text": "A document added to the source after the first run."}) + "\n")
        second = run_ingest(cfg, out)
    finally:
        ray.shutdown()
    assert not second.get("resumed_complete")
    assert second["docs_in"] == first["docs_in"] + 1 and second["docs_out"] == first["docs_out"] + 1


def test_job_runner_lists_the_parts_folder_once_and_removes_only_each_jobs_leftovers(tmp_path, monkeypatch):
    """A job that is not reused loses the part files a killed attempt left (`<name>-*.parquet`), and
    only those: the folder is listed once for all jobs (a glob per job costs jobs x files on a
    large run), a name that extends another job's (`j1` vs `j10`) keeps its files."""
    from tasks.core.executor import Job, JobRunner
    from tasks.core.resume import JobStore

    store = JobStore(tmp_path)
    names = ["j1-0.parquet", "j1-1.parquet", "j10-0.parquet", "j2-0.parquet", "j2.job.json", "other.parquet"]
    for n in names:
        (tmp_path / n).write_text("x")
    listed = []
    real_iterdir = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: listed.append(self) or real_iterdir(self))
    monkeypatch.setattr(Path, "glob", lambda self, pattern: pytest.fail("a glob per job"))
    runner = JobRunner(workers=None, store=store)
    for name in ("j1", "j3"):
        assert runner.submit(Job(name, "key", ())) is None
    assert listed == [tmp_path]
    assert sorted(p.name for p in real_iterdir(tmp_path)) == ["j10-0.parquet", "j2-0.parquet", "j2.job.json",
                                                              "other.parquet"]
