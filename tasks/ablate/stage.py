"""The ablate stage: does curation help? The same model and token budget on two corpora."""
from __future__ import annotations

from typing import Annotated

from tasks.config import PipelineConfig
from tasks.core.sections import Reads
from tasks.core.stage import Markdown, Stage, StageResult, Table
from tasks.lineage import dataset_for_path
from tasks.lineage.outputs import DATASET_DOCS
from tasks.lineage.torchrun import checkpoint_output


class AblateStage(Stage):
    name, task, flow = "ablate", "ablate_curation", "ablate"
    doc = ("Curation ablation: train the same model with the same token budget on the langid-only and the fully "
           "curated corpus (one tokenizer) and compare their loss on clean held-out text.")

    def run(self, cfg: Annotated[PipelineConfig, Reads("sources", "ingest", "curate", "quality", "tokenizer",
                                                       "tokens", "model", "train", "evaluate", "plan", "ablate",
                                                       "ray", "storage")], inputs, ctx) -> StageResult:
        from tasks.ablate import ablation_markdown, run_ablation

        out_dir = ctx.stage_dir(self.name)
        data = run_ablation(cfg, out_dir, ctx.tracking_uri, ctx.experiment,
                            parent_run_id=ctx.mlflow_run_id, run_name=ctx.run_name)
        outputs = [dataset_for_path(out_dir / "ablation.json", output=True, doc=DATASET_DOCS["ablation"]),
                   dataset_for_path(data["tokenizer"]["path"], output=True, doc=DATASET_DOCS["tokenizer"])]
        outputs += [checkpoint_output(a["checkpoint"]) for a in data["arms"].values()]
        rows = [{"arm": arm, "docs": a["corpus"]["docs"], "train_tokens": a["train_tokens_available"],
                 "tokens_trained": a["tokens_trained"], "epochs": a["epochs"], "heldout_loss": a["heldout_loss"]}
                for arm, a in data["arms"].items()]
        return StageResult(data, inputs=[dataset_for_path(data["eval"]["path"])], outputs=outputs,
                           reports=[Table("ablation", rows, "Curation ablation: held-out loss per arm"),
                                    Markdown("ablation-report", ablation_markdown(data), "Curation ablation report")])
