"""The deploy stage: gate the best checkpoint, register it, serve it, promote it to champion."""
from __future__ import annotations

from pathlib import Path

from tasks.core.stage import DeployResult, Stage, StageInputs, Table
from tasks.lineage import dataset_for_path, model_version_dataset
from tasks.lineage.emitter import model_version_node
from tasks.lineage.outputs import DATASET_DOCS


class DeployStage(Stage):
    name, task, flow = "deploy", "gate_register_serve", "deploy"
    reads = ("deploy",)
    doc = ("Gate the best checkpoint on its evaluation, register it as an MLflow model version (alias challenger), "
           "serve it with the OpenAI-compatible model server and, once it answers, promote it to champion.")
    result_type = DeployResult

    def input_datasets(self, cfg, inputs: StageInputs) -> list:
        evaluation = inputs.evaluation
        return [dataset_for_path(evaluation["checkpoint"]), dataset_for_path(evaluation["report_path"]),
                dataset_for_path(inputs.tokenizer)]

    def run(self, cfg, inputs, ctx) -> DeployResult:
        from tasks.deploy import deploy_if_better
        from tasks.deploy.triggered import await_deployment
        from tasks.deploy.yardstick import yardstick_rows

        # with the stack's triggers service up, deploy-model runs deploy passing checkpoints as they
        # are evaluated: report what they did (None: one failed, so deploy here)
        data = (await_deployment(cfg, ctx.tracking_uri, ctx.layout, inputs.evaluation,
                                 cfg.stack.triggered_timeout, ctx.model_server_status)
                if ctx.triggered else None)
        if data is None:
            data = deploy_if_better(cfg, ctx.tracking_uri, inputs.evaluation, Path(inputs.tokenizer),
                                    inputs.train_run_id, serve_model=ctx.serve_model, verify_model=ctx.verify_model,
                                    server_status=ctx.model_server_status)
        yardstick = data.get("yardstick")
        reports = []
        if yardstick:  # gated against the champion on the yardstick: the checks, as a table artifact
            reports.append(Table("deploy-gate", yardstick_rows(yardstick["checks"]),
                                 f"Champion (version {yardstick['champion_version']}) vs challenger on the yardstick "
                                 f"{yardstick['sha256'][:12]}: {data['reason']}"[:500]))
        result = DeployResult(data, reports=reports)
        if yardstick and cfg.train.init_from:  # continued from the champion it was gated against: an input
            version = yardstick["champion_version"]
            result.inputs.append(model_version_dataset(
                ctx.tracking_uri, cfg.deploy.model_name, version, content_hash=yardstick["champion_content_hash"],
                output=False, doc=DATASET_DOCS["model_version"].format(name=cfg.deploy.model_name, version=version)))
        if data.get("version") is not None:
            name, version = data["model_name"], data["version"]
            result.outputs.append(model_version_dataset(
                ctx.tracking_uri, name, version, content_hash=data["content_hash"],
                doc=DATASET_DOCS["model_version"].format(name=name, version=version)))
            result.primary = model_version_node(ctx.tracking_uri, name, version)
        return result
