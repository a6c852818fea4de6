"""The tokenizer stage: byte-level BPE trained on the curated corpus, with its validation report."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from tasks.config import PipelineConfig
from tasks.core.sections import Reads
from tasks.core.stage import Markdown, Stage, Table, TokenizerResult
from tasks.lineage import dataset_for_path
from tasks.lineage.outputs import DATASET_DOCS
from tasks.tracking import Tracker


class TokenizerStage(Stage):
    name, task, flow = "tokenizer", "train_bpe", "train_tokenizer"
    doc = "Train a byte-level BPE tokenizer (Hugging Face tokenizers) on the curated shards."
    result_type = TokenizerResult

    def run(self, cfg: Annotated[PipelineConfig, Reads("tokenizer")], inputs, ctx) -> TokenizerResult:
        from tasks.tokenizer import TokenizerValidationError, train_tokenizer

        out_dir = ctx.stage_dir(self.name)
        try:
            data = train_tokenizer(cfg, [Path(p) for p in inputs.shards], out_dir)
        except TokenizerValidationError as e:
            e.reports = publish_report(ctx, out_dir)  # the failing report is what to read
            raise
        outputs = [dataset_for_path(data["path"], output=True, doc=DATASET_DOCS["tokenizer"]),
                   dataset_for_path(data["report_path"], output=True, doc=DATASET_DOCS["tokenizer_report"])]
        return TokenizerResult(data, outputs=outputs, reports=publish_report(ctx, out_dir))


def publish_report(ctx, out_dir: Path) -> list:
    """The validation report as MLflow metrics/artifacts; returned as a markdown + table report."""
    from tasks.tokenizer.bpe import REPORT_FILE, REPORT_MARKDOWN
    from tasks.tokenizer.report import compression_rows, report_metrics

    report_path, md_path = Path(out_dir) / REPORT_FILE, Path(out_dir) / REPORT_MARKDOWN
    if not report_path.is_file():
        return []
    report = json.loads(report_path.read_text())
    if ctx.mlflow_run_id:
        tracker = Tracker(ctx.tracking_uri, ctx.experiment)
        tracker.log_metrics(ctx.mlflow_run_id, report_metrics(report))
        tracker.log_artifact(ctx.mlflow_run_id, report_path, "tokenizer")
        tracker.log_artifact(ctx.mlflow_run_id, md_path, "tokenizer")
    return [Markdown("tokenizer-report", md_path.read_text(),
                     "Tokenizer validation: compression, round trip, code/maths/scripts vs reference"),
            Table("tokenizer-compression", compression_rows(report),
                  "Bytes per token per slice and probe, crucible vs reference tokenizer")]
