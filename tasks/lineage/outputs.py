"""Lineage datasets the stages hand to the wrapper: document shards with the raw sources they came
from, optional side files, and the licence entries of files outside the source registry."""
from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

from tasks.config import PipelineConfig
from tasks.lineage.emitter import dataset_for_path
from tasks.lineage.facets import CrucibleSourceDatasetFacet, parquet_values

# What each artifact is (the `documentation` dataset facet).
DATASET_DOCS = {
    "plan": "The training run priced by the scaling-law planner (tasks/plan): parameters, token budget, FLOPs, "
            "GPU hours, cost, checkpoint size and parallel layout, as JSON.",
    "raw": "Raw input file of source {source} ({format}) from the config's source registry.",
    "ingest_shard": "Ingested documents: text extracted from the raw records, NFC/whitespace normalised, one row per "
                    "document with its source, licence, URL and raw-file offset (Parquet, tasks/core/documents.py).",
    "quarantine": "Raw records set aside during ingest (unreadable or oversized), one JSON object per record with "
                  "the reason.",
    "curated_shard": "Curated documents: ingested documents that passed language ID, quality, repetition, "
                     "decontamination and deduplication filters, PII redacted (Parquet, same schema as ingest).",
    "dropped": "Documents removed by curation, one JSON object per document with the filter that removed it.",
    "quality_shard": "Quality-filtered documents: curated documents kept by the fastText quality classifier and the "
                     "KenLM perplexity buckets (Parquet, same schema as ingest).",
    "quality_scores": "Per-document quality scores of the curated corpus: classifier score, KenLM perplexity, "
                      "bucket and keep decision (Parquet).",
    "quality_dropped": "Documents removed by the quality stage, one JSON object per document with the reason.",
    "quality_classifier": "fastText quality classifier (reference corpus vs raw crawl) trained by the quality stage.",
    "quality_kenlm": "KenLM n-gram model (binary) trained on the normalised reference corpus by the quality stage.",
    "quality_reference": "Training file of the quality models (reference corpus or raw-crawl negatives).",
    "tokenizer": "Byte-level BPE tokenizer (Hugging Face tokenizers JSON) trained on the curated shards.",
    "tokenizer_report": "Tokenizer validation report: bytes per token per source and language on held-out documents, "
                        "round trip of every held-out document, code/maths/non-Latin-script behaviour vs a reference.",
    "tokens_index": "Index of the packed token shards: splits, token counts, dtype and the tokenizer used.",
    "tokens_mix": "Index of a continued-pretraining cycle's training mix: the cycle's new tokens plus documents "
                  "replayed from earlier cycles' token shards (the pool), with token counts by origin.",
    "yardstick": "The pinned evaluation set of a continued-pretraining gate: held-out documents of earlier cycles, "
                 "of this cycle and WikiText-2 pages, scored in bits per byte for champion and challenger (JSONL).",
    "tokens_split": "Packed token ids of the {split} split (flat binary array, see index.json for the dtype).",
    "eval_report": "Evaluation report of checkpoint {checkpoint}: validation loss, perplexity, task-suite scores and "
                   "sample generations (JSON).",
    "ablation": "Result of the curation ablation: held-out loss of each arm, corpus sizes, token budget (JSON).",
    "model_version": "Registered MLflow model version {name}/{version}: the checkpoint that passed the deployment "
                     "gate, served by the model server.",
    "served_model": "Model {name} served by the OpenAI-compatible model server at {endpoint}; its dataset version is "
                    "the registered model version being served ({version}).",
    "dedup_index": "Persistent MinHash dedup index (tasks/dedup/index.py): LSH band keys of every document kept by "
                   "earlier curate runs, which each run reads to drop near-duplicates and writes with its own kept "
                   "documents added; its version is the index generation (one per curate run that saved it).",
}


def source_entry(cfg: PipelineConfig, name: str) -> dict:
    """The licence entry of a registered source."""
    src = next(s for s in cfg.sources if s.name == name)
    return {"name": src.name, "licence": src.licence, "provenance": src.provenance}


def shard_sources(cfg: PipelineConfig, shard: str | Path) -> CrucibleSourceDatasetFacet | None:
    """The raw sources of one document shard, from its `source` column (None: unknown, so the
    emitter falls back to the union over the stage's inputs)."""
    known = {s.name for s in cfg.sources}
    names = [n for n in parquet_values(shard, "source") if n in known]
    if not names:
        return None
    return CrucibleSourceDatasetFacet.union(
        {"source": n, "licence": e["licence"], "provenance": e["provenance"]}
        for n in names for e in [source_entry(cfg, n)])


def shard_output(cfg: PipelineConfig, path: str, doc: str):
    return dataset_for_path(path, output=True, doc=doc, source=shard_sources(cfg, path))


def optional_output(path: str | None, doc: str) -> list:
    """An extra output file (quarantine, dropped documents) if the stage wrote it."""
    return [dataset_for_path(path, output=True, doc=doc)] if path and Path(path).is_file() else []


def dedup_index_dataset(index_dir: str | Path | None, output: bool = False):
    """The MinHash dedup index as it is now (None: no index there), versioned by its generation:
    hashing gigabytes of band keys each cycle would cost more than the dedup itself."""
    import json

    if not index_dir or not (Path(index_dir) / "meta.json").is_file():
        return None
    d = Path(index_dir).resolve()
    meta = json.loads((d / "meta.json").read_text())
    generation = int(meta.get("generation", 0))
    files = [p for p in (d / f"gen-{generation:06d}").glob("*") if p.is_file()]
    return dataset_for_path(d, output=output, rows=meta.get("docs"), n_bytes=sum(p.stat().st_size for p in files),
                            doc=DATASET_DOCS["dedup_index"], inspect=False, version=f"gen-{generation:06d}")


def training_data_source(cfg: PipelineConfig, path: str) -> dict | None:
    """The licence entry (quality.training_data) of a file the quality models trained on."""
    for entry in cfg.quality.training_data:
        if fnmatch(str(Path(path).resolve()), str(Path(cfg.resolve_uri(entry.pattern)).resolve())):
            return {"name": entry.name, "licence": entry.licence, "provenance": entry.provenance}
    return None
