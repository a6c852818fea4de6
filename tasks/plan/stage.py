"""The plan stage: the configured training run priced by the scaling-law planner.

The smallest stage, and the README's example of what a stage looks like."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from tasks.config import PipelineConfig
from tasks.core.sections import Reads
from tasks.core.stage import Markdown, PlanResult, Stage
from tasks.lineage import dataset_for_path
from tasks.lineage.outputs import DATASET_DOCS


class PlanStage(Stage):
    name, task, flow = "plan", "plan_training", "train"
    doc = ("Price the configured training run with the scaling-law planner: parameters, token budget against "
           "the compute-optimal count, FLOPs, GPU hours, cost, checkpoint size and a parallel layout at scale.")
    result_type = PlanResult

    def run(self, cfg: Annotated[PipelineConfig, Reads("model", "train", "plan", "energy")], inputs, ctx) -> PlanResult:
        from tasks.plan import plan_for_run
        from tasks.plan.report import format_plan
        from tasks.tokens import load_index

        plan = plan_for_run(cfg, load_index(Path(inputs.tokens_index))["vocab_size"])
        path = ctx.layout.plan_file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plan, indent=2) + "\n")
        summary = (f"**{plan['params']:,} parameters, {plan['tokens']:,} tokens** "
                   f"({plan['budget_vs_compute_optimal']:.2f}x the compute-optimal "
                   f"{plan['compute_optimal_tokens']:,.0f})\n\n```\n{format_plan(plan['plan'])}\n```")
        return PlanResult(dict(plan, path=str(path)),
                          outputs=[dataset_for_path(str(path), output=True, doc=DATASET_DOCS["plan"])],
                          reports=[Markdown("training-plan", summary,
                                            "The configured run priced by the scaling-law planner")])
