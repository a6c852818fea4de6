"""`run_curate`: ingested shards → line dedup → language id → heuristic filters →
decontamination → PII redaction → URL + exact + MinHash dedup.

0. Line dedup counts (`tasks.dedup.lines`, with `dedup.lines.enabled`): over the whole input, in
   how many distinct documents each normalised line occurs (in process, or on Ray with the hashes
   spilled to Parquet partitions); the lines in more than `dedup.lines.max_docs` documents are
   shipped to the workers once. It runs before the workers because their filters and the dedup
   keys and signatures should see the text without the boilerplate, and counting needs the
   whole corpus first (CCNet likewise counts before language id).
1. Per input row group (ingest writes 500-row groups), on Ray actors (one per CPU, each loads
   the fastText model and spaCy's tokenizer once, started while the driver builds the
   decontamination index and counts lines in process, after lines counted on Ray:
   `RayActors.prestart`): `run_filters` with the enabled filters (`filters.build_filters`, in
   `filters.FILTER_ORDER`, after line dedup's `LineDedupFilter`: frequent lines removed, a
   shortened document below the minimum length dropped as "line_dedup:too_short"), kept
   documents written to a part file, their dedup columns (id, exact-dedup key, size, source,
   quality score, URL key and crawl time, MinHash signature) to the job's meta file and the
   filter drops to its `dropped.jsonl` part. A job returns counters and file paths only, so the
   driver never holds a list per document (issue 26).
2. Dedup as Ray stages that pass files (`tasks.dedup.stages`), over the whole corpus in
   shard/row order: URL dedup (`tasks.dedup.urls`' rule: per normalised URL the newest crawl,
   else the longest text, else the first is kept; documents without a URL pass) and exact dedup
   (first copy kept), each partitioned by key hash and resolved in Ray tasks; then MinHash LSH
   clustering of the remaining documents (first document of each cluster kept, or with
   `minhash.survivor: quality` the highest quality score; `clustering: local` in one Ray task,
   on Ray with band keys spilled to Parquet partitions from `minhash.ray_min_docs` documents:
   `tasks.dedup.cluster`), and with `minhash.index_dir` the index of earlier runs.
   With `minhash.verify` a candidate pair is joined only if its exact shingle Jaccard is ≥
   `minhash.verify_threshold` (`tasks.dedup.verify`: the texts are read back from the part
   files in the clustering's Ray tasks); the clustering stats count `candidate_pairs` and
   `verified_pairs`. Each step writes its drops per job; the driver adds up counters.
3. The curated shards `out_dir/shard-00000.parquet`, ... (`curate.shard_docs` rows each) are
   written by one Ray task per shard (the parts without the deduplicated documents), and
   `out_dir/dropped.jsonl` is the jobs' and steps' drop files concatenated: one line per
   dropped document, {"id", "step", "reason"} (+ "duplicate_of" for dedup drops).

Step order and why: decontamination runs after the heuristic filters (fewer, shorter documents
to scan; C4 has already removed boilerplate lines) and PII redaction after decontamination (so
n-grams are matched on the original text) and before dedup (so copies of a page that differ
only in an e-mail address or phone number dedup together, and signatures are computed on the
text that is written). The decontamination index (`decontam.build_index`) is built once in the
driver (cached per process) and shipped to the actors through the object store once.

Resumability (the machinery is `tasks.core.executor` and `tasks.core.resume`, shared with
ingest): every job (one input row group) writes its part atomically (temp + rename), and the
driver then writes `_parts/<job>.job.json` (atomically) with the job's result, a key (curate
config, source PII policies, decontam index fingerprint, input shard path/size/mtime, row
group) and the sha256 of each file the job wrote (part, meta file, drops). A re-run reuses a job
whose key matches and whose files still have those sha256, and redoes the rest; the dedup stages
run again from the jobs' files. The merged output is written shard by shard
atomically, then `manifest.json` (sha256 and row count per output shard and side file, the run
key and the summary) last; a re-run with the same key whose manifest verifies returns the
stored summary without doing anything. A run killed at any point (even SIGKILL) leaves only
hidden temp files (removed by the next run), complete parts, and complete shards without a
manifest (rewritten by the next run), so the re-run gives byte-identical output.
`curate.resume: false` redoes everything.

Side files in `out_dir`: `dropped.jsonl`, `decontam_report.json` (index stats, hit counts
per benchmark, and one entry per hit: benchmark, item, ngram, doc_id), `DATASET_CARD.md`
(`tasks.curate.card`), `manifest.json`.

Summary: docs_in, docs_out, dropped {reason: n} (docs_out + sum(dropped) == docs_in), steps
(one `StepStats.to_dict()` per step, in order), languages (fastText label counts over every
document the language filter saw), languages_out (over the curated output), shards,
dropped_file, pii ({"replacements": {source: {kind: n}}, "by_kind", "docs_changed"}),
decontam (hits per benchmark, report path, index stats), sources (docs in/out per source),
dedup (`tasks.dedup.report`: duplicate rate per source, cluster sizes, example pairs, clustering),
line_dedup (with line dedup on: the counting stats, and lines, bytes and documents removed per
source, `lines.line_dedup_summary`),
dataset_card, manifest, jobs, workers, nodes (jobs run per Ray node), jobs_rerun (after a node was
lost), resumed_jobs, seconds. The driver folds each job's result into running totals as it arrives
(`_Totals`) and keeps per job only its name, kept count and number of part files (`JobTable`,
~40 B a job; the files are found by curate's naming); the decontamination hits are kept per hit.
"""
from __future__ import annotations

import itertools
import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow.parquet as pq

from tasks.config import CurateConfig, DedupConfig, PipelineConfig
from tasks.core.documents import AtomicJsonlWriter, ShardWriter, iter_doc_batches
from tasks.core.executor import PARTS_DIR, Job, JobRunner, RayActors, ResumableOutput, Shared
from tasks.core.io import atomic_write_bytes
from tasks.core.progress import Progress
from tasks.core.ray_utils import cluster_cpus, init_ray
from tasks.core.resume import MANIFEST, JobStore, digest, file_identity
from tasks.core.steps import StepStats, run_filters
from tasks.curate.filters import filter_names
from tasks.dedup.exact import exact_key
from tasks.dedup.index import check_index_store
from tasks.dedup.lines import (FrequentLines, LineDedupFilter, count_frequent_lines, counting_method,
                               line_dedup_summary)
from tasks.dedup.minhash import MinHasher
from tasks.dedup.cluster import clustering_method
from tasks.dedup.substring import apply_to_curated
from tasks.dedup.texts import minhasher
from tasks.dedup.stages import (META_SCHEMA, DedupStages, IndexHandle, JobTable, part_counts, concat_files,
                                 dedup_report_task, filter_pass, write_meta)
from tasks.dedup.urls import TrackingParams, parse_crawl_date, url_key
from tasks.dedup.verify import JaccardVerifier, ParquetTexts

DATASET_CARD = "DATASET_CARD.md"
DECONTAM_REPORT = "decontam_report.json"
DROPPED = "dropped.jsonl"


def curate_shard(shard: str | Path, filters: list, hasher: MinHasher | None, part_dir: str | Path,
                 part_name: str, row_groups: list[int] | None = None, batch_size: int = 500,
                 score_field: str | None = None, url_tracking: TrackingParams | None = None) -> dict:
    """Filter one shard (or some of its row groups); write survivors to
    `<part_dir>/<part_name>-00000.parquet`, their dedup columns (id, exact key, size, source,
    score, with `url_tracking` the URL key and crawl time, the MinHash signature) to
    `<part_name>-meta.parquet` (`tasks.dedup.stages.META_SCHEMA`) and the filter drops to
    `<part_name>-dropped.jsonl`. The result holds counters and paths only: its size does not grow
    with the documents."""
    stats: dict[str, StepStats] = {}
    languages: Counter = Counter()
    sources_in: Counter = Counter()
    sources_kept: Counter = Counter()
    meta: dict[str, list] = {k: [] for k in META_SCHEMA.names}
    docs_in = n_dropped = 0
    part_dir = Path(part_dir)
    for f in filters:  # a previous job that failed half-way must not leak its extras
        if hasattr(f, "drain"):
            f.drain()
    with ShardWriter(part_dir, prefix=part_name, shard_docs=1 << 40) as writer, \
            AtomicJsonlWriter(part_dir / f"{part_name}-{DROPPED}") as drops:
        for batch in iter_doc_batches([shard], batch_size=batch_size, row_groups=row_groups):
            docs_in += len(batch)
            sources_in.update(d.get("source") or "" for d in batch)
            kept, dropped = [], []
            for doc in run_filters(batch, filters, stats, dropped):
                writer.write(doc)
                text = doc["text"]
                kept.append(text)
                source = doc.get("source") or ""
                sources_kept[source] += 1
                meta["id"].append(doc["id"])
                meta["key"].append(exact_key(text))
                meta["nbytes"].append(len(text.encode("utf-8")))
                meta["source"].append(source)
                meta["score"].append(_score(doc.get(score_field)) if score_field else None)
                meta["url_key"].append(url_key(doc.get("url"), url_tracking) if url_tracking is not None else None)
                meta["crawl_time"].append(parse_crawl_date(doc.get("crawl_date")) if url_tracking is not None else None)
            for doc_id, step, reason in dropped:
                drops.write({"id": doc_id, "step": step, "reason": reason})
            n_dropped += len(dropped)
            sigs = hasher.signatures(kept) if hasher is not None else [None] * len(kept)
            meta["sig"] += [None if sg is None else sg.tobytes() for sg in sigs]
            languages.update(d["language"] for d in batch if d.get("language"))
    meta_path = part_dir / f"{part_name}-meta.parquet"
    write_meta(meta_path, meta)
    extras = {f.name: f.drain() for f in filters if hasattr(f, "drain")}
    docs = [str(p) for p in writer.paths]
    return {
        "docs_in": docs_in, "kept": len(meta["id"]), "filter_dropped": n_dropped,
        "stats": {k: v.to_dict() for k, v in stats.items()},
        "languages": dict(languages), "sources_in": dict(sources_in), "sources_kept": dict(sources_kept),
        "extras": extras, "docs": docs, "meta": str(meta_path), "dropped": str(drops.path),
        "parts": docs + [str(meta_path), str(drops.path)],  # every file: JobStore checks their sha256
    }


def _score(value) -> float | None:
    """A quality score as stored (a float, or None when the document has none)."""
    return None if value is None else float(value)


def source_policies(cfg: PipelineConfig) -> dict[str, str]:
    return {s.name: s.pii_policy for s in cfg.sources}


class CurateWorker:
    """Ray actor body: builds the filters (and loads the fastText model) once. With
    `frequent_lines` (line dedup's sorted hashes) line dedup runs first, before language id.
    `warm_up(cfg)` loads what the filters load (once per process) before the decontamination
    index and the line counts exist (`RayActors.prestart`). `hasher`: the MinHash hasher the driver
    built (`minhasher`: its permutations come from datasketch, ~0.4 s of imports a worker then
    skips), else built here."""

    @staticmethod
    def warm_up(cfg: CurateConfig) -> None:
        """Load into this process what a first job would: the fastText model (the language
        filter) and spaCy's tokenizer (the word-based filters)."""
        from tasks.curate import text
        from tasks.curate.filters import build_filters

        build_filters(cfg)
        if any(getattr(cfg, name).enabled for name in ("gopher_repetition", "gopher_quality", "c4", "fineweb")):
            text.load_tokenizer()

    def __init__(self, cfg: CurateConfig, policies: dict[str, str] | None = None, decontam_index=None,
                 frequent_lines=None, hasher: MinHasher | None = None):
        from tasks.curate.filters import build_filters

        self.filters = build_filters(cfg, decontam_index=decontam_index, pii_policies=policies)
        if frequent_lines is not None:
            gq = cfg.gopher_quality
            self.filters.insert(0, LineDedupFilter(frequent_lines, gq.min_doc_words if gq.enabled else 0))
        url = cfg.dedup.url
        self.url_tracking = TrackingParams(url.tracking_params) if url.enabled else None
        mh = cfg.dedup.minhash
        self.hasher = hasher if hasher is not None else minhasher(mh)
        self.score_field = mh.quality_field if mh.enabled and mh.survivor == "quality" else None

    def process(self, shard: str, part_dir: str, part_name: str, row_groups: list[int] | None = None) -> dict:
        res = curate_shard(shard, self.filters, self.hasher, part_dir, part_name, row_groups,
                           score_field=self.score_field, url_tracking=self.url_tracking)
        res["name"] = part_name
        return res


# ------------------------------------------------------------------ jobs and their keys

def job_base_key(cfg: PipelineConfig, index) -> str:
    """What every job's output depends on besides its input: the curate config (re-validated,
    so a default `3` and a loaded `3.0` agree), the sources' PII policies, the decontam index."""
    cur = CurateConfig.model_validate(cfg.curate.model_dump()).model_dump(exclude={"resume"})
    return digest([cur, source_policies(cfg), index.fingerprint() if index is not None else None])


def job_key(base: str, shard: str, row_groups: list[int]) -> str:
    """Key of one job (input shard path/size/mtime and row groups) under `job_base_key`."""
    return digest([base, file_identity(shard), row_groups])


def job_name(k: int) -> str:
    """Job k's name: the prefix of its part files, in corpus order."""
    return f"{k:05d}"


def count_jobs(shards: list[str]) -> int:
    return sum(pq.ParquetFile(s).metadata.num_row_groups for s in shards)


def plan_jobs(shards: list[str], parts_dir: Path, base: str) -> Iterator[Job]:
    """One job per Parquet row group (ingest writes 500-row groups), in corpus order, so a
    corpus of one shard still spreads over all workers. Arguments: `CurateWorker.process`'s.
    Made as they are submitted (a job's key and arguments are ~1 KB in the driver)."""
    k = 0
    for s in shards:
        for rg in range(pq.ParquetFile(s).metadata.num_row_groups):
            yield Job(job_name(k), job_key(base, s, [rg]), (s, str(parts_dir), job_name(k), [rg]))
            k += 1


_INDEX_CACHE: dict[str, object] = {}


def _decontam_index(cfg: PipelineConfig):
    """The decontamination index for `cfg` (None when disabled), cached per process by the
    config and the benchmark files' size/mtime."""
    dc = cfg.curate.decontam
    if not dc.enabled:
        return None
    from tasks.curate.decontam import build_index

    ident = []
    for b in dc.benchmarks:
        path = cfg.resolve_uri(b.path)
        ident.append(file_identity(path) if os.path.isfile(path) else [path, None])
    key = digest([dc.model_dump(), ident])
    if key not in _INDEX_CACHE:
        _INDEX_CACHE.clear()
        _INDEX_CACHE[key] = build_index(dc, cfg)
    return _INDEX_CACHE[key]


def _line_counting(cfg: PipelineConfig, shards: list[str]) -> str | None:
    """Where line dedup counts (`counting_method`: "local" in the driver, "ray" in Ray tasks), from
    the shards' footers; None when line dedup is off."""
    if not cfg.curate.dedup.lines.enabled:
        return None
    return counting_method(cfg.curate.dedup.lines, sum(pq.ParquetFile(s).metadata.num_rows for s in shards))


def _frequent_lines(cfg: PipelineConfig, shards: list[str], work_dir: Path, method: str | None) -> FrequentLines | None:
    """Line dedup's frequent lines over the whole input (None when off): counted before the
    workers run, so every worker removes the same lines (`tasks.dedup.lines`)."""
    if method is None:
        return None
    return count_frequent_lines(shards, cfg.curate.dedup.lines, work_dir, cfg.ray, method=method)


# ------------------------------------------------------------------ the stage

def run_curate(cfg: PipelineConfig, in_shards: list[Path], out_dir: Path, progress: Progress | None = None) -> dict:
    """Curate `in_shards` into `out_dir` (see the module docstring). `progress(done, total, note)`,
    if given, is called as jobs (input row groups) finish, resumed ones included."""
    t0 = time.perf_counter()
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = [str(Path(s).resolve()) for s in in_shards]
    n_jobs, counting = count_jobs(shards), _line_counting(cfg, shards)
    # the workers boot and load their models while the driver builds the decontamination index and
    # counts lines in process (`RayActors.prestart`); not where a complete earlier run may be
    # returned as it is. Lines counted on Ray need the CPUs the actors hold: counted before them.
    actors = RayActors(CurateWorker, (), "process", cfg.ray)
    try:
        lines = None
        if not (cfg.curate.resume and (out_dir / MANIFEST).is_file()):
            init_ray(cfg.ray)  # first: an unreachable ray.address fails before the old output is touched
            if counting == "ray":  # spill files under _parts/_lines, removed by the count
                lines = _frequent_lines(cfg, shards, out_dir / PARTS_DIR, counting)
            actors.prestart(n_jobs, cfg.curate)
        return _curate(cfg, shards, n_jobs, out_dir, actors, progress, t0, counting, lines)
    finally:
        actors.stop()


def _curate(cfg: PipelineConfig, shards: list[str], n_jobs: int, out_dir: Path, actors: RayActors,
            progress: Progress | None, t0: float, counting: str | None, lines: FrequentLines | None) -> dict:
    """`run_curate` once its workers are starting (`actors`, built by `_map_jobs`); `lines`: the
    frequent lines if counted already, else counted here (`counting`: how)."""
    t_index = time.perf_counter()
    index = _decontam_index(cfg)
    index_seconds = time.perf_counter() - t_index
    job_base = job_base_key(cfg, index)
    output = ResumableOutput(out_dir, digest([job_base, [file_identity(s) for s in shards]]),
                             [DROPPED, DECONTAM_REPORT, DATASET_CARD])
    if cfg.curate.resume and (done := output.completed(t0)) is not None:
        return done
    init_ray(cfg.ray)  # first: an unreachable ray.address fails before the old output is touched
    if counting != "ray":  # (if not yet) the line counts in the driver still overlap; on Ray they need the CPUs
        actors.prestart(n_jobs, cfg.curate)
    check_index_store(cfg)  # an object-store index with cfg.storage's options, also when called as a library
    store = output.start(cfg.curate.resume)
    if lines is None:
        lines = _frequent_lines(cfg, shards, output.parts_dir, counting)
    lines_seconds = lines.stats["seconds"] if lines is not None else 0.0
    if lines is not None:  # every job's output depends on the whole corpus's line counts
        job_base = digest([job_base, lines.fingerprint()])
    store.prune({job_name(k) for k in range(n_jobs)})
    mapped = _map_jobs(cfg, plan_jobs(shards, output.parts_dir, job_base), n_jobs, index, store, progress, lines,
                       output.parts_dir, actors)

    t_dedup = time.perf_counter()
    totals = mapped.totals
    stages, clustering, mh_index = _dedup(cfg.curate.dedup, mapped.table, output.parts_dir, cfg.storage)
    steps = _filter_steps(cfg.curate, totals) + stages.steps
    t_write = time.perf_counter()
    written = _write_curated(cfg, totals, mapped.table, stages, clustering, output.dir)
    if cfg.curate.dedup.substring.enabled:  # exact-substring dedup of the curated shards, in place
        apply_to_curated(cfg, written, steps, output.parts_dir / "_substring")
    driver_seconds = {"dedup_s": round(t_write - t_dedup, 3), "write_s": round(time.perf_counter() - t_write, 3)}
    dropped = _check_accounting(steps, totals.docs_in, written.docs_out)
    if mh_index is not None:  # only once this run's output is complete
        mh_index.save(cfg.curate.dedup.minhash.index_dir)

    summary = _summary(cfg, totals, steps, dropped, written, index, output.dir)
    if lines is not None:
        summary["line_dedup"] = line_dedup_summary(lines.stats, [totals.line_dedup])
    summary.update(jobs=n_jobs, workers=mapped.workers, nodes=mapped.nodes, jobs_rerun=mapped.rerun)
    from tasks.curate.card import write_dataset_card

    summary["dataset_card"] = str(write_dataset_card(cfg, summary, output.dir / DATASET_CARD))
    summary["manifest"] = str(output.manifest)
    output.publish(summary)
    summary["resumed_jobs"] = mapped.resumed
    summary["timings"] = {"decontam_index_s": round(index_seconds, 3), "line_counts_s": round(lines_seconds, 3),
                          "map_s": round(mapped.seconds, 3),
                          "map_docs_per_s": round(mapped.ran_docs / mapped.seconds, 1)
                          if mapped.ran and mapped.seconds > 0 else None,
                          **driver_seconds, "jobs": mapped.job_report}
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary


class _Totals:
    """The jobs' results folded as each arrives (the driver keeps none of them): documents in, the
    filter steps' stats, languages and sources, PII counters, line dedup's removals per source, and
    the decontamination hits (one entry per hit, for the report: they grow with the hits, not the
    jobs). Languages keep the order of their first appearance in corpus order, whatever order the
    jobs finish in, so the summary is the one an in-order merge gives."""

    def __init__(self):
        self.docs_in = 0
        self.stats: dict[str, StepStats] = {}
        self.languages: Counter = Counter()
        self._first_seen: dict[str, tuple[int, int]] = {}  # language -> (job, rank in its result)
        self.sources_in: Counter = Counter()
        self.sources_kept: Counter = Counter()
        self.pii_repl: dict[str, Counter] = {}
        self.pii_changed: Counter = Counter()
        self.line_dedup: dict[str, Counter] = {}
        self._hits: dict[int, list] = {}  # job -> its decontamination hits

    def add(self, job: int, r: dict) -> None:
        self.docs_in += r["docs_in"]
        for name, d in r["stats"].items():
            self.stats.setdefault(name, StepStats(name)).merge(StepStats.from_dict(d))
        for rank, (lang, n) in enumerate(r["languages"].items()):
            self.languages[lang] += n
            self._first_seen[lang] = min(self._first_seen.get(lang, (job, rank)), (job, rank))
        self.sources_in.update(r.get("sources_in", {}))
        self.sources_kept.update(r["sources_kept"])
        extras = r.get("extras", {})
        pii = extras.get("pii", {})
        for src, counts in pii.get("replacements", {}).items():
            self.pii_repl.setdefault(src, Counter()).update(counts)
        self.pii_changed.update(pii.get("docs_changed", {}))
        for src, counts in extras.get("line_dedup", {}).items():
            self.line_dedup.setdefault(src, Counter()).update(counts)
        if extras.get("decontam"):
            self._hits[job] = extras["decontam"]

    def languages_in_order(self) -> dict[str, int]:
        """Counts, most first; ties in order of first appearance in the corpus."""
        return dict(sorted(self.languages.items(), key=lambda kv: (-kv[1], self._first_seen[kv[0]])))

    def decontam_hits(self) -> list[dict]:
        return [h for job in sorted(self._hits) for h in self._hits[job]]


FEED_AHEAD = 4  # jobs queued per CPU beyond those running: the workers never wait for the plan


@dataclass
class _Mapped:
    """The map's outcome: the jobs' results folded, their kept documents' table, how they were obtained."""
    totals: _Totals
    table: JobTable  # per job: name, kept documents, part files (what the dedup stages read)
    resumed: int  # jobs reused from an earlier run
    ran: int  # jobs run now
    ran_docs: int  # documents of the jobs run now
    workers: int  # actors started (0: every job was reused)
    seconds: float
    nodes: dict[str, int]  # jobs run per Ray node (`JobRunner.node_report`)
    rerun: int  # jobs run again after their actor was lost with its node
    job_report: dict  # `JobRunner.job_report`: compute vs wall of the jobs, result bytes


def _map_jobs(cfg: PipelineConfig, jobs: Iterator[Job], n_jobs: int, index, store: JobStore,
              progress: Progress | None, lines: FrequentLines | None, parts_dir: Path, actors: RayActors) -> _Mapped:
    """Reuse the finished jobs, run the others on `CurateWorker` actors (`actors`, perhaps started
    already; the decontam index and the frequent lines are shipped once). Jobs are taken from the
    plan as the workers need them (`FEED_AHEAD` per CPU queued at most); each result is folded
    into `_Totals` as it arrives and only its kept count and number of part files are kept (`JobTable`)."""
    report = progress or (lambda done, total, note: None)
    actors.init_args = (cfg.curate, source_policies(cfg), Shared(index) if index is not None else None,
                        Shared(lines.hashes) if lines is not None else None, minhasher(cfg.curate.dedup.minhash))
    totals = _Totals()
    names = np.zeros(n_jobs, dtype=f"U{len(job_name(max(0, n_jobs - 1)))}")
    kept, parts = np.zeros(n_jobs, np.int64), np.zeros(n_jobs, np.int32)
    position: dict[str, int] = {}  # the jobs submitted and not yet folded
    folded = 0
    ahead = FEED_AHEAD * max(1, cluster_cpus())

    def fold(name: str, result: dict) -> None:
        nonlocal folded
        k = position.pop(name)  # KeyError: a job's result came twice
        job = JobTable(parts_dir, [name], [0], [len(result["docs"])])[0]  # its files by curate's naming
        if (result["meta"] != job.meta or list(result["docs"]) != list(job.docs)
                or result["dropped"] != str(parts_dir / f"{name}-{DROPPED}")):
            raise RuntimeError(f"curate job {name}: its files {result['meta']}, {result['docs']} are not named "
                               f"as the dedup stages read them (under {parts_dir})")
        totals.add(k, result)
        kept[k], parts[k] = result["kept"], len(result["docs"])
        folded += 1

    def feed(runner: JobRunner) -> None:
        """Submit planned jobs until `ahead` wait to run (the reused ones are folded at once)."""
        while runner.queued < ahead and (job := next(jobs, None)) is not None:
            k = len(position) + folded
            if len(job.name) > names.itemsize // 4 or k >= n_jobs:
                raise RuntimeError(f"curate: job {job.name} is not in the plan of {n_jobs} jobs")
            names[k], position[job.name] = job.name, k
            if (stored := runner.submit(job)) is not None:
                fold(job.name, stored)

    ran_docs = 0
    with JobRunner(actors, store) as runner:
        feed(runner)
        report(runner.resumed, n_jobs, f"curate: {runner.resumed} jobs resumed" if runner.resumed else "curate")
        t0 = time.perf_counter()
        for job, result in runner.finished():
            fold(job.name, result)
            ran_docs += result["docs_in"]
            feed(runner)
            report(folded, n_jobs, "curate")
    if folded != n_jobs:
        raise RuntimeError(f"curate: {folded} of {n_jobs} jobs gave a result")
    return _Mapped(totals, JobTable(parts_dir, names, kept, parts), runner.resumed, runner.ran, ran_docs,
                   actors.workers, time.perf_counter() - t0, runner.node_report(), runner.rerun, runner.job_report())


def _filter_steps(cfg: CurateConfig, totals: _Totals) -> list[StepStats]:
    """The filter steps' stats over every job, in chain order (line dedup first)."""
    steps = []
    for name in (["line_dedup"] if cfg.dedup.lines.enabled else []) + filter_names(cfg):
        st = StepStats(name)
        if name in totals.stats:
            st.merge(totals.stats[name])
        steps.append(st)
    return steps


def _dedup(cfg: DedupConfig, jobs: JobTable, parts_dir: Path,
           storage=None) -> tuple[DedupStages, dict | None, IndexHandle | None]:
    """URL dedup, exact dedup, MinHash clustering, then (continued pretraining) the index of the
    documents earlier runs kept, as Ray tasks over the jobs' files (`tasks.dedup.stages`). Returns
    the stages (their step stats and drop files), the clustering stats and the updated index
    (saved by the caller once the output is complete)."""
    mh = cfg.minhash
    stages = DedupStages(jobs, parts_dir / "_dedup", partitions=mh.partitions)
    if cfg.url.enabled:
        stages.key_step("url_dedup", "url_key", "url")
    if cfg.exact:
        stages.key_step("exact_dedup", "key", "first")
    clustering, mh_index = None, None
    if mh.enabled:
        # exact Jaccard check of candidate pairs: the verifier reads the texts from the part files
        # itself, in the clustering's Ray tasks; document k is row k of the parts laid end to end
        verify = None
        if mh.verify:
            files = [(p, n) for j in jobs for p, n in zip(j.docs, part_counts(j))]
            verify = JaccardVerifier(ParquetTexts([f for f, _ in files], [n for _, n in files]), mh.verify_threshold,
                                     mh.ngram)
        alive = stages.steps[-1].docs_out if stages.steps else sum(j.kept for j in jobs)
        clustering = stages.minhash_step(mh, verify, clustering_method(mh, alive))
    if mh.enabled and mh.index_dir:
        # the clustering (representative check included) decided between this run's documents
        mh_index = stages.index_step(mh, storage)
    return stages, clustering, mh_index


@dataclass
class _Written:
    """What `_write_curated` wrote and counted."""
    shards: list[str]
    dropped_file: Path
    docs_out: int
    bytes_out: int
    languages_out: Counter
    sources_out: Counter
    dedup: dict  # the dedup report with the example pairs' Jaccard and the clustering stats


def _write_curated(cfg: PipelineConfig, totals: _Totals, table: JobTable, stages: DedupStages,
                   clustering: dict | None, out_dir: Path) -> _Written:
    """`dropped.jsonl` (filter drops per job, then dedup drops per step in corpus order: the
    jobs' and steps' files concatenated), the curated shards (Ray tasks: `stages.filter_pass`)
    and the dedup report (its Ray tasks over the drop files, driven from a driver thread meanwhile:
    as a Ray task itself it would wait on its own tasks, its CPU released, and Ray would boot
    another worker process for the filter pass's tasks; it keeps counters and a few examples)."""
    from concurrent.futures import ThreadPoolExecutor

    filter_drops = (Path(table.root) / f"{name}-{DROPPED}" for name in table.names)
    concat_files(itertools.chain(filter_drops, stages.dropped_lines()), out_dir / DROPPED)
    mh = cfg.curate.dedup.minhash
    pool = ThreadPoolExecutor(1, thread_name_prefix="dedup-report")
    try:
        report = pool.submit(dedup_report_task, stages.drop_files(), dict(totals.sources_kept),
                             sum(j.kept for j in stages.jobs), stages.jobs, mh, mh.ngram)
        out = filter_pass(stages, out_dir, cfg.curate.shard_docs)
        report = report.result()
    except BaseException:  # the filter pass's error now, not after the whole report
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return _Written(out["shards"], out_dir / DROPPED, out["docs"], out["bytes"], out["languages"], out["sources"],
                    {**report, "clustering": clustering, "stages": stages.layout})


def _check_accounting(steps: list[StepStats], docs_in: int, docs_out: int) -> Counter:
    """Drops per reason over all steps; every input document is either written or dropped once."""
    dropped: Counter = Counter()
    for st in steps:
        dropped.update(st.dropped)
    if docs_out + sum(dropped.values()) != docs_in:
        raise RuntimeError(f"curate accounting broken: {docs_in} in, {docs_out} out, {dict(dropped)} dropped")
    return dropped


def _summary(cfg: PipelineConfig, totals: _Totals, steps: list[StepStats], dropped: Counter,
             written: _Written, index, out_dir: Path) -> dict:
    sources_in, sources_out = totals.sources_in, written.sources_out
    return {
        "docs_in": totals.docs_in,
        "docs_out": written.docs_out,
        "bytes_out": written.bytes_out,
        "dropped": dict(sorted(dropped.items())),
        "steps": [st.to_dict() for st in steps],
        "languages": totals.languages_in_order(),
        "languages_out": {str(k): v for k, v in written.languages_out.most_common()},
        "sources": {s: {"docs_in": sources_in.get(s, 0), "docs_out": sources_out.get(s, 0)}
                    for s in sorted(set(sources_in) | set(sources_out))},
        "pii": _pii_summary(totals, source_policies(cfg)),
        "decontam": _decontam_summary(index, dropped, totals.decontam_hits(), out_dir),
        "dedup": written.dedup,
        "shards": written.shards,
        "dropped_file": str(written.dropped_file),
    }


def _pii_summary(totals: _Totals, policies: dict[str, str]) -> dict:
    """Replacements per source and kind, documents changed, the policies."""
    pii_repl, pii_changed = totals.pii_repl, totals.pii_changed
    by_kind: Counter = Counter()
    for c in pii_repl.values():
        by_kind.update(c)
    return {"replacements": {s: dict(sorted(c.items())) for s, c in sorted(pii_repl.items())},
            "by_kind": dict(sorted(by_kind.items())), "docs_changed": dict(sorted(pii_changed.items())),
            "policies": policies}


def _decontam_summary(index, dropped: Counter, hits: list[dict], out_dir: Path) -> dict | None:
    """Write `decontam_report.json` (index stats, drops per benchmark, every hit); its summary."""
    if index is None:
        return None
    per_bench = Counter(r.split(":", 1)[1] for r in dropped.elements() if r.startswith("decontam:"))
    items_hit: dict[str, set] = {}
    for h in hits:
        items_hit.setdefault(h["benchmark"], set()).add(h["item"])
    report = {"index": {k: v for k, v in index.stats.items() if k != "build_seconds"},
              "docs_dropped": dict(sorted(per_bench.items())),
              "items_hit": {b: sorted(v) for b, v in sorted(items_hit.items())},
              "hits": hits}
    report_path = out_dir / DECONTAM_REPORT
    atomic_write_bytes(report_path, (json.dumps(report, indent=1, sort_keys=True) + "\n").encode())
    return {"docs_dropped": report["docs_dropped"],
            "items_hit": {b: len(v) for b, v in report["items_hit"].items()},
            "report": str(report_path), "index_ngrams": len(index),
            "index_build_seconds": index.stats["build_seconds"]}
