"""Score Parquet shards with the quality models, Ray-parallel, each model loaded once per worker.

`score_shards(cfg, shards, model_path=None, kenlm_path=None)` runs one `QualityWorker` actor per
CPU (`tasks.core.executor`); a job is one Parquet row group; each worker loads the fastText and/or KenLM
model once. Returns, in shard/row order, one record per document:
{"id", "source", "quality_score"?, "perplexity"?, "kenlm_bucket"?, "keep"} plus a summary:
per-source perplexity cut-offs (`kenlm.head_percentile`/`tail_percentile`), the classifier
threshold actually used (from `keep_top_fraction` when set), and StepStats per step
("quality_classifier", "kenlm") from the step loop of the curate filters (`tasks.core.steps`).
`score_docs` does the same for an in-memory list (no Ray).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from tasks.config import PipelineConfig, QualityConfig
from tasks.core.documents import iter_doc_batches
from tasks.core.executor import Job, JobRunner, RayActors
from tasks.core.steps import StepStats, decide_all
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
        out: list[dict] = []
        for batch in iter_doc_batches([shard], batch_size=self.cfg.batch_docs, columns=["id", "text", "source"],
                                      row_groups=row_groups):
            out.extend(self.score_batch(batch))
        return out


def shard_jobs(shards: Sequence[str]) -> list[Job]:
    """One job per Parquet row group, in corpus order, so one shard still spreads over all workers."""
    import pyarrow.parquet as pq

    groups = [(s, [rg]) for s in shards for rg in range(pq.ParquetFile(s).metadata.num_row_groups)]
    return [Job(f"{k:05d}", None, args) for k, args in enumerate(groups)]


def _decide_step(name: str, records: list[dict], drop_reason) -> tuple[StepStats, list[dict]]:
    """One decision step over score records (`drop_reason(record)`: None keeps it, else the
    reason); a dropped record gets "keep": False. Returns the stats and the kept records."""
    def drop(record: dict, reason: str) -> None:
        record["keep"] = False

    return decide_all(name, records, drop_reason, size=lambda r: r["bytes"], on_drop=drop)


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
        st, alive = _decide_step("quality_classifier", alive, lambda r: "quality_classifier"
                                 if thr is not None and r["quality_score"] < thr else None)
        steps.append(st)
    if records and "perplexity" in records[0]:
        k = cfg.kenlm
        cuts = percentile_cutoffs([r["perplexity"] for r in records], [r["source"] for r in records],
                                  k.head_percentile, k.tail_percentile)
        summary["perplexity_cutoffs"] = cuts
        for r in records:
            r["kenlm_bucket"] = bucket_of(r["perplexity"], cuts[r["source"]]) if r["source"] in cuts else "tail"
        st, alive = _decide_step("kenlm", alive, lambda r: f"kenlm_{r['kenlm_bucket']}"
                                 if r["kenlm_bucket"] in k.drop_buckets else None)
        steps.append(st)
    for r in alive:
        r["keep"] = True
    for st in steps:
        st.seconds = time.perf_counter() - t0  # each step reports the whole decision, cut-offs included
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
    shards = [str(Path(s).resolve()) for s in shards]
    jobs = shard_jobs(shards)
    actors = RayActors(QualityWorker, (cfg.quality, str(model_path) if model_path else None,
                                       str(kenlm_path) if kenlm_path else None), "score_shard", cfg.ray)
    per_job: dict[str, list[dict]] = {}
    with JobRunner(actors) as runner:
        for job in jobs:
            runner.submit(job)
        for job, records in runner.finished():
            per_job[job.name] = records
    records = [r for job in jobs for r in per_job[job.name]]
    return records, {**decide(records, cfg.quality), "nodes": runner.node_report()}
