"""The deploy stage: gate the best checkpoint, register it, serve it, promote it to champion."""
from __future__ import annotations

from typing import Annotated

from tasks.config import PipelineConfig
from tasks.core.fs import location
from tasks.core.sections import Reads
from tasks.core.stage import DeployResult, Stage, StageInputs, Table
from tasks.lineage import dataset_for_path, model_version_dataset
from tasks.lineage.emitter import model_version_node, served_model_dataset
from tasks.lineage.outputs import DATASET_DOCS


class DeployStage(Stage):
    name, task, flow = "deploy", "gate_register_serve", "deploy"
    doc = ("Gate the best checkpoint on its evaluation, register it as an MLflow model version (alias challenger), "
           "serve it with the OpenAI-compatible model server and, once it answers, promote it to champion.")
    result_type = DeployResult
    # with the stack's triggered flows on, the deploy-model flow deploys and this task collects
    collect = ("await_deployment", "Collect what the event-triggered deploy-model flow runs did with this run's "
               "checkpoints (they gate, register and serve; their job is `deploy-model`): the registered model "
               "version is this task's input, not its output. If a deploy-model run failed or timed out, gate, "
               "register and serve the best checkpoint here instead.")

    def input_datasets(self, cfg, inputs: StageInputs) -> list:
        evaluation = inputs.evaluation
        return [dataset_for_path(evaluation["checkpoint"]), dataset_for_path(evaluation["report_path"]),
                dataset_for_path(inputs.tokenizer)]

    def run(self, cfg: Annotated[PipelineConfig, Reads("deploy", "evaluate", "model", "train", "sources", "storage")],
            inputs, ctx) -> DeployResult:
        from tasks.deploy import deploy_if_better
        from tasks.deploy.yardstick import yardstick_rows

        # with the stack's triggered flows on, deploy-model runs deployed passing checkpoints as they
        # were evaluated: the flow hands over what they did (None: one failed, so deploy here)
        data = inputs.triggered if ctx.triggered else None
        if data is None:
            # the tokenizer as named: a store run's URI stays a URI (a Path would make 's3://' 's3:/')
            data = deploy_if_better(cfg, ctx.tracking_uri, inputs.evaluation, location(inputs.tokenizer),
                                    inputs.train_run_id, serve_model=ctx.serve_model, verify_model=ctx.verify_model,
                                    server_status=ctx.model_server_status,
                                    lineage_namespace=ctx.lineage_namespace)
        read = self.input_datasets(cfg, inputs) if ctx.triggered and not data.get("deployed_by") else []
        yardstick = data.get("yardstick")
        reports = []
        if yardstick:  # gated against the champion on the yardstick: the checks, as a table artifact
            reports.append(Table("deploy-gate", yardstick_rows(yardstick["checks"]),
                                 f"Champion (version {yardstick['champion_version']}) vs challenger on the yardstick "
                                 f"{yardstick['sha256'][:12]}: {data['reason']}"[:500]))
        result = DeployResult(data, inputs=read, reports=reports)  # read: collecting, it deployed after all
        # continued from the champion it was gated against: an input (named by its signed content hash;
        # with that tag refused, the gate scored its verified registered copy and no version is claimed)
        if yardstick and cfg.train.init_from and yardstick.get("champion_content_hash"):
            version = yardstick["champion_version"]
            result.inputs.append(model_version_dataset(
                ctx.tracking_uri, cfg.deploy.model_name, version, content_hash=yardstick["champion_content_hash"],
                output=False, doc=DATASET_DOCS["model_version"].format(name=cfg.deploy.model_name, version=version)))
        if data.get("version") is not None:
            result.primary = model_version_node(ctx.tracking_uri, data["model_name"], data["version"])
            deployed = deploy_outputs(ctx.tracking_uri, data)
            if data.get("deployed_by"):  # collected: the deploy-model run produced these, this task read them
                result.inputs += [model_version_dataset(ctx.tracking_uri, data["model_name"], data["version"],
                                                        content_hash=data["content_hash"], output=False)]
            else:
                result.outputs += deployed
        return result


def deploy_outputs(tracking_uri: str, data: dict) -> list:
    """What a deployment (deploy_if_better's result) produced: the registered model version and,
    when it is served, the served model (endpoint, model version)."""
    if data.get("version") is None:
        return []
    name, version = data["model_name"], data["version"]
    outputs = [model_version_dataset(tracking_uri, name, version, content_hash=data["content_hash"],
                                     doc=DATASET_DOCS["model_version"].format(name=name, version=version))]
    if data.get("endpoint") and data.get("alias") == "champion":
        outputs.append(served_model_dataset(data["endpoint"], name, version, doc=DATASET_DOCS["served_model"].format(
            name=name, endpoint=data["endpoint"], version=version)))
    return outputs
