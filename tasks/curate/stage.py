"""The curate stage: language ID, heuristic filters, decontamination, PII, exact and MinHash dedup."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

from tasks.config import PipelineConfig
from tasks.core.sections import Reads
from tasks.core.stage import DocumentsResult, Markdown, Stage, Table
from tasks.lineage.outputs import DATASET_DOCS, dedup_index_dataset, optional_output, shard_output
from tasks.tracking import Tracker


class CurateStage(Stage):
    name, task, flow = "curate", "filter_and_dedup", "curate"
    doc = ("Language ID, Gopher quality/repetition, C4 and FineWeb filters, decontamination, PII redaction, "
           "exact and MinHash deduplication of the ingested shards; dropped documents are listed in dropped.jsonl.")
    result_type = DocumentsResult

    def input_datasets(self, cfg, inputs) -> list:
        """The shards, and the MinHash index of earlier runs when this run dedups against one."""
        index = dedup_index_dataset(minhash_index_dir(cfg))
        return super().input_datasets(cfg, inputs) + ([index] if index else [])

    def run(self, cfg: Annotated[PipelineConfig, Reads("sources", "curate", "ray", "storage")],
            inputs, ctx) -> DocumentsResult:
        from tasks.curate import run_curate

        index_before = dedup_index_dataset(minhash_index_dir(cfg))
        data = run_curate(cfg, [Path(p) for p in inputs.shards], ctx.stage_dir(self.name),
                          progress=ctx.progress("row groups filtered"))
        outputs = [shard_output(cfg, p, DATASET_DOCS["curated_shard"]) for p in data["shards"]]
        outputs += optional_output(data.get("dropped_file"), DATASET_DOCS["dropped"])
        index_after = dedup_index_dataset(minhash_index_dir(cfg), output=True)
        if index_after and (index_before is None or index_after.facets["version"] != index_before.facets["version"]):
            outputs.append(index_after)  # this run saved a new generation (a resumed run may not have)
        if data.get("dedup") and ctx.mlflow_run_id:
            from tasks.dedup.report import report_metrics

            metrics = report_metrics(data["dedup"])
            if sub := data["dedup"].get("substring"):
                metrics.update({"dedup.substring.bytes_removed": sub["bytes_removed"],
                                "dedup.substring.docs_changed": sub["docs_changed"],
                                "dedup.substring.docs_dropped": sub["docs_dropped"]})
            Tracker(ctx.tracking_uri, ctx.experiment).log_metrics(ctx.mlflow_run_id, metrics)
        return DocumentsResult(data, outputs=outputs, reports=curation_reports(data))


def minhash_index_dir(cfg) -> str | None:
    """The persistent MinHash index this run reads and writes, as a local folder (one on an object
    store: its working copy, at the store's generation, named in lineage as the store's objects);
    None: no index in use."""
    from tasks.dedup.index import local_index_dir

    mh = cfg.curate.dedup.minhash
    return str(local_index_dir(mh.index_dir)) if mh.enabled and mh.index_dir else None


def curation_reports(data: dict) -> list:
    """Per-step counts, drop reasons, the dataset card and the dedup report: what a user checks first."""
    rows = [{"step": s["name"], "docs_in": s["docs_in"], "docs_out": s["docs_out"],
             "dropped": sum(s["dropped"].values()), "bytes_in": s["bytes_in"], "bytes_out": s["bytes_out"],
             "seconds": s["seconds"]} for s in data["steps"]]
    reasons = [{"reason": k, "docs": v} for k, v in sorted(data["dropped"].items(), key=lambda kv: -kv[1])]
    reports: list = [Table("curation-steps", rows, "Documents and bytes per curation step"),
                     Table("curation-drop-reasons", reasons, "Dropped documents by reason")]
    card = data.get("dataset_card")
    if card and Path(card).is_file():
        reports.append(Markdown("dataset-card", Path(card).read_text(), "Dataset card of the curated corpus"))
    if data.get("dedup"):
        from tasks.dedup.report import report_markdown, report_tables

        tables = report_tables(data["dedup"])
        reports += [Table("dedup-by-source", tables["by_source"], "Duplicate rate per source"),
                    Table("dedup-cluster-sizes", tables["cluster_sizes"],
                          "Clusters by number of documents (1: kept documents without copies)"),
                    Markdown("dedup-report", report_markdown(data["dedup"]),
                             "Duplicates per source, cluster sizes, example pairs with their Jaccard")]
    if data.get("line_dedup"):
        rows = [{"source": src, **v} for src, v in data["line_dedup"]["by_source"].items()]
        reports.append(Table("line-dedup-by-source", rows, "Lines and bytes removed by line dedup, per source"))
    if (data.get("dedup") or {}).get("substring"):
        rows = [{"source": src, **v} for src, v in data["dedup"]["substring"]["by_source"].items()]
        reports.append(Table("substring-dedup-by-source", rows,
                             "Exact-substring dedup: bytes and spans cut, documents dropped, per source"))
    return reports
