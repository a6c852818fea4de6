"""`run_curate`: ingested shards → language id → heuristic filters → decontamination → PII
redaction → exact + MinHash dedup.

1. Per input row group (ingest writes 500-row groups), on Ray actors (one per CPU, each loads
   the fastText model once):
   `run_filters` with the enabled filters (`filters.build_filters`), kept documents written to
   a part file; for every kept document the worker also returns its id, exact-dedup key,
   MinHash signature and size. Actor results come back in corpus order.
2. In the driver, over the whole corpus in shard/row order: exact dedup (first copy kept),
   then MinHash LSH clustering of the remaining documents (first document of each cluster kept,
   or with `minhash.survivor: quality` the highest quality score; in process, or on Ray with
   band keys spilled to Parquet from `minhash.ray_min_docs` documents: `tasks.dedup.cluster`).
   With `minhash.verify` a candidate pair is joined only if its exact shingle Jaccard is ≥
   `minhash.verify_threshold` (`tasks.dedup.verify`: the texts are read back from the part
   files, in the clustering's Ray tasks on the Ray path); the clustering stats count
   `candidate_pairs` and `verified_pairs`.
3. The parts are streamed into `out_dir/shard-00000.parquet`, ... (`curate.shard_docs` rows
   each) without the deduplicated documents, and `out_dir/dropped.jsonl` gets one line per
   dropped document: {"id", "step", "reason"} (+ "duplicate_of" for dedup drops).

Step order and why: decontamination runs after the heuristic filters (fewer, shorter documents
to scan; C4 has already removed boilerplate lines) and PII redaction after decontamination (so
n-grams are matched on the original text) and before dedup (so copies of a page that differ
only in an e-mail address or phone number dedup together, and signatures are computed on the
text that is written). The decontamination index (`decontam.build_index`) is built once in the
driver (cached per process) and shipped to the actors with `ray.put`.

Resumability (the machinery is `tasks.core.resume`, shared with ingest): every job (one input
row group) writes its part atomically (temp + rename), and
the driver then writes `_parts/<job>.pkl` (atomically) with the job's result, a key (curate
config, source PII policies, decontam index fingerprint, input shard path/size/mtime, row
group) and the sha256 of the part. A re-run reuses a job whose key matches and whose part
still has that sha256, and redoes the rest. The merged output is written shard by shard
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
dataset_card, manifest, resumed_jobs, seconds. Memory in the driver is O(documents) for ids, keys and signatures
(112 × 4 bytes per document with the default 14×8 LSH).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from tasks.config import CurateConfig, PipelineConfig
from tasks.core.documents import AtomicJsonlWriter, ShardWriter, count_docs, iter_doc_batches, iter_docs
from tasks.core.resume import (MANIFEST, JobStore, atomic_write_bytes as _atomic_write_bytes, digest as _digest,
                               file_identity as _file_identity, remove_temp_files as _remove_temp_files,
                               verify_manifest as _verify_manifest, write_manifest)
from tasks.core.progress import Progress
from tasks.core.ray_utils import cluster_cpus, init_ray
from tasks.core.steps import StepStats, run_filters
from tasks.dedup.exact import ExactDeduper, exact_key
from tasks.dedup.cluster import cluster_signatures, clustering_method
from tasks.dedup.index import MinHashIndex
from tasks.dedup.minhash import MinHasher
from tasks.dedup.report import add_text_jaccard, dedup_report, example_ids
from tasks.dedup.verify import JaccardVerifier, ParquetTexts

DATASET_CARD = "DATASET_CARD.md"
DECONTAM_REPORT = "decontam_report.json"


def filter_names(cfg: CurateConfig) -> list[str]:
    """Names of the enabled filter steps in the order `build_filters` runs them."""
    order = [("langid", cfg.langid.enabled), ("gopher_repetition", cfg.gopher_repetition.enabled),
             ("gopher_quality", cfg.gopher_quality.enabled), ("c4", cfg.c4.enabled),
             ("fineweb", cfg.fineweb.enabled), ("decontam", cfg.decontam.enabled), ("pii", cfg.pii.enabled)]
    return [name for name, on in order if on]


def _batches(shard: str | Path, row_groups: list[int] | None, batch_size: int):
    if row_groups is None:
        yield from iter_doc_batches([shard], batch_size=batch_size)
        return
    pf = pq.ParquetFile(shard)
    try:
        for batch in pf.iter_batches(batch_size=batch_size, row_groups=row_groups):
            yield batch.to_pylist()
    finally:
        pf.close()


def curate_shard(shard: str | Path, filters: list, hasher: MinHasher | None, part_dir: str | Path,
                 part_name: str, row_groups: list[int] | None = None, batch_size: int = 500,
                 score_field: str | None = None) -> dict:
    """Filter one shard (or some of its row groups); write survivors to
    `<part_dir>/<part_name>-00000.parquet`."""
    stats: dict[str, StepStats] = {}
    dropped: list = []
    languages: Counter = Counter()
    sources_in: Counter = Counter()
    ids, keys, sigs, nbytes, doc_sources, scores = [], [], [], [], [], []
    docs_in = 0
    for f in filters:  # a previous job that failed half-way must not leak its extras
        if hasattr(f, "drain"):
            f.drain()
    with ShardWriter(part_dir, prefix=part_name, shard_docs=1 << 40) as writer:
        for batch in _batches(shard, row_groups, batch_size):
            docs_in += len(batch)
            sources_in.update(d.get("source") or "" for d in batch)
            kept = []
            for doc in run_filters(batch, filters, stats, dropped):
                writer.write(doc)
                text = doc["text"]
                kept.append(text)
                ids.append(doc["id"])
                keys.append(exact_key(text))
                nbytes.append(len(text.encode("utf-8")))
                doc_sources.append(doc.get("source") or "")
                scores.append(doc.get(score_field) if score_field else None)
            sigs.extend(hasher.signatures(kept) if hasher is not None else [None] * len(kept))
            languages.update(d["language"] for d in batch if d.get("language"))
    extras = {f.name: f.drain() for f in filters if hasattr(f, "drain")}
    return {
        "docs_in": docs_in, "stats": {k: v.to_dict() for k, v in stats.items()},
        "dropped": dropped, "ids": ids, "keys": keys, "sigs": sigs, "nbytes": nbytes,
        "doc_sources": doc_sources, "scores": scores,
        "languages": dict(languages), "sources_in": dict(sources_in), "extras": extras,
        "parts": [str(p) for p in writer.paths],
    }


def source_policies(cfg: PipelineConfig) -> dict[str, str]:
    return {s.name: s.pii_policy for s in cfg.sources}


class CurateWorker:
    """Ray actor body: builds the filters (and loads the fastText model) once."""

    def __init__(self, cfg: CurateConfig, policies: dict[str, str] | None = None, decontam_index=None):
        from tasks.curate.filters import build_filters

        self.filters = build_filters(cfg, decontam_index=decontam_index, pii_policies=policies)
        mh = cfg.dedup.minhash
        self.hasher = MinHasher(mh.bands, mh.rows, mh.seed, mh.ngram, mh.scheme, mh.hash) if mh.enabled else None
        self.score_field = mh.quality_field if mh.enabled and mh.survivor == "quality" else None

    def process(self, shard: str, part_dir: str, part_name: str, row_groups: list[int] | None = None) -> dict:
        res = curate_shard(shard, self.filters, self.hasher, part_dir, part_name, row_groups,
                           score_field=self.score_field)
        res["name"] = part_name
        return res


def part_texts(results: list[dict]) -> ParquetTexts:
    """The kept documents' texts in the jobs' part files: row g is the document `ids[g]` of
    `run_curate` (jobs in corpus order, each job's part rows in the order of its `ids`)."""
    files, counts = [], []
    for r in results:
        n = [len(r["ids"])] if len(r["parts"]) == 1 else [count_docs([p]) for p in r["parts"]]
        if sum(n) != len(r["ids"]):
            raise RuntimeError(f"job {r.get('name')}: {sum(n)} rows in its parts, {len(r['ids'])} ids")
        files += r["parts"]
        counts += n
    return ParquetTexts(files, counts)


def _jobs(shards: list[str], parts_dir: Path) -> list[tuple]:
    """One job per Parquet row group (ingest writes 500-row groups), in corpus order, so a
    corpus of one shard still spreads over all workers."""
    jobs = []
    for s in shards:
        for rg in range(pq.ParquetFile(s).metadata.num_row_groups):
            jobs.append((s, str(parts_dir), f"{len(jobs):05d}", [rg]))
    return jobs


# ------------------------------------------------------------------ resumability

def job_base_key(cfg: PipelineConfig, index) -> str:
    """What every job's output depends on besides its input: the curate config (re-validated,
    so a default `3` and a loaded `3.0` agree), the sources' PII policies, the decontam index."""
    cur = CurateConfig.model_validate(cfg.curate.model_dump()).model_dump(exclude={"resume"})
    return _digest([cur, source_policies(cfg), index.fingerprint() if index is not None else None])


def job_key(base: str, job: tuple) -> str:
    """Key of one job (input shard path/size/mtime and row groups) under `job_base_key`."""
    return _digest([base, _file_identity(job[0]), job[3]])


def _save_job(parts_dir: Path, name: str, key: str, result: dict) -> None:
    JobStore(parts_dir).save(name, key, result)


def _write_manifest(out_dir: Path, run_key: str, summary: dict) -> Path:
    return write_manifest(out_dir, run_key, summary, summary["shards"],
                          ["dropped.jsonl", DECONTAM_REPORT, DATASET_CARD])


# ------------------------------------------------------------------ map

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
        ident.append(_file_identity(path) if os.path.isfile(path) else [path, None])
    key = _digest([dc.model_dump(), ident])
    if key not in _INDEX_CACHE:
        _INDEX_CACHE.clear()
        _INDEX_CACHE[key] = build_index(dc, cfg)
    return _INDEX_CACHE[key]


def _map_shards(cfg: PipelineConfig, jobs: list[tuple], index, on_result) -> None:
    """Run `jobs` on Ray actors; `on_result(result)` is called in the driver as each finishes."""
    import ray
    from ray.util import ActorPool

    if not jobs:
        return
    init_ray(cfg.ray)
    n = max(1, min(cluster_cpus(), len(jobs)))
    actor_cls = ray.remote(num_cpus=1)(CurateWorker)
    index_ref = ray.put(index) if index is not None else None
    policies = source_policies(cfg)
    actors = [actor_cls.remote(cfg.curate, policies, index_ref) for _ in range(n)]
    try:
        pool = ActorPool(actors)
        for res in pool.map_unordered(lambda a, job: a.process.remote(*job), jobs):
            on_result(res)
    finally:
        for a in actors:
            ray.kill(a)


def run_curate(cfg: PipelineConfig, in_shards: list[Path], out_dir: Path, progress: Progress | None = None) -> dict:
    """Curate `in_shards` into `out_dir` (see the module docstring). `progress(done, total, note)`,
    if given, is called as jobs (input row groups) finish, resumed ones included."""
    t0 = time.perf_counter()
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    parts_dir = out_dir / "_parts"
    shards = [str(Path(s).resolve()) for s in in_shards]

    t_index = time.perf_counter()
    index = _decontam_index(cfg)
    index_seconds = time.perf_counter() - t_index
    policies = source_policies(cfg)
    job_base = job_base_key(cfg, index)
    run_key = _digest([job_base, [_file_identity(s) for s in shards]])

    if cfg.curate.resume:
        m = _verify_manifest(out_dir, run_key)
        if m is not None:
            return {**m["summary"], "resumed_jobs": m["summary"].get("jobs", 0), "resumed_complete": True,
                    "seconds": round(time.perf_counter() - t0, 3)}
    # from here on the old output is invalid: manifest first, so a kill never leaves a stale one
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for stale in out_dir.glob("shard-*.parquet"):
        stale.unlink()
    _remove_temp_files(out_dir)
    if not cfg.curate.resume:
        shutil.rmtree(parts_dir, ignore_errors=True)
    parts_dir.mkdir(exist_ok=True)
    _remove_temp_files(parts_dir)

    jobs = _jobs(shards, parts_dir)
    job_keys = {job[2]: job_key(job_base, job) for job in jobs}
    store = JobStore(parts_dir)
    store.prune(set(job_keys))
    done: dict[str, dict] = {}
    for job in jobs:
        r = store.load(job[2], job_keys[job[2]])
        if r is not None:
            done[job[2]] = r
    resumed = len(done)
    todo = [job for job in jobs if job[2] not in done]
    for job in todo:  # parts of jobs that will be redone
        for p in parts_dir.glob(f"{job[2]}-*.parquet"):
            p.unlink()

    report = progress or (lambda done_, total, note: None)
    report(resumed, len(jobs), f"curate: {resumed} jobs resumed" if resumed else "curate")

    def on_result(res: dict) -> None:
        _save_job(parts_dir, res["name"], job_keys[res["name"]], res)
        done[res["name"]] = res
        report(len(done), len(jobs), "curate")

    t_map = time.perf_counter()
    _map_shards(cfg, todo, index, on_result)
    map_seconds = time.perf_counter() - t_map
    results = [done[job[2]] for job in jobs]

    # filter steps, in order
    steps: list[StepStats] = []
    for name in filter_names(cfg.curate):
        st = StepStats(name)
        for r in results:
            if name in r["stats"]:
                st.merge(StepStats.from_dict(r["stats"][name]))
        steps.append(st)
    docs_in = sum(r["docs_in"] for r in results)
    languages: Counter = Counter()
    sources_in: Counter = Counter()
    for r in results:
        languages.update(r["languages"])
        sources_in.update(r.get("sources_in", {}))

    ids = [i for r in results for i in r["ids"]]
    keys = [k for r in results for k in r["keys"]]
    sigs = [s for r in results for s in r["sigs"]]
    nbytes = [b for r in results for b in r["nbytes"]]
    dedup_drops: list[tuple[str, str, str, str]] = []  # (id, step, reason, duplicate_of)
    alive = list(range(len(ids)))

    def dedup_step(name: str, duplicate_of: list[str | None], t0: float) -> None:
        """Keep or drop each alive document by `duplicate_of` (None: kept), as step `name`."""
        nonlocal alive
        st, survivors = StepStats(name), []
        for i, prev in zip(alive, duplicate_of):
            st.docs_in += 1
            st.bytes_in += nbytes[i]
            if prev is None:
                survivors.append(i)
                st.docs_out += 1
                st.bytes_out += nbytes[i]
            else:
                st.dropped[name] += 1
                dedup_drops.append((ids[i], name, name, prev))
        st.seconds = time.perf_counter() - t0
        alive = survivors
        steps.append(st)

    if cfg.curate.dedup.exact:
        t1, ex = time.perf_counter(), ExactDeduper()
        dedup_step("exact_dedup", [ex.check(ids[i], keys[i]) for i in alive], t1)

    mh = cfg.curate.dedup.minhash
    clustering = None
    if mh.enabled:
        t1 = time.perf_counter()
        scores = [s for r in results for s in r.get("scores", [])] if mh.survivor == "quality" else None
        # exact Jaccard check of candidate pairs: the verifier reads the texts from the part files
        # itself (in the clustering's Ray tasks on the Ray path); document pos is ids[alive[pos]]
        verify = (JaccardVerifier(part_texts(results), mh.verify_threshold, mh.ngram, index=alive)
                  if mh.verify else None)
        roots, clustering = cluster_signatures(  # prints the memory estimate first
            [sigs[i] for i in alive], mh.bands, mh.rows, method=clustering_method(mh, len(alive)),
            work_dir=parts_dir, partitions=mh.partitions, verify=verify,
            scores=[scores[i] for i in alive] if scores else None)
        dedup_step("minhash_dedup", [None if roots[pos] == pos else ids[alive[roots[pos]]]
                                     for pos in range(len(alive))], t1)

    mh_index = None
    if mh.enabled and mh.index_dir:  # against the documents earlier runs kept (continued pretraining)
        t1 = time.perf_counter()
        mh_index = MinHashIndex.open(mh.index_dir, mh.bands, mh.rows, mh.seed, mh.scheme, mh.hash)
        dedup_step("minhash_index", mh_index.add([ids[i] for i in alive], [sigs[i] for i in alive]), t1)

    removed = {d[0] for d in dedup_drops}
    dedup = dedup_report(ids, [x for r in results for x in r.get("doc_sources", [])],
                         [(d[0], d[1], d[3]) for d in dedup_drops], signatures=dict(zip(ids, sigs)),
                         ngram=mh.ngram)
    wanted, example_texts = example_ids(dedup), {}
    languages_out: Counter = Counter()
    sources_out: Counter = Counter()
    bytes_out = 0
    dropped_path = out_dir / "dropped.jsonl"
    with AtomicJsonlWriter(dropped_path) as dw:
        for r in results:
            for doc_id, step, reason in r["dropped"]:
                dw.write({"id": doc_id, "step": step, "reason": reason})
        for doc_id, step, reason, dup_of in dedup_drops:
            dw.write({"id": doc_id, "step": step, "reason": reason, "duplicate_of": dup_of})
    with ShardWriter(out_dir, prefix="shard", shard_docs=cfg.curate.shard_docs) as writer:
        for r in results:
            for doc in iter_docs(r["parts"]):
                if doc["id"] in wanted:
                    example_texts[doc["id"]] = doc["text"]
                if doc["id"] in removed:
                    continue
                writer.write(doc)
                languages_out[doc.get("language")] += 1
                sources_out[doc.get("source") or ""] += 1
                bytes_out += len(doc["text"].encode("utf-8"))

    dropped: Counter = Counter()
    for st in steps:
        dropped.update(st.dropped)
    docs_out = writer.docs_written
    if docs_out + sum(dropped.values()) != docs_in:
        raise RuntimeError(f"curate accounting broken: {docs_in} in, {docs_out} out, {dict(dropped)} dropped")
    if mh_index is not None:  # only once this run's output is complete
        mh_index.save(mh.index_dir)

    # PII and decontamination reports
    pii_repl: dict[str, Counter] = {}
    pii_changed: Counter = Counter()
    hits: list[dict] = []
    for r in results:
        extras = r.get("extras", {})
        for src, counts in extras.get("pii", {}).get("replacements", {}).items():
            pii_repl.setdefault(src, Counter()).update(counts)
        pii_changed.update(extras.get("pii", {}).get("docs_changed", {}))
        hits += extras.get("decontam", [])
    by_kind: Counter = Counter()
    for c in pii_repl.values():
        by_kind.update(c)
    pii = {"replacements": {s: dict(sorted(c.items())) for s, c in sorted(pii_repl.items())},
           "by_kind": dict(sorted(by_kind.items())), "docs_changed": dict(sorted(pii_changed.items())),
           "policies": policies}
    decontam = None
    if index is not None:
        per_bench = Counter(r.split(":", 1)[1] for r in dropped.elements() if r.startswith("decontam:"))
        items_hit: dict[str, set] = {}
        for h in hits:
            items_hit.setdefault(h["benchmark"], set()).add(h["item"])
        report = {"index": {k: v for k, v in index.stats.items() if k != "build_seconds"},
                  "docs_dropped": dict(sorted(per_bench.items())),
                  "items_hit": {b: sorted(v) for b, v in sorted(items_hit.items())},
                  "hits": hits}
        report_path = out_dir / DECONTAM_REPORT
        _atomic_write_bytes(report_path, (json.dumps(report, indent=1, sort_keys=True) + "\n").encode())
        decontam = {"docs_dropped": report["docs_dropped"],
                    "items_hit": {b: len(v) for b, v in report["items_hit"].items()},
                    "report": str(report_path), "index_ngrams": len(index),
                    "index_build_seconds": index.stats["build_seconds"]}
    summary = {
        "docs_in": docs_in,
        "docs_out": docs_out,
        "bytes_out": bytes_out,
        "dropped": dict(sorted(dropped.items())),
        "steps": [st.to_dict() for st in steps],
        "languages": dict(languages.most_common()),
        "languages_out": {str(k): v for k, v in languages_out.most_common()},
        "sources": {s: {"docs_in": sources_in.get(s, 0), "docs_out": sources_out.get(s, 0)}
                    for s in sorted(set(sources_in) | set(sources_out))},
        "pii": pii,
        "decontam": decontam,
        "dedup": {**add_text_jaccard(dedup, example_texts, mh.ngram), "clustering": clustering},
        "shards": [str(p) for p in writer.paths],
        "dropped_file": str(dropped_path),
        "jobs": len(jobs),
        "workers": min(cluster_cpus(), len(todo)) if todo else 0,
    }
    from tasks.curate.card import write_dataset_card

    summary["dataset_card"] = str(write_dataset_card(cfg, summary, out_dir / DATASET_CARD))
    summary["manifest"] = str(out_dir / MANIFEST)
    _write_manifest(out_dir, run_key, summary)
    shutil.rmtree(parts_dir, ignore_errors=True)
    summary["resumed_jobs"] = resumed
    summary["timings"] = {"decontam_index_s": round(index_seconds, 3), "map_s": round(map_seconds, 3),
                          "map_docs_per_s": round(sum(done[j[2]]["docs_in"] for j in todo) / map_seconds, 1)
                          if todo and map_seconds > 0 else None}
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary
