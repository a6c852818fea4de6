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
"""
from __future__ import annotations

import glob
import math
import os
import re
import shutil
import time
from collections import Counter
from pathlib import Path

from tasks.config import PipelineConfig, SourceConfig
from tasks.core.documents import AtomicJsonlWriter, ShardWriter, iter_docs
from tasks.core.ray_utils import cluster_cpus, init_ray
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
    uri = cfg.resolve_uri(source.uri)
    if re.match(r"^[a-z][a-z0-9+.\-]*://", uri):
        raise ValueError(f"source {source.name}: remote URI {uri!r} is not supported yet (local paths only)")
    files = sorted(str(Path(p).resolve()) for p in glob.glob(uri) if os.path.isfile(p))
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


def run_ingest(cfg: PipelineConfig, out_dir: Path) -> dict:
    """Read all sources of `cfg`, write `out_dir/shard-*.parquet` and `out_dir/quarantine.jsonl`,
    return the JSON-serialisable summary (see module docstring)."""
    import ray

    t0 = time.perf_counter()
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("shard-*.parquet"):
        stale.unlink()
    parts_dir = out_dir / "_parts"
    shutil.rmtree(parts_dir, ignore_errors=True)
    parts_dir.mkdir()

    plan = [(source, resolve_source_files(cfg, source)) for source in cfg.sources]
    init_ray(cfg.ray)
    workers = cluster_cpus()
    fn = _remote()

    def submit(si: int, fi: int, start: int, stop: int | None):
        source, files = plan[si]
        name = f"{si:03d}-{fi:05d}-{start:010d}"
        return fn.remote(source, files[fi], cfg.ingest, start, stop, str(parts_dir), name)

    results: dict[tuple[int, int, int], dict] = {}
    pending = {}
    for si, (source, files) in enumerate(plan):
        if source.max_docs is None:
            for fi in range(len(files)):
                pending[submit(si, fi, 0, None)] = (si, fi, 0)
    capped = [_CappedSource(si, s, f, workers) for si, (s, f) in enumerate(plan) if s.max_docs is not None]
    waves: dict[int, list] = {}  # capped source index -> refs of its current wave

    def submit_wave(c: _CappedSource) -> None:
        waves[c.si] = []
        for w in c.next_wave():
            ref = submit(*w)
            waves[c.si].append(ref)
            pending[ref] = w[:3]

    for c in capped:
        submit_wave(c)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            results[pending.pop(ref)] = ray.get(ref)
        for c in capped:
            refs = waves.get(c.si)
            if refs and all(r not in pending for r in refs):
                c.wave_done([results[k] for k in sorted(k for k in results if k[:2] == (c.si, c.fi))])
                submit_wave(c)

    summary = _merge(cfg, plan, results, out_dir, parts_dir)
    shutil.rmtree(parts_dir, ignore_errors=True)
    summary["workers"] = workers
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary


def _merge(cfg: PipelineConfig, plan, results: dict, out_dir: Path, parts_dir: Path) -> dict:
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
            for p in parts_dir.glob(f"{si:03d}-*"):
                p.unlink()
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
