"""`run_curate`: ingested shards → language id → heuristic filters → exact + MinHash dedup.

1. Per input row group (ingest writes 500-row groups), on Ray actors (one per CPU, each loads
   the fastText model once):
   `run_filters` with the enabled filters (`filters.build_filters`), kept documents written to
   a part file; for every kept document the worker also returns its id, exact-dedup key,
   MinHash signature and size. Actor results come back in corpus order.
2. In the driver, over the whole corpus in shard/row order: exact dedup (first copy kept),
   then MinHash LSH clustering of the remaining documents (first document of each cluster kept).
3. The parts are streamed into `out_dir/shard-00000.parquet`, ... (`curate.shard_docs` rows
   each) without the deduplicated documents, and `out_dir/dropped.jsonl` gets one line per
   dropped document: {"id", "step", "reason"} (+ "duplicate_of" for dedup drops).

Summary: docs_in, docs_out, dropped {reason: n} (docs_out + sum(dropped) == docs_in), steps
(one `StepStats.to_dict()` per step, in order), languages (fastText label counts over every
document the language filter saw), languages_out (over the curated output), shards,
dropped_file, seconds. Memory in the driver is O(documents) for ids, keys and signatures
(112 × 4 bytes per document with the default 14×8 LSH).
"""
from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from tasks.config import CurateConfig, PipelineConfig
from tasks.core.documents import AtomicJsonlWriter, ShardWriter, iter_doc_batches, iter_docs
from tasks.core.ray_utils import cluster_cpus, init_ray
from tasks.core.steps import StepStats, run_filters
from tasks.dedup.exact import ExactDeduper, exact_key
from tasks.dedup.minhash import MinHasher, minhash_clusters


def filter_names(cfg: CurateConfig) -> list[str]:
    """Names of the enabled filter steps in the order `build_filters` runs them."""
    order = [("langid", cfg.langid.enabled), ("gopher_repetition", cfg.gopher_repetition.enabled),
             ("gopher_quality", cfg.gopher_quality.enabled), ("c4", cfg.c4.enabled),
             ("fineweb", cfg.fineweb.enabled)]
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
                 part_name: str, row_groups: list[int] | None = None, batch_size: int = 500) -> dict:
    """Filter one shard (or some of its row groups); write survivors to
    `<part_dir>/<part_name>-00000.parquet`."""
    stats: dict[str, StepStats] = {}
    dropped: list = []
    languages: Counter = Counter()
    ids, keys, sigs, nbytes = [], [], [], []
    docs_in = 0
    with ShardWriter(part_dir, prefix=part_name, shard_docs=1 << 40) as writer:
        for batch in _batches(shard, row_groups, batch_size):
            docs_in += len(batch)
            for doc in run_filters(batch, filters, stats, dropped):
                writer.write(doc)
                text = doc["text"]
                ids.append(doc["id"])
                keys.append(exact_key(text))
                sigs.append(hasher.signature(text) if hasher is not None else None)
                nbytes.append(len(text.encode("utf-8")))
            languages.update(d["language"] for d in batch if d.get("language"))
    return {
        "docs_in": docs_in, "stats": {k: v.to_dict() for k, v in stats.items()},
        "dropped": dropped, "ids": ids, "keys": keys, "sigs": sigs, "nbytes": nbytes,
        "languages": dict(languages), "parts": [str(p) for p in writer.paths],
    }


class CurateWorker:
    """Ray actor body: builds the filters (and loads the fastText model) once."""

    def __init__(self, cfg: CurateConfig):
        from tasks.curate.filters import build_filters

        self.filters = build_filters(cfg)
        mh = cfg.dedup.minhash
        self.hasher = MinHasher(mh.bands, mh.rows, mh.seed, mh.ngram) if mh.enabled else None

    def process(self, shard: str, part_dir: str, part_name: str, row_groups: list[int] | None = None) -> dict:
        return curate_shard(shard, self.filters, self.hasher, part_dir, part_name, row_groups)


def _jobs(shards: list[str], parts_dir: Path) -> list[tuple]:
    """One job per Parquet row group (ingest writes 500-row groups), in corpus order, so a
    corpus of one shard still spreads over all workers."""
    jobs = []
    for s in shards:
        for rg in range(pq.ParquetFile(s).metadata.num_row_groups):
            jobs.append((s, str(parts_dir), f"{len(jobs):05d}", [rg]))
    return jobs


def _map_shards(cfg: PipelineConfig, shards: list[str], parts_dir: Path) -> list[dict]:
    import ray
    from ray.util import ActorPool

    jobs = _jobs(shards, parts_dir)
    if not jobs:
        return []
    init_ray(cfg.ray)
    n = max(1, min(cluster_cpus(), len(jobs)))
    actor_cls = ray.remote(num_cpus=1)(CurateWorker)
    actors = [actor_cls.remote(cfg.curate) for _ in range(n)]
    try:
        pool = ActorPool(actors)
        return list(pool.map(lambda a, job: a.process.remote(*job), jobs))
    finally:
        for a in actors:
            ray.kill(a)


def run_curate(cfg: PipelineConfig, in_shards: list[Path], out_dir: Path) -> dict:
    t0 = time.perf_counter()
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("shard-*.parquet"):
        stale.unlink()
    parts_dir = out_dir / "_parts"
    shutil.rmtree(parts_dir, ignore_errors=True)
    parts_dir.mkdir()
    shards = [str(Path(s).resolve()) for s in in_shards]
    results = _map_shards(cfg, shards, parts_dir) if shards else []

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
    for r in results:
        languages.update(r["languages"])

    ids = [i for r in results for i in r["ids"]]
    keys = [k for r in results for k in r["keys"]]
    sigs = [s for r in results for s in r["sigs"]]
    nbytes = [b for r in results for b in r["nbytes"]]
    dedup_drops: list[tuple[str, str, str, str]] = []  # (id, step, reason, duplicate_of)
    alive = list(range(len(ids)))

    if cfg.curate.dedup.exact:
        st = StepStats("exact_dedup")
        ex, survivors = ExactDeduper(), []
        for i in alive:
            st.docs_in += 1
            st.bytes_in += nbytes[i]
            prev = ex.check(ids[i], keys[i])
            if prev is None:
                survivors.append(i)
                st.docs_out += 1
                st.bytes_out += nbytes[i]
            else:
                st.dropped["exact_dedup"] += 1
                dedup_drops.append((ids[i], "exact_dedup", "exact_dedup", prev))
        alive = survivors
        steps.append(st)

    mh = cfg.curate.dedup.minhash
    if mh.enabled:
        t1 = time.perf_counter()
        st = StepStats("minhash_dedup")
        roots = minhash_clusters([sigs[i] for i in alive], mh.bands, mh.rows, mh.seed,
                                 scheme=MinHasher(mh.bands, mh.rows, mh.seed, mh.ngram).scheme)
        survivors = []
        for pos, i in enumerate(alive):
            st.docs_in += 1
            st.bytes_in += nbytes[i]
            if roots[pos] == pos:
                survivors.append(i)
                st.docs_out += 1
                st.bytes_out += nbytes[i]
            else:
                st.dropped["minhash_dedup"] += 1
                dedup_drops.append((ids[i], "minhash_dedup", "minhash_dedup", ids[alive[roots[pos]]]))
        st.seconds = time.perf_counter() - t1
        alive = survivors
        steps.append(st)

    removed = {d[0] for d in dedup_drops}
    languages_out: Counter = Counter()
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
                if doc["id"] in removed:
                    continue
                writer.write(doc)
                languages_out[doc.get("language")] += 1
    shutil.rmtree(parts_dir, ignore_errors=True)

    dropped: Counter = Counter()
    for st in steps:
        dropped.update(st.dropped)
    docs_out = writer.docs_written
    if docs_out + sum(dropped.values()) != docs_in:
        raise RuntimeError(f"curate accounting broken: {docs_in} in, {docs_out} out, {dict(dropped)} dropped")
    return {
        "docs_in": docs_in,
        "docs_out": docs_out,
        "dropped": dict(sorted(dropped.items())),
        "steps": [st.to_dict() for st in steps],
        "languages": dict(languages.most_common()),
        "languages_out": {str(k): v for k, v in languages_out.most_common()},
        "shards": [str(p) for p in writer.paths],
        "dropped_file": str(dropped_path),
        "workers": min(cluster_cpus(), len(results)) if results else 0,
        "seconds": round(time.perf_counter() - t0, 3),
    }
