"""The quality stage: fastText classifier and KenLM scores over the curated corpus."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

from tasks.config import PipelineConfig
from tasks.core.sections import Reads
from tasks.core.stage import DocumentsResult, Stage, Table
from tasks.lineage import dataset_for_path
from tasks.lineage.outputs import DATASET_DOCS, optional_output, shard_output, training_data_source
from tasks.tracking import Tracker


class QualityStage(Stage):
    name, task, flow = "quality", "quality_filter", "curate"
    doc = ("Train (or reuse, by content hash) the fastText quality classifier and the KenLM model, score every "
           "curated document on Ray workers and keep those passing the classifier threshold and KenLM buckets.")
    result_type = DocumentsResult

    def run(self, cfg: Annotated[PipelineConfig, Reads("sources", "quality", "curate", "ray", "storage")],
            inputs, ctx) -> DocumentsResult:
        from tasks.quality.run import run_quality

        data = run_quality(cfg, [Path(p) for p in inputs.shards], ctx.stage_dir(self.name))
        models = data["models"]
        training_files = {f["path"]: f for m in models.values() for f in m["training_files"]}
        read = [dataset_for_path(f["path"], doc=DATASET_DOCS["quality_reference"],
                                 source=training_data_source(cfg, f["path"])) for f in training_files.values()]
        outputs = [shard_output(cfg, p, DATASET_DOCS["quality_shard"]) for p in data["shards"] if data["enabled"]]
        outputs += optional_output(data.get("scores_file"), DATASET_DOCS["quality_scores"])
        outputs += optional_output(data.get("dropped_file"), DATASET_DOCS["quality_dropped"])
        outputs += [dataset_for_path(m["model"], output=True, doc=DATASET_DOCS[f"quality_{kind}"])
                    for kind, m in models.items()]
        if ctx.mlflow_run_id:
            log_quality_models(Tracker(ctx.tracking_uri, ctx.experiment), ctx.mlflow_run_id, data)
        return DocumentsResult(data, inputs=read, outputs=outputs, reports=quality_reports(data))


def quality_reports(data: dict) -> list:
    if not data["enabled"]:
        return []
    rows = [{"step": s["name"], "docs_in": s["docs_in"], "docs_out": s["docs_out"],
             "dropped": sum(s["dropped"].values())} for s in data["steps"]]
    rows += [{"step": f"model: {kind}", "docs_in": None, "docs_out": None,
              "dropped": None, **{k: m.get("heldout", {}).get(k) for k in ("precision", "recall", "roc_auc")},
              "reused": m["reused"], "sha256": m["sha256"][:12]} for kind, m in data["models"].items()]
    return [Table("quality-steps", rows, "Model-based quality: documents per step and the models used")]


def log_quality_models(tracker: Tracker, run_id: str, data: dict) -> None:
    """Held-out P/R/AUC as metrics; the models (path, sha256, reused) as params and, when small, artifacts."""
    tracker.log_metrics(run_id, data.get("metrics", {}))
    for kind, m in data["models"].items():
        tracker.log_params(run_id, {f"{kind}.model": m["model"], f"{kind}.sha256": m["sha256"],
                                    f"{kind}.key": m["key"], f"{kind}.reused": m["reused"]})
        if Path(m["model"]).stat().st_size <= 64 << 20:
            tracker.log_artifact(run_id, m["model"], f"quality/{kind}")
        info = Path(m["dir"]) / ("metrics.json" if kind == "classifier" else "kenlm.json")
        if info.is_file():
            tracker.log_artifact(run_id, info, f"quality/{kind}")
