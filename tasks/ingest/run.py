"""`run_ingest`: every registered source → sharded Parquet documents + a quarantine file.

Work is split into Ray tasks (`process.process_file_range`), one per source file. A source
with `max_docs` is read file by file (sorted glob order) and each of its files is split into
one record range per worker, so a small cap still uses every CPU and no record past the cap
is read. Each task writes its documents to a part file; the driver then concatenates the parts
in (source, file, record) order into `shard-00000.parquet`, ... of `ingest.shard_docs` rows.
The output is therefore the same whatever the number of workers.

Counting (`docs_in == docs_out + sum(dropped) + sum(quarantined)`): `docs_in` is the number of
candidate records read (WARC responses, WET conversions, JSONL lines, text files, Parquet
rows, plus one per unreadable span that was quarantined: an empty file, a broken gzip tail).
Records of other WARC types are not candidates; they are counted in `skipped_records`.
A document id seen before (same source and record key) is dropped as "duplicate_id".

Sources are read by URI (`tasks.ingest.fs`: local paths and globs, file://, http(s)://, s3://
with the `s3` extra), streaming.

Resumable (`tasks.core.resume`, the machinery curate uses): each job's result is stored in
`_parts/<job>.pkl` with the sha256 of its part file and a key (ingest config, source entry, the
file's size and change stamp, the record range); a re-run reuses every job whose key matches
and whose part verifies, and reads only the other source files. The merged shards and
`quarantine.jsonl` are written atomically, then `manifest.json` (sha256 per file, the run key,
the summary) last; a re-run whose manifest verifies returns the stored summary at once. A run
killed at any point (SIGKILL included) re-runs to byte-identical output. `ingest.resume:
false` redoes everything.
"""
from __future__ import annotations

import math
import shutil
import time
from collections import Counter
from pathlib import Path

from tasks.config import IngestConfig, PipelineConfig, SourceConfig
from tasks.core.documents import AtomicJsonlWriter, ShardWriter, iter_docs
from tasks.core.progress import Progress
from tasks.core.ray_utils import cluster_cpus, init_ray
from tasks.core.resume import MANIFEST, JobStore, digest, remove_temp_files, verify_manifest, write_manifest
from tasks.ingest.fs import expand_uri, file_identity
from tasks.core.steps import StepStats
from tasks.ingest.process import process_file_range

_remote_fn = None


def _remote():
    global _remote_fn
    if _remote_fn is None:
        import ray

        _remote_fn = ray.remote(num_cpus=1)(process_file_range)
    return _remote_fn


def resolve_source_files(cfg: PipelineConfig, source: SourceConfig) -> list[str]:
    """The files of `source` (sorted), by URI: local paths/globs, file://, http(s)://, s3://."""
    uri = cfg.resolve_uri(source.uri)
    files = expand_uri(uri, source.storage_options)
    if not files:
        raise FileNotFoundError(f"source {source.name}: no files match {uri!r}")
    return files


class _CappedSource:
    """Read one capped source file by file, each file split into ranges across workers."""

    def __init__(self, si: int, source: SourceConfig, files: list[str], workers: int):
        self.si, self.source, self.files, self.workers = si, source, files, workers
        self.remaining = source.max_docs
        self.fi = 0

    def next_wave(self) -> list[tuple[int, int, int, int]]:
        if self.remaining <= 0 or self.fi >= len(self.files):
            return []
        size = max(1, math.ceil(self.remaining / self.workers))
        return [(self.si, self.fi, s, min(s + size, self.remaining))
                for s in range(0, self.remaining, size)]

    def wave_done(self, results: list[dict]) -> None:
        consumed = sum(r["consumed"] for r in results)
        self.remaining -= consumed
        self.fi += 1  # either the file ended or the cap is reached


def _config_key(cfg: PipelineConfig) -> str:
    """What every ingest job depends on besides its source and file: the ingest config
    (re-validated, so a default `3` and a loaded `3.0` agree; `resume` excluded)."""
    return digest(IngestConfig.model_validate(cfg.ingest.model_dump()).model_dump(exclude={"resume"}))


def run_ingest(cfg: PipelineConfig, out_dir: Path, progress: Progress | None = None) -> dict:
    """Read all sources of `cfg`, write `out_dir/shard-*.parquet` and `out_dir/quarantine.jsonl`,
    return the JSON-serialisable summary (see module docstring). `progress(done, total, note)`,
    if given, is called as source files are finished (resumed ones included)."""
    import ray

    t0 = time.perf_counter()
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    parts_dir = out_dir / "_parts"
    resume = cfg.ingest.resume

    plan = [(source, resolve_source_files(cfg, source)) for source in cfg.sources]
    idents = {f: file_identity(f, source.storage_options) for source, files in plan for f in files}
    base = _config_key(cfg)
    run_key = digest([base, [[s.model_dump(), [idents[f] for f in files]] for s, files in plan]])
    if resume:
        m = verify_manifest(out_dir, run_key)
        if m is not None:
            n_files = sum(len(f) for _, f in plan)
            if progress:
                progress(n_files, n_files, "ingest: complete output verified, nothing to do")
            return {**m["summary"], "resumed_jobs": m["summary"].get("jobs", 0), "resumed_complete": True,
                    "seconds": round(time.perf_counter() - t0, 3)}
    # from here on the old output is invalid: manifest first, so a kill never leaves a stale one
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for stale in out_dir.glob("shard-*.parquet"):
        stale.unlink()
    remove_temp_files(out_dir)
    if not resume:
        shutil.rmtree(parts_dir, ignore_errors=True)
    parts_dir.mkdir(exist_ok=True)
    remove_temp_files(parts_dir)
    store = JobStore(parts_dir)

    init_ray(cfg.ray)
    workers = cluster_cpus()
    fn = _remote()
    results: dict[tuple[int, int, int], dict] = {}
    job_names: dict[tuple[int, int, int], tuple[str, str]] = {}
    pending: dict = {}
    files_done: set[tuple[int, int]] = set()
    n_files = sum(len(files) for _, files in plan)
    resumed = 0
    report = progress or (lambda done, total, note: None)

    def launch(si: int, fi: int, start: int, stop: int | None) -> None:
        nonlocal resumed
        source, files = plan[si]
        name = f"{si:03d}-{fi:05d}-{start:010d}"
        key = digest([base, source.model_dump(), idents[files[fi]], start, stop])
        job_names[(si, fi, start)] = (name, key)
        stored = store.load(name, key) if resume else None
        if stored is not None:
            results[(si, fi, start)] = stored
            resumed += 1
            return
        for p in parts_dir.glob(f"{name}-*.parquet"):  # a part left by a killed attempt
            p.unlink()
        pending[fn.remote(source, files[fi], cfg.ingest, start, stop, str(parts_dir), name)] = (si, fi, start)

    capped = [_CappedSource(si, s, f, workers) for si, (s, f) in enumerate(plan) if s.max_docs is not None]
    waves: dict[int, list[tuple[int, int, int]]] = {}  # capped source index -> jobs of its current wave

    def start_wave(c: _CappedSource) -> None:
        wave = c.next_wave()
        waves[c.si] = [w[:3] for w in wave]
        if not wave:  # cap reached or no file left: the source's other files are not read
            files_done.update((c.si, fi) for fi in range(len(c.files)))
        for w in wave:
            launch(*w)

    def advance() -> None:
        """Finish the uncapped files and the capped waves whose jobs all have results."""
        moved = True
        while moved:
            moved = False
            for c in capped:
                wave = waves.get(c.si)
                if wave and all(j in results for j in wave):
                    files_done.add((c.si, c.fi))
                    c.wave_done([results[j] for j in wave])
                    start_wave(c)
                    moved = True
        files_done.update(k[:2] for k in results if plan[k[0]][0].max_docs is None)
        report(len(files_done), n_files, f"ingest ({resumed} jobs resumed)" if resumed else "ingest")

    for si, (source, files) in enumerate(plan):
        if source.max_docs is None:
            for fi in range(len(files)):
                launch(si, fi, 0, None)
    for c in capped:
        start_wave(c)
    advance()
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            job = pending.pop(ref)
            res = ray.get(ref)
            store.save(*job_names[job], res)
            results[job] = res
        advance()

    summary = _merge(cfg, plan, results, out_dir)
    summary["jobs"] = len(results)
    summary["workers"] = workers
    write_manifest(out_dir, run_key, summary, summary["shards"], ["quarantine.jsonl"])
    summary["manifest"] = str(out_dir / MANIFEST)
    shutil.rmtree(parts_dir, ignore_errors=True)
    summary["resumed_jobs"] = resumed
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary


def _merge(cfg: PipelineConfig, plan, results: dict, out_dir: Path) -> dict:
    total = StepStats("ingest")
    skipped: Counter = Counter()
    per_source: dict[str, dict] = {}
    seen_ids: set[bytes] = set()
    quarantine_path = out_dir / "quarantine.jsonl"
    with ShardWriter(out_dir, prefix="shard", shard_docs=cfg.ingest.shard_docs) as writer, \
            AtomicJsonlWriter(quarantine_path) as qwriter:
        for si, (source, files) in enumerate(plan):
            st = StepStats(source.name)
            src_skipped: Counter = Counter()
            read_files: list[str] = []
            for key in sorted(k for k in results if k[0] == si):
                r = results[key]
                if r["docs_in"] or r["skipped"]:
                    if r["file"] not in read_files:
                        read_files.append(r["file"])
                st.docs_in += r["docs_in"]
                st.bytes_in += r["bytes_in"]
                st.dropped.update(r["dropped"])
                st.quarantined.update(r["quarantined"])
                src_skipped.update(r["skipped"])
                for entry in r["quarantine"]:
                    qwriter.write(entry)
                for doc in iter_docs(r["parts"]):
                    digest = bytes.fromhex(doc["id"].replace("-", ""))
                    if digest in seen_ids:
                        st.dropped["duplicate_id"] += 1
                        continue
                    seen_ids.add(digest)
                    writer.write(doc)
                    st.docs_out += 1
                    st.bytes_out += len(doc["text"].encode("utf-8"))
            per_source[source.name] = {
                "files": read_files, "licence": source.licence, "provenance": source.provenance,
                "docs_in": st.docs_in, "docs_out": st.docs_out,
                "dropped": dict(sorted(st.dropped.items())),
                "quarantined": dict(sorted(st.quarantined.items())),
                "skipped_records": dict(sorted(src_skipped.items())),
            }
            total.merge(st)
            skipped.update(src_skipped)
    assert total.balanced(), total.to_dict()
    return {
        "docs_in": total.docs_in,
        "docs_out": total.docs_out,
        "bytes_in": total.bytes_in,
        "bytes_out": total.bytes_out,
        "dropped": dict(sorted(total.dropped.items())),
        "quarantined": dict(sorted(total.quarantined.items())),
        "skipped_records": dict(sorted(skipped.items())),
        "shards": [str(p) for p in writer.paths],
        "quarantine_file": str(quarantine_path),
        "sources": per_source,
    }
