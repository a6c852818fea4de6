"""Score Parquet shards with the quality models, Ray-parallel, each model loaded once per worker.

`score_shards(cfg, shards, model_path=None, kenlm_path=None)` runs one `QualityWorker` actor per
CPU (`init_ray(cfg.ray)`); a job is one Parquet row group; each worker loads the fastText and/or KenLM
model once. Returns, in shard/row order, one record per document:
{"id", "source", "quality_score"?, "perplexity"?, "kenlm_bucket"?, "keep"} plus a summary:
per-source perplexity cut-offs (`kenlm.head_percentile`/`tail_percentile`), the classifier
threshold actually used (from `keep_top_fraction` when set), and StepStats per step
("quality_classifier", "kenlm") with the same accounting as the curate filters.
`score_docs` does the same for an in-memory list (no Ray).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from tasks.config import PipelineConfig, QualityConfig
from tasks.core.documents import iter_doc_batches
from tasks.core.steps import StepStats
from tasks.quality.classifier import QualityScorer, threshold_for_top_fraction
from tasks.quality.kenlm_lm import PerplexityScorer, bucket_of, percentile_cutoffs


class QualityWorker:
    """Ray actor body: the models are loaded once, in __init__."""

    def __init__(self, cfg: QualityConfig, model_path: str | None, kenlm_path: str | None):
        self.cfg = cfg
        self.clf = QualityScorer(model_path, cfg.classifier.max_chars) if model_path else None
        self.lm = PerplexityScorer(kenlm_path) if kenlm_path else None

    def score_batch(self, docs: Sequence[dict]) -> list[dict]:
        out = [{"id": d.get("id"), "source": d.get("source") or "*",
                "bytes": len(d["text"].encode("utf-8"))} for d in docs]
        if self.clf is not None:
            for rec, s in zip(out, self.clf.score([d["text"] for d in docs])):
                rec["quality_score"] = round(float(s), 5)
        if self.lm is not None:
            for rec, d in zip(out, docs):
                rec["perplexity"] = self.lm.perplexity(d["text"])
        return out

    def score_shard(self, shard: str, row_groups: list[int] | None = None) -> list[dict]:
        if row_groups is None:
            batches = iter_doc_batches([shard], batch_size=self.cfg.batch_docs, columns=["id", "text", "source"])
        else:
            batches = _row_group_batches(shard, row_groups, self.cfg.batch_docs)
        out: list[dict] = []
        for batch in batches:
            out.extend(self.score_batch(batch))
        return out


def _row_group_batches(shard: str, row_groups: list[int], batch_size: int):
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(shard)
    try:
        for batch in pf.iter_batches(batch_size=batch_size, row_groups=row_groups, columns=["id", "text", "source"]):
            yield batch.to_pylist()
    finally:
        pf.close()


def shard_jobs(shards: Sequence[str]) -> list[tuple[str, list[int]]]:
    """One job per Parquet row group, in corpus order, so one shard still spreads over all workers."""
    import pyarrow.parquet as pq

    return [(s, [rg]) for s in shards for rg in range(pq.ParquetFile(s).metadata.num_row_groups)]


def _run_step(name: str, records: list[dict], drop_reason) -> tuple[StepStats, list[dict]]:
    """One decision step over score records: `drop_reason(record)` is None to keep it, else the
    reason it is dropped (counted, and "keep" set False). Returns the stats and the kept records."""
    st, kept = StepStats(name), []
    for r in records:
        st.docs_in += 1
        st.bytes_in += r["bytes"]
        reason = drop_reason(r)
        if reason is not None:
            st.dropped[reason] += 1
            r["keep"] = False
        else:
            st.docs_out += 1
            st.bytes_out += r["bytes"]
            kept.append(r)
    return st, kept


def decide(records: list[dict], cfg: QualityConfig) -> dict:
    """Set "keep" (and "kenlm_bucket") on every record; returns the summary with StepStats."""
    t0 = time.perf_counter()
    summary: dict = {"steps": []}
    steps = []
    alive = list(records)
    if records and "quality_score" in records[0]:
        c = cfg.classifier
        thr = c.threshold
        if c.keep_top_fraction is not None:
            thr = threshold_for_top_fraction([r["quality_score"] for r in records], c.keep_top_fraction)
        summary["classifier_threshold"] = thr
        st, alive = _run_step("quality_classifier", alive,
                              lambda r: "quality_classifier" if thr is not None and r["quality_score"] < thr else None)
        steps.append(st)
    if records and "perplexity" in records[0]:
        k = cfg.kenlm
        cuts = percentile_cutoffs([r["perplexity"] for r in records], [r["source"] for r in records],
                                  k.head_percentile, k.tail_percentile)
        summary["perplexity_cutoffs"] = cuts
        for r in records:
            r["kenlm_bucket"] = bucket_of(r["perplexity"], cuts[r["source"]]) if r["source"] in cuts else "tail"
        st, alive = _run_step("kenlm", alive,
                              lambda r: f"kenlm_{r['kenlm_bucket']}" if r["kenlm_bucket"] in k.drop_buckets else None)
        steps.append(st)
    for r in alive:
        r["keep"] = True
    for st in steps:
        st.seconds += time.perf_counter() - t0
        assert st.balanced()
        summary["steps"].append(st.to_dict())
    summary["docs_in"], summary["docs_out"] = len(records), len(alive)
    return summary


def score_docs(docs: Sequence[dict], cfg: QualityConfig, model_path: str | Path | None = None,
               kenlm_path: str | Path | None = None) -> tuple[list[dict], dict]:
    w = QualityWorker(cfg, str(model_path) if model_path else None, str(kenlm_path) if kenlm_path else None)
    records = w.score_batch(docs)
    return records, decide(records, cfg)


def score_shards(cfg: PipelineConfig, shards: Sequence[str | Path], model_path: str | Path | None = None,
                 kenlm_path: str | Path | None = None) -> tuple[list[dict], dict]:
    import ray
    from ray.util import ActorPool

    from tasks.core.ray_utils import cluster_cpus, init_ray

    shards = [str(Path(s).resolve()) for s in shards]
    if not shards:
        return [], decide([], cfg.quality)
    init_ray(cfg.ray)
    jobs = shard_jobs(shards)
    n = max(1, min(cluster_cpus(), len(jobs)))
    actor_cls = ray.remote(num_cpus=1)(QualityWorker)
    actors = [actor_cls.remote(cfg.quality, str(model_path) if model_path else None,
                               str(kenlm_path) if kenlm_path else None) for _ in range(n)]
    try:
        pool = ActorPool(actors)
        per_shard = list(pool.map(lambda a, job: a.score_shard.remote(*job), jobs))
    finally:
        for a in actors:
            ray.kill(a)
    records = [r for rs in per_shard for r in rs]
    return records, decide(records, cfg.quality)
