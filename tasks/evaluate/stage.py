"""The evaluate stage: one checkpoint's validation loss, perplexity, task suite and samples."""
from __future__ import annotations

import logging
from pathlib import Path

from tasks.core.stage import EvalResult, Stage, StageInputs, Table
from tasks.lineage import dataset_for_path
from tasks.lineage.artifacts import eval_data_inputs, token_split_paths
from tasks.lineage.outputs import DATASET_DOCS

log = logging.getLogger(__name__)


class EvaluateStage(Stage):
    name, task, flow = "evaluate", "evaluate_checkpoint", "evaluate"
    reads = ("evaluate",)
    doc = "Evaluate one checkpoint: validation loss and perplexity, the task suite and sample generations."
    result_type = EvalResult

    def input_datasets(self, cfg, inputs: StageInputs) -> list:
        return super().input_datasets(cfg, inputs) + [
            dataset_for_path(p) for p in token_split_paths(inputs.tokens_index, ("val",))]

    def run(self, cfg, inputs, ctx) -> EvalResult:
        from tasks.deploy.triggered import await_evaluation, write_gate
        from tasks.deploy.yardstick import gate_at_evaluation
        from tasks.evaluate import evaluate_checkpoint

        checkpoint = inputs.checkpoint
        # with the stack's triggers service up, the evaluate-checkpoint flow already evaluates each
        # checkpoint as it is saved: collect its report (None: it failed, so evaluate here)
        data = await_evaluation(ctx.layout, checkpoint, cfg.stack.triggered_timeout) if ctx.triggered else None
        if data is None:
            data = evaluate_checkpoint(cfg, Path(checkpoint), Path(inputs.tokenizer), Path(inputs.tokens_index),
                                       ctx.layout.eval_report(checkpoint), tracking_uri=ctx.tracking_uri,
                                       run_id=inputs.train_run_id)
            write_gate(data, *gate_at_evaluation(cfg, ctx.tracking_uri, data, inputs.tokenizer))  # for the table
        outputs = [dataset_for_path(data["report_path"], output=True,
                                    doc=DATASET_DOCS["eval_report"].format(checkpoint=Path(checkpoint).name))]
        return EvalResult(data, inputs=eval_data_inputs(data, cfg.data_root), outputs=outputs,
                          reports=eval_table(ctx.layout.run_dir, ctx.run_name))


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
