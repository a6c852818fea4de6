"""`run_quality`: the model-based quality stage of the pretrain flow, after curation.

1. Models (`ensure_models`): the fastText classifier and/or the KenLM model are trained, or
   reused: each lives in `<model_dir>/<kind>-<key>/`, key = sha256 of its training config
   (fields that only affect scoring, such as the threshold, excluded) and of the content of
   every training file (the reference corpus, the crawl negatives). A later run with the same
   key reuses the model after checking its recorded sha256; training writes to a temp
   directory renamed into place, so a killed run never leaves half a model behind.
2. Scoring (`tasks.quality.score.score_shards`): Ray actors, one per CPU, each loading the
   models once, score every document; then the classifier keeps documents at or above its
   threshold (or the top `keep_top_fraction`) and KenLM buckets each document head / middle /
   tail against its own source's percentiles and drops the configured buckets
   (`kenlm.drop_buckets`; empty: tag only).
3. Output: the kept documents, in input order, as `shard-00000.parquet`, ... (document schema
   unchanged); `scores.parquet` with one row per input document {id, source, quality_score,
   perplexity, kenlm_bucket, keep}; `dropped.jsonl` with {"id", "step", "reason"} per dropped
   document. docs_in == docs_out + sum(dropped) (checked).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.config import PipelineConfig
from tasks.core.documents import AtomicJsonlWriter, ShardWriter, count_docs, iter_docs
from tasks.core.executor import clear_stale_output
from tasks.core.hashing import sha256_file
from tasks.core.storage import local_run_root
from tasks.quality.overlap import overlap_counter, reference_patterns
from tasks.quality.text import resolve

# Fields that change how documents are scored or kept, not the trained model.
CLASSIFIER_SCORING_FIELDS = {"enabled", "threshold", "keep_top_fraction"}
KENLM_SCORING_FIELDS = {"enabled", "head_percentile", "tail_percentile", "drop_buckets", "bin_dir"}
DROPPED, SCORES = "dropped.jsonl", "scores.parquet"
SCORES_SCHEMA = pa.schema([
    pa.field("id", pa.string()), pa.field("source", pa.string()), pa.field("quality_score", pa.float64()),
    pa.field("perplexity", pa.float64()), pa.field("kenlm_bucket", pa.string()), pa.field("keep", pa.bool_()),
])


def model_dir(cfg: PipelineConfig) -> Path:
    return Path(cfg.quality.model_dir or local_run_root(cfg) / "quality-models").resolve()


def training_files(patterns: list[str], data_root: str | Path) -> list[dict]:
    """The files a model trains on, each with its content hash."""
    return [{"path": str(p.resolve()), "sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in resolve(patterns, data_root)]


def _key(config: dict, files: dict[str, list[dict]]) -> str:
    body = {"config": config, "files": {k: [f["sha256"] for f in v] for k, v in files.items()}}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def classifier_key(cfg: PipelineConfig) -> tuple[str, dict[str, list[dict]]]:
    c = cfg.quality.classifier
    files = {"positives": training_files(c.positives, cfg.data_root),
             "negatives": training_files(c.negatives, cfg.data_root)}
    return _key(c.model_dump(mode="json", exclude=CLASSIFIER_SCORING_FIELDS), files), files


def kenlm_key(cfg: PipelineConfig) -> tuple[str, dict[str, list[dict]]]:
    k = cfg.quality.kenlm
    files = {"reference": training_files(k.reference, cfg.data_root)}
    return _key(k.model_dump(mode="json", exclude=KENLM_SCORING_FIELDS), files), files


def _reusable(final: Path, info_name: str, model_name: str) -> dict | None:
    info_path, model = final / info_name, final / model_name
    if not (info_path.is_file() and model.is_file()):
        return None
    try:
        info = json.loads(info_path.read_text())
    except ValueError:
        return None
    return info if info.get("sha256") == sha256_file(model) else None


def _train_into(final: Path, info_name: str, model_name: str, train) -> dict:
    """Train into a temp dir next to `final`, record the model's sha256, rename into place."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        info = train(tmp)
        info["model"] = str(final / model_name)  # where it will live
        info["sha256"] = sha256_file(tmp / model_name)
        (tmp / info_name).write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return json.loads((final / info_name).read_text())


def _ensure(cfg: PipelineConfig, kind: str, key: str, files: dict, info_name: str, model_name: str, train) -> dict:
    final = model_dir(cfg) / f"{kind}-{key[:16]}"
    final.parent.mkdir(parents=True, exist_ok=True)
    info = _reusable(final, info_name, model_name) if cfg.quality.reuse_models else None
    reused = info is not None
    if info is None:
        info = _train_into(final, info_name, model_name, train)
    model = final / model_name
    return {**info, "model": str(model), "key": key, "reused": reused, "dir": str(final),
            "training_files": [f for fs in files.values() for f in fs]}


def ensure_models(cfg: PipelineConfig) -> dict:
    """Train or reuse the enabled quality models; {"classifier": info, "kenlm": info} (enabled ones)."""
    from tasks.quality.classifier import train_classifier
    from tasks.quality.kenlm_lm import train_kenlm

    q = cfg.quality
    out: dict = {}
    if q.classifier.enabled:
        key, files = classifier_key(cfg)

        def train(d: Path) -> dict:
            m = train_classifier(q.classifier, cfg.data_root, d)
            m.pop("quantized", None)
            return m

        out["classifier"] = _ensure(cfg, "classifier", key, files, "metrics.json", "quality.bin", train)
        ftz = Path(out["classifier"]["dir"]) / "quality.ftz"
        out["classifier"]["quantized"] = str(ftz) if ftz.is_file() else None
    if q.kenlm.enabled:
        key, files = kenlm_key(cfg)

        def train_lm(d: Path) -> dict:
            return train_kenlm(q.kenlm, cfg.data_root, d)

        out["kenlm"] = _ensure(cfg, "kenlm", key, files, "kenlm.json", "kenlm.binary", train_lm)
    return out


def run_quality(cfg: PipelineConfig, in_shards: list[Path], out_dir: Path) -> dict:
    """Score and filter `in_shards` into `out_dir`; returns the stage summary (see module doc)."""
    from tasks.quality.score import score_shards

    t0 = time.perf_counter()
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = [str(Path(s).resolve()) for s in in_shards]
    if not cfg.quality.enabled:
        n = count_docs(shards)
        return {"enabled": False, "docs_in": n, "docs_out": n, "dropped": {}, "steps": [], "shards": shards,
                "models": {}, "seconds": round(time.perf_counter() - t0, 3)}
    clear_stale_output(out_dir)

    t_train = time.perf_counter()
    models = ensure_models(cfg)
    train_s = time.perf_counter() - t_train
    clf, lm = models.get("classifier"), models.get("kenlm")
    t_score = time.perf_counter()
    records, decided = score_shards(cfg, shards, model_path=clf["model"] if clf else None,
                                    kenlm_path=lm["model"] if lm else None)
    score_s = time.perf_counter() - t_score

    dropped = _write_decisions(records, decided, out_dir)
    kept = _write_kept(cfg, shards, records, out_dir)
    docs_in, docs_out = len(records), kept.docs_out
    if docs_out + sum(dropped.values()) != docs_in:
        raise RuntimeError(f"quality accounting broken: {docs_in} in, {docs_out} out, {dict(dropped)} dropped")
    for w in kept.overlap["warnings"]:
        print(f"[quality] WARNING: {w}", file=sys.stderr, flush=True)
    summary = {
        "enabled": True,
        "docs_in": docs_in,
        "docs_out": docs_out,
        "bytes_out": kept.bytes_out,
        "dropped": dict(sorted(dropped.items())),
        "steps": decided["steps"],
        "classifier_threshold": decided.get("classifier_threshold"),
        "perplexity_cutoffs": decided.get("perplexity_cutoffs"),
        "nodes": decided.get("nodes", {}),  # scoring jobs run per Ray node
        "buckets": dict(sorted(Counter(r["kenlm_bucket"] for r in records if "kenlm_bucket" in r).items())),
        "sources": {s: {"docs_in": c["docs_in"], "docs_out": c["docs_out"]} for s, c in sorted(kept.sources.items())},
        "models": models,
        "reference_overlap": kept.overlap,
        "shards": kept.shards,
        "dropped_file": str(out_dir / DROPPED),
        "scores_file": str(out_dir / SCORES),
        "timings": {"models_s": round(train_s, 3), "score_s": round(score_s, 3),
                    "score_docs_per_s": round(docs_in / score_s, 1) if score_s > 0 else None},
        "seconds": round(time.perf_counter() - t0, 3),
    }
    summary["metrics"] = quality_metrics(summary)
    return summary


def _write_decisions(records: list[dict], decided: dict, out_dir: Path) -> Counter:
    """`dropped.jsonl` (step and reason per dropped document) and `scores.parquet` (every
    document's scores and decision); returns the drops per reason."""
    dropped: Counter = Counter()
    for st in decided["steps"]:
        dropped.update(st["dropped"])
    step_of = {r["id"]: _drop_reason(r, decided) for r in records if not r["keep"]}
    with AtomicJsonlWriter(out_dir / DROPPED) as dw:
        for doc_id, (step, reason) in step_of.items():
            dw.write({"id": doc_id, "step": step, "reason": reason})
    pq.write_table(pa.Table.from_pylist(
        [{k: r.get(k) for k in SCORES_SCHEMA.names} for r in records], schema=SCORES_SCHEMA),
        out_dir / SCORES, compression="zstd")
    return dropped


@dataclass
class _Kept:
    shards: list[str]
    docs_out: int
    bytes_out: int
    sources: dict[str, Counter]  # source -> docs_in, docs_out
    overlap: dict  # `overlap_counter`'s result: the corpus's 13-gram overlap with the reference texts


def _write_kept(cfg: PipelineConfig, shards: list[str], records: list[dict], out_dir: Path) -> _Kept:
    """The kept documents, in input order, as `shard-*.parquet`; counts per source and the
    overlap of the corpus with the KenLM/classifier reference texts, in the same pass."""
    by_id = {r["id"]: r for r in records}
    sources: dict[str, Counter] = {}
    bytes_out = 0
    patterns = reference_patterns(cfg)
    overlaps = overlap_counter(cfg, training_files(patterns, cfg.data_root), model_dir(cfg))
    with ShardWriter(out_dir, prefix="shard", shard_docs=cfg.curate.shard_docs) as writer:
        for doc in iter_docs(shards):
            if overlaps is not None:
                overlaps.add(doc.get("source"), doc["text"])
            c = sources.setdefault(doc.get("source") or "", Counter())
            c["docs_in"] += 1
            if by_id[doc["id"]]["keep"]:
                writer.write(doc)
                c["docs_out"] += 1
                bytes_out += len(doc["text"].encode("utf-8"))
    overlap = overlaps.result(patterns) if overlaps is not None else {"sources": {}, "warnings": []}
    return _Kept([str(p) for p in writer.paths], writer.docs_written, bytes_out, sources, overlap)


def _drop_reason(rec: dict, decided: dict) -> tuple[str, str]:
    thr = decided.get("classifier_threshold")
    if "quality_score" in rec and thr is not None and rec["quality_score"] < thr:
        return "quality_classifier", "quality_classifier"
    return "kenlm", f"kenlm_{rec.get('kenlm_bucket')}"


def quality_metrics(summary: dict) -> dict[str, float]:
    """Flat numbers for MLflow: the classifier's held-out P/R/AUC, model sizes, training time."""
    out: dict[str, float] = {}
    clf = summary["models"].get("classifier")
    if clf:
        for k in ("precision", "recall", "f1", "roc_auc", "accuracy"):
            if clf.get("heldout", {}).get(k) is not None:
                out[f"classifier_heldout_{k}"] = clf["heldout"][k]
        out["classifier_model_bytes"] = clf.get("model_bytes", 0)
        out["classifier_train_docs"] = clf.get("train_docs", 0)
        out["classifier_reused"] = int(clf["reused"])
    lm = summary["models"].get("kenlm")
    if lm:
        out["kenlm_model_bytes"] = lm.get("model_bytes", 0)
        out["kenlm_train_tokens"] = lm.get("tokens", 0)
        out["kenlm_reused"] = int(lm["reused"])
    if summary.get("classifier_threshold") is not None:
        out["classifier_threshold"] = summary["classifier_threshold"]
    overlap = summary.get("reference_overlap", {}).get("sources", {})
    if overlap:
        out["reference_overlap_max_fraction"] = max(s["fraction"] for s in overlap.values())
    return out
