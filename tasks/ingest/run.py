"""`run_ingest`: every registered source → sharded Parquet documents + a quarantine file.

Work is split into Ray tasks (`process.process_file_range`), one per source file. A source
with `max_docs` is read file by file (sorted glob order) and each of its files is split into
one record range per worker, so a small cap still uses every CPU and no record past the cap
is read. Each task writes everything per document to files (issue 26: the driver schedules and
merges counters, it never reads a document nor holds a list per document): its documents to part
files of at most `ingest.shard_docs` rows, its quarantine entries to a JSONL part, its documents'
id digests to `ingest.id_partitions` files by id hash. Then, on Ray (`tasks.ingest.ids`): a task
per id partition finds the ids seen earlier in (source, file, record) order (the first occurrence
is kept, the others dropped as "duplicate_id"). The output shards `shard-00000.parquet`, ... are
the jobs' parts in (source, file, record) order without the duplicates, consecutive parts packed
while they fit `ingest.shard_docs` rows (a corpus of small files still gives full shards, so curate
does not run a job per file): a shard that is one whole part is linked into place (no copy), the
others (parts that lost duplicates, runs of small parts) are written by a Ray task each. The
driver's own work is therefore per job and per shard, never per document: no pass over the corpus
besides the manifest's sha256. `quarantine.jsonl` is the jobs' quarantine parts concatenated. The
documents, their order and the counts are the same whatever the number of workers; the shards are
not where a source is capped: its files are read in one record range per worker, each range's parts
end where the range ends, so the shard boundaries (and the shard files) depend on the worker count.
Without capped sources the shards do not depend on it either. Each shard has at most
`ingest.shard_docs` rows.

Counting (`docs_in == docs_out + sum(dropped) + sum(quarantined)`): `docs_in` is the number of
candidate records read (WARC responses, WET conversions, JSONL lines, text files, Parquet
rows, plus one per unreadable span that was quarantined: an empty file, a broken gzip member).
Records of other WARC types are not candidates; they are counted in `skipped_records`.
Bytes that could not be read at all (a corrupt gzip/zstd member skipped up to the next one that
decodes, the rest of a decompression bomb) are counted too: `bytes_unread` (total), `files_unread`
and each source's `bytes_unread` ({file: bytes}); each span's file offsets are in its quarantine
entry's `unread_range`.
A document id seen before (same source and record key) is dropped as "duplicate_id".

Sources are read by URI (`tasks.core.fs`: local paths and globs, file://, http(s)://, s3://
with the `s3` extra), streaming.

Resumable (`tasks.core.executor` and `tasks.core.resume`, the machinery curate uses): each job's result is stored in
`_parts/<job>.job.json` with the sha256 of its part file and a key (ingest config, source entry, the
file's size and change stamp, the record range); a re-run reuses every job whose key matches
and whose parts verify, and reads only the other source files; the duplicate-id tasks run
again from the jobs' files. The shards and `quarantine.jsonl` are written atomically, then `manifest.json` (sha256 per file, the run key,
the summary, which lists the jobs each Ray node ran: `nodes`) last; a re-run whose manifest verifies returns the stored summary at once. A run
killed at any point (SIGKILL included) and re-run with the same worker count gives byte-identical
output; re-run with another worker count, the same documents in the same order (and byte-identical
shards unless a source is capped, see above). `ingest.resume: false` redoes everything.
"""
from __future__ import annotations

import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tasks.config import IngestConfig, PipelineConfig, SourceConfig
from tasks.core.executor import Job, JobRunner, RayTasks, ResumableOutput, start_ray
from tasks.core.progress import Progress
from tasks.core.resume import MANIFEST, digest
from tasks.core.steps import StepStats
from tasks.core.fs import (StorageError, copy_checked, expand_uri, file_identity, is_remote, join, link_or_copy,
                           name_of, remove, remove_stale_shards, remove_tree)
from tasks.dedup.stages import concat_files
from tasks.ingest.ids import resolve_partition, write_shard
from tasks.ingest.process import process_file_range

QUARANTINE = "quarantine.jsonl"


def resolve_source_files(cfg: PipelineConfig, source: SourceConfig) -> list[str]:
    """The files of `source` (sorted), by URI: local paths/globs, file://, http(s)://, s3://; or
    exactly `source.files` when set (a continued-pretraining cycle's new files)."""
    uri = cfg.resolve_uri(source.uri)
    if source.files is not None:
        return sorted(source.files)
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


def _config_key(ingest: IngestConfig) -> str:
    """What every ingest job depends on besides its source and file: the ingest config
    (re-validated, so a default `3` and a loaded `3.0` agree; `resume` excluded)."""
    return digest(IngestConfig.model_validate(ingest.model_dump()).model_dump(exclude={"resume"}))


MIN_DOC_SOURCE_BYTES = 200  # assumed least source bytes per document (`IngestConfig.id_partition_bytes`)


def id_partitions(ingest: IngestConfig, sources: list[tuple[SourceConfig, int]]) -> int:
    """`ingest.id_partitions`, or where it is 0 one per `ingest.id_partition_bytes` of the sources
    ([(source, its files' bytes)]; a capped source counts at most MIN_DOC_SOURCE_BYTES per document
    of its cap), at most 65535: a duplicate-id task's partition grows with this bound, not the corpus."""
    if ingest.id_partitions:
        return ingest.id_partitions
    total = sum(n if s.max_docs is None else min(n, s.max_docs * MIN_DOC_SOURCE_BYTES) for s, n in sources)
    return min(65535, max(1, -(-total // ingest.id_partition_bytes)))


@dataclass
class _Plan:
    """The sources with their files, each file's identity, the ingest config the jobs run with (its
    `id_partitions` resolved from the files' sizes) and the keys of the run."""
    sources: list[tuple[SourceConfig, list[str]]]
    idents: dict[str, list]
    ingest: IngestConfig
    base: str  # `_config_key`
    run_key: str

    @classmethod
    def of(cls, cfg: PipelineConfig) -> "_Plan":
        sources = [(source, resolve_source_files(cfg, source)) for source in cfg.sources]
        idents = {f: file_identity(f, source.storage_options) for source, files in sources for f in files}
        sizes = [(s, sum(int(idents[f][1] or 0) for f in files)) for s, files in sources]  # unknown (http): 0
        ingest = cfg.ingest.model_copy(update={"id_partitions": id_partitions(cfg.ingest, sizes)})
        base = _config_key(ingest)  # the resolved count: a job's id files are spilled with it
        run_key = digest([base, [[s.model_dump(), [idents[f] for f in files]] for s, files in sources]])
        return cls(sources, idents, ingest, base, run_key)

    @property
    def n_files(self) -> int:
        return sum(len(files) for _, files in self.sources)


def run_ingest(cfg: PipelineConfig, out_dir: Path, progress: Progress | None = None) -> dict:
    """Read all sources of `cfg`, write `out_dir/shard-*.parquet` and `out_dir/quarantine.jsonl`,
    return the JSON-serialisable summary (see module docstring). `progress(done, total, note)`,
    if given, is called as source files are finished (resumed ones included)."""
    t0 = time.perf_counter()
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)  # before planning: a failed plan leaves it empty
    plan = _Plan.of(cfg)
    output = ResumableOutput(out_dir, plan.run_key, [QUARANTINE])
    if cfg.ingest.resume and (done := output.completed(t0)) is not None:
        if progress:
            progress(plan.n_files, plan.n_files, "ingest: complete output verified, nothing to do")
        return done
    workers = start_ray(cfg.ray)  # first: an unreachable ray.address fails before the old output is touched
    store = output.start(cfg.ingest.resume)
    with JobRunner(RayTasks(process_file_range, cfg.ray), store) as runner:
        jobs = _IngestJobs(cfg, plan, output.parts_dir, workers, runner, progress)
        results = jobs.run()

    t_merge = time.perf_counter()
    # every part is held to the sha256 its job reported (store.part_sha256) on the read that merges it
    summary = _merge(plan, results, jobs.tallies, output.dir, output.parts_dir, store.part_sha256)
    summary["jobs"] = len(results)
    summary["workers"] = workers
    summary["nodes"] = runner.node_report()  # jobs run per Ray node (resumed ones not included)
    summary["jobs_rerun"] = runner.rerun
    output.publish(summary)
    summary["manifest"] = str(output.manifest)
    summary["resumed_jobs"] = runner.resumed
    # compute vs wall of the jobs, result bytes; the duplicate ids, shards and manifest after them
    summary["timings"] = {"jobs": runner.job_report(), "merge_s": round(time.perf_counter() - t_merge, 3)}
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary


class _IngestJobs:
    """The jobs of one run: one per file of an uncapped source; for a capped source, waves of
    record ranges of one file at a time, the next wave planned from the previous one's results."""

    def __init__(self, cfg: PipelineConfig, plan: _Plan, parts_dir: Path, workers: int, runner: JobRunner,
                 progress: Progress | None):
        self.cfg, self.plan, self.parts_dir, self.runner = cfg, plan, parts_dir, runner
        self.report = progress or (lambda done, total, note: None)
        # (source, file, start) -> what the merge needs of the job (`_kept`); its counters are folded
        # into its source's tally as it arrives
        self.results: dict[tuple[int, int, int], dict] = {}
        self.tallies = [_SourceTally(source.name) for source, _ in plan.sources]
        self.slots: dict[str, tuple[int, int, int]] = {}  # job name -> (source, file, start)
        self.files_done: set[tuple[int, int]] = set()
        self.capped = [_CappedSource(si, s, f, workers) for si, (s, f) in enumerate(plan.sources)
                       if s.max_docs is not None]
        self.waves: dict[int, list[tuple[int, int, int]]] = {}  # capped source -> jobs of its current wave

    def run(self) -> dict[tuple[int, int, int], dict]:
        for si, (source, files) in enumerate(self.plan.sources):
            if source.max_docs is None:
                for fi in range(len(files)):
                    self.launch(si, fi, 0, None)
        for c in self.capped:
            self.start_wave(c)
        self.advance()
        for job, result in self.runner.finished():
            self.record(self.slots[job.name], result)
            self.advance()
        return self.results

    def launch(self, si: int, fi: int, start: int, stop: int | None) -> None:
        source, files = self.plan.sources[si]
        name = job_name(si, fi, start)
        key = digest([self.plan.base, source.model_dump(), self.plan.idents[files[fi]], start, stop])
        self.slots[name] = (si, fi, start)
        stored = self.runner.submit(Job(name, key, (source, files[fi], self.plan.ingest, start, stop,
                                                    str(self.parts_dir), name)))
        if stored is not None:
            self.record((si, fi, start), stored)

    def record(self, key: tuple[int, int, int], result: dict) -> None:
        self.tallies[key[0]].add(key, result)
        self.results[key] = {k: result[k] for k in _KEPT}

    def start_wave(self, c: _CappedSource) -> None:
        wave = c.next_wave()
        self.waves[c.si] = [w[:3] for w in wave]
        if not wave:  # cap reached or no file left: the source's other files are not read
            self.files_done.update((c.si, fi) for fi in range(len(c.files)))
        for w in wave:
            self.launch(*w)

    def advance(self) -> None:
        """Finish the uncapped files and the capped waves whose jobs all have results."""
        moved = True
        while moved:
            moved = False
            for c in self.capped:
                wave = self.waves.get(c.si)
                if wave and all(j in self.results for j in wave):
                    self.files_done.add((c.si, c.fi))
                    c.wave_done([self.results[j] for j in wave])
                    self.start_wave(c)
                    moved = True
        self.files_done.update(k[:2] for k in self.results if self.plan.sources[k[0]][0].max_docs is None)
        resumed = self.runner.resumed
        note = f"ingest ({resumed} jobs resumed)" if resumed else "ingest"
        self.report(len(self.files_done), self.plan.n_files, note)


def job_name(si: int, fi: int, start: int) -> str:
    """A job's name (and the prefix of its files): sorts as (source, file, first record)."""
    return f"{si:03d}-{fi:05d}-{start:010d}"


_KEPT = ("docs_out", "consumed", "shards", "ids", "quarantine_file")  # of a job's result, until the merge


class _SourceTally:
    """One source's counters, its jobs' results folded in as they arrive (any order)."""

    def __init__(self, name: str):
        self.stats = StepStats(name)
        self.skipped: Counter = Counter()
        self.unread: Counter = Counter()  # file -> bytes skipped over damage (see readers)
        self.files: dict[str, tuple] = {}  # file read -> its first job's key: the files in corpus order

    def add(self, key: tuple[int, int, int], r: dict) -> None:
        st = self.stats
        if r["docs_in"] or r["skipped"]:
            self.files[r["file"]] = min(self.files.get(r["file"], key), key)
        st.docs_in += r["docs_in"]
        st.bytes_in += r["bytes_in"]
        st.docs_out += r["docs_out"]
        st.bytes_out += r["bytes_out"]
        st.dropped.update(r["dropped"])
        st.quarantined.update(r["quarantined"])
        self.skipped.update(r["skipped"])
        if r.get("bytes_unread"):
            self.unread[r["file"]] += r["bytes_unread"]


def _merge(plan: _Plan, results: dict, tallies: list[_SourceTally], out_dir: Path, parts_dir: Path,
           expect: dict[str, str]) -> dict:
    """The sources' counters less the duplicate ids dropped (`tasks.ingest.ids`), the jobs' part
    files as the shards in corpus order, their quarantine parts concatenated (parts read here are
    held to `expect`, {part: sha256} as their jobs reported)."""
    order = sorted(results)  # (source, file, start): the corpus order
    names = [job_name(*k) for k in order]
    ids = _DuplicateIds(plan.ingest, parts_dir, expect)
    drops = ids.resolve([results[k] for k in order], names)
    shards = ids.shards([results[k] for k in order], names, out_dir)
    quarantine_path = out_dir / QUARANTINE
    concat_files([results[k]["quarantine_file"] for k in order], quarantine_path, expect)
    total = StepStats("ingest")
    skipped: Counter = Counter()
    files_unread: Counter = Counter()
    per_source: dict[str, dict] = {}
    for key, name in zip(order, names):
        st = tallies[key[0]].stats
        n_dup = sum(d[0] for d in drops.get(name, {}).values())
        if n_dup:
            st.dropped["duplicate_id"] += n_dup
        st.docs_out -= n_dup
        st.bytes_out -= sum(d[1] for d in drops.get(name, {}).values())
    for (source, _), tally in zip(plan.sources, tallies):
        st = tally.stats
        per_source[source.name] = {
            "files": sorted(tally.files, key=tally.files.__getitem__), "licence": source.licence,
            "provenance": source.provenance, "docs_in": st.docs_in, "docs_out": st.docs_out,
            "dropped": dict(sorted(st.dropped.items())),
            "quarantined": dict(sorted(st.quarantined.items())),
            "skipped_records": dict(sorted(tally.skipped.items())),
            "bytes_unread": dict(sorted(tally.unread.items())),
        }
        total.merge(st)
        skipped.update(tally.skipped)
        files_unread.update(tally.unread)
    assert total.balanced(), total.to_dict()
    return {
        **total.counts(),
        "skipped_records": dict(sorted(skipped.items())),
        "bytes_unread": sum(files_unread.values()),
        "files_unread": dict(sorted(files_unread.items())),
        "shards": shards,
        "shards_written": ids.rewritten,  # by a Ray task: parts that lost duplicates, runs of small parts
        "quarantine_file": str(quarantine_path),
        "sources": per_source,
    }


ID_DROPS = "_id_drops"  # under `_parts`: the duplicate ids' rows, per job and partition


class _DuplicateIds:
    """The Ray tasks of `tasks.ingest.ids` over the jobs' files, and the shards they leave. Holds
    counters per job and part file that lost documents, never a list per document."""

    def __init__(self, ingest: IngestConfig, parts_dir: Path, expect: dict[str, str]):
        from tasks.core.executor import for_any_node

        self.ingest, self.parts_dir = ingest, parts_dir
        self.expect = expect  # {part: sha256} as the jobs reported: the tasks hold each part they read to it
        # where tasks on any node read the jobs' files and keep the drops (the store's prefix, when
        # the cluster's nodes do not share this working copy)
        (self.root,), self.options = for_any_node([str(parts_dir)])
        self.drop_root = str(join(self.root, ID_DROPS))
        remove_tree(self.drop_root, self.options)  # what a killed run left
        self.drops: dict[str, dict[int, list[int]]] = {}  # job -> part index -> [drops, bytes]
        self.partitions: dict[str, list[int]] = {}  # job -> the id partitions that dropped some of its rows
        self.rewritten = 0  # shards written by a task (the others are parts linked into place)
        self._expect_at: dict[str, str] | None = None  # `expect` by the paths the tasks read

    def _at(self, path: str) -> str:
        """A file under `_parts` as the tasks read it."""
        return str(join(self.root, *Path(path).relative_to(self.parts_dir).parts))

    def _expected(self, read) -> dict[str, str]:
        """{file as a task reads it: sha256 its job reported} for the files `read` (as `_at` names them)
        that lie on the store, where the object may have been replaced since its job wrote it. A local
        part is read as before, by column and streamed: checking it means reading it whole, in memory."""
        if self._expect_at is None:
            self._expect_at = {self._at(p): sha for p, sha in self.expect.items()}
        return {f: self._expect_at[f] for f in read if f in self._expect_at and is_remote(f)}

    def resolve(self, results: list[dict], names: list[str]) -> dict[str, dict[int, list[int]]]:
        """A Ray task per id partition (`ids.resolve_partition`); {job: {part index: [drops, bytes]}}
        for the jobs that lost documents."""
        import ray

        from tasks.core.executor import TASK_RETRIES

        by_partition: list[dict[str, list[str]]] = [{} for _ in range(self.ingest.id_partitions)]
        for r, name in zip(results, names):
            for f in r["ids"]:  # <job>-ids/p-XXXXX/s-<chunk>.parquet, sorted
                by_partition[int(Path(f).parent.name[2:])].setdefault(name, []).append(self._at(f))
        # all submitted at once: Ray runs as many as the cluster has CPUs (num_cpus=1), the rest wait
        # in its queue, so at most one partition per CPU is in memory
        task = ray.remote(num_cpus=1, max_retries=TASK_RETRIES)(resolve_partition)
        todo = [k for k, jobs in enumerate(by_partition) if jobs]
        got = ray.get([task.remote(list(by_partition[k].items()), k, self.ingest.shard_docs, self.drop_root,
                                   self.options, self._expected(f for jobs in by_partition[k].values() for f in jobs))
                       for k in todo])
        for k, g in zip(todo, got):
            for name, per_part in g.items():
                self.partitions.setdefault(name, []).append(k)
                for p, n, nbytes in per_part:
                    d = self.drops.setdefault(name, {}).setdefault(p, [0, 0])
                    d[0] += n
                    d[1] += nbytes
        return self.drops

    def shards(self, results: list[dict], names: list[str], out_dir: Path) -> list[str]:
        """`shard-00000.parquet`, ...: the jobs' part files in corpus order without their duplicates,
        consecutive parts packed while they fit `ingest.shard_docs` rows (a corpus of small files
        does not give one shard, and one curate job, per file). A shard that is one whole part is
        linked into place (no copy); the others are written by a Ray task each (`ids.write_shard`)."""
        import ray

        from tasks.core.executor import TASK_RETRIES, task_location

        shard_docs = self.ingest.shard_docs
        groups: list[list] = []  # per shard: [rows, [(part, its index in the job, the job's drop files)]]
        for r, name in zip(results, names):
            lost = self.drops.get(name, {})
            drop_files = [str(join(self.drop_root, name, f"p-{k:05d}.parquet")) for k in self.partitions.get(name, [])]
            for p, part in enumerate(r["shards"]):
                n_drop = lost.get(p, [0, 0])[0]
                rows = min(shard_docs, r["docs_out"] - p * shard_docs) - n_drop
                if not rows:
                    continue  # every document of the part was a duplicate
                entry = (part, p, drop_files if n_drop else [])
                if groups and groups[-1][0] + rows <= shard_docs:
                    groups[-1][0] += rows
                    groups[-1][1].append(entry)
                else:
                    groups.append([rows, [entry]])
        shards = [str(out_dir / f"shard-{i:05d}.parquet") for i in range(len(groups))]
        writes = []
        for i, (_, entries) in enumerate(groups):
            if len(entries) == 1 and not entries[0][2]:
                _link(Path(entries[0][0]), Path(shards[i]), self.expect)
            else:
                writes.append((i, [(self._at(part), p, files) for part, p, files in entries]))
        out_root, out_options = task_location(out_dir)
        if is_remote(out_root):  # the store's manifest first: it no longer describes the shards there
            remove(join(out_root, MANIFEST), out_options)
        if writes:
            task = ray.remote(num_cpus=1, max_retries=TASK_RETRIES)(write_shard)
            got = ray.get([task.remote(entries, i, shard_docs, str(out_root), self.options, out_options,
                                       self._expected(e[0] for e in entries)) for i, entries in writes])
            if is_remote(out_root):  # written on the store by the tasks: into the working copy too
                from tasks.core.storage import store_of_path

                store = store_of_path(out_dir)
                store.pull("", keys=[store.rel(out_dir / name_of(p)) for p in got])
        if is_remote(out_root):  # a killed earlier run's extra shards there, which no push would remove
            remove_stale_shards(out_root, [name_of(p) for p in shards], out_options)
        remove_tree(self.drop_root, self.options)  # a store's copy too (`_parts` goes with the manifest)
        self.rewritten = len(writes)
        return shards


def _link(part: Path, target: Path, expect: dict[str, str] | None = None) -> None:
    """`target` (atomically) as the same file as `part`: a hard link, a copy where links fail; a
    part a job on another node left on the store is downloaded (the shard, not its part, is what
    this working copy keeps), held on that read to the sha256 its job reported (`expect`): the
    store's object may have been replaced since (StorageError, nothing put in place)."""
    from tasks.core.storage import read_location

    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a killed run's (a link to an existing name fails)
    at, options = read_location(part)
    try:
        if is_remote(at):
            if str(part) not in (expect or {}):
                raise StorageError(f"{part}: no sha256 recorded for it; it is not merged")
            with open(tmp, "wb") as out:
                copy_checked(at, out, expect[str(part)], options)
        else:
            link_or_copy(at, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
