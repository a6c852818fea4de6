"""The evaluate stage: one checkpoint's validation loss, perplexity, task suite and samples."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

from tasks.config import PipelineConfig
from tasks.core.sections import Reads
from tasks.core.stage import EvalResult, Stage, StageInputs, Table
from tasks.lineage import dataset_for_path
from tasks.lineage.artifacts import eval_data_inputs, token_split_paths
from tasks.lineage.outputs import DATASET_DOCS

log = logging.getLogger(__name__)


class EvaluateStage(Stage):
    name, task, flow = "evaluate", "evaluate_checkpoint", "evaluate"
    doc = "Evaluate one checkpoint: validation loss and perplexity, the task suite and sample generations."
    result_type = EvalResult
    # with the stack's triggered flows on, the evaluate-checkpoint flow evaluates and this task collects
    collect = ("await_evaluation", "Collect the event-triggered evaluate-checkpoint flow run's report of one "
               "checkpoint (that run evaluates it, as job `evaluate-checkpoint.evaluate`): the report is this task's "
               "input, not its output. If that run failed or timed out, evaluate the checkpoint here instead.")

    def input_datasets(self, cfg, inputs: StageInputs) -> list:
        return super().input_datasets(cfg, inputs) + [
            dataset_for_path(p) for p in token_split_paths(inputs.tokens_index, ("val",))]

    def run(self, cfg: Annotated[PipelineConfig, Reads("evaluate", "model", "train", "deploy", "storage")],
            inputs, ctx) -> EvalResult:
        from tasks.deploy.triggered import write_gate
        from tasks.deploy.yardstick import gate_at_evaluation
        from tasks.evaluate import evaluate_checkpoint

        checkpoint = inputs.checkpoint
        # with the stack's triggered flows on, the evaluate-checkpoint flow already evaluated the
        # checkpoint as it was saved: the flow hands its report over (None: that run failed, so evaluate here)
        data = inputs.triggered if ctx.triggered else None
        if data is not None:  # collected: the triggered run wrote the report, this task read it
            return EvalResult(data, inputs=[dataset_for_path(data["report_path"])],
                              reports=eval_table(ctx.layout.run_dir, ctx.run_name))
        # as named: a store run's URIs stay URIs (a Path would make "s3://" "s3:/")
        data = evaluate_checkpoint(cfg, checkpoint, inputs.tokenizer, inputs.tokens_index,
                                   ctx.layout.eval_report(checkpoint), tracking_uri=ctx.tracking_uri,
                                   run_id=inputs.train_run_id)
        write_gate(data, *gate_at_evaluation(cfg, ctx.tracking_uri, data, inputs.tokenizer))  # for the table
        read, written = report_datasets(cfg, data)
        if ctx.triggered:  # the collecting task evaluated after all: what it read is known only now
            read = self.input_datasets(cfg, inputs) + read
        return EvalResult(data, inputs=read, outputs=written, reports=eval_table(ctx.layout.run_dir, ctx.run_name))


def report_datasets(cfg, report: dict) -> tuple[list, list]:
    """(inputs, outputs) an evaluation adds once it has run: the evaluation data its task suite
    read, and its report."""
    doc = DATASET_DOCS["eval_report"].format(checkpoint=Path(report["checkpoint"]).name)
    return eval_data_inputs(report, cfg.data_root), [dataset_for_path(report["report_path"], output=True, doc=doc)]


def eval_table(run_dir: str | Path, run_name: str) -> list:
    """All evaluated checkpoints of the run side by side (step, val loss, ppl, suite metrics, gate),
    one table per run; every evaluation, triggered or direct, refreshes it."""
    from tasks.evaluate.compare import checkpoint_rows, table_key

    try:
        rows = checkpoint_rows(run_dir)
    except Exception as e:  # noqa: BLE001 - the table is a view of the reports on disk, never a failure
        log.warning("could not read the checkpoint reports of %s: %s", run_name, e)
        return []
    if not rows:
        return []
    return [Table(table_key(run_name), rows, f"Checkpoints of run {run_name}: validation loss, perplexity, "
                                             f"task-suite metrics and the deployment gate's verdict")]
