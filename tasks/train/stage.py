"""The train stage: torchrun training on the token shards, writing distributed checkpoints."""
from __future__ import annotations

from pathlib import Path

from tasks.core.stage import Stage, StageInputs, TrainResult
from tasks.lineage import dataset_for_path
from tasks.lineage.artifacts import token_split_paths
from tasks.lineage.emitter import file_node
from tasks.lineage.torchrun import TorchrunLineage, checkpoint_output


class TrainStage(Stage):
    name, task, flow = "train", "torchrun_train", "train"
    reads = ("model", "train")
    doc = "Train the GPT model under torchrun (DDP) on the token shards, saving torch.distributed checkpoints."
    result_type = TrainResult

    def input_datasets(self, cfg, inputs: StageInputs) -> list:
        datasets = [dataset_for_path(inputs.tokens_index)] + [dataset_for_path(p) for p in
                                                              token_split_paths(inputs.tokens_index)]
        if cfg.train.init_from:  # a continued run: the champion's checkpoint it starts from (and, upstream, its data)
            datasets.append(dataset_for_path(cfg.train.init_from))
        return datasets

    def run(self, cfg, inputs, ctx) -> TrainResult:
        from tasks.train import run_training

        torchrun = None
        if ctx.lineage is not None:  # the torchrun job is a lineage run of its own, child of this stage's run
            torchrun = TorchrunLineage(ctx.lineage.emitter, parent=ctx.lineage.job, root=ctx.lineage.root,
                                       run_facets={"crucible_links": ctx.lineage.links},
                                       tokenizer=Path(inputs.tokenizer) if inputs.tokenizer else None)
        kwargs = {"worker_module": ctx.worker_module} if ctx.worker_module else {}
        data = run_training(cfg, Path(inputs.tokens_index), ctx.stage_dir(self.name), ctx.tracking_uri,
                            ctx.mlflow_run_id, ctx.run_name, lineage=torchrun, **kwargs)
        if torchrun is not None:
            data["lineage_run_id"] = torchrun.run_id
        checkpoints = data["checkpoints"]
        return TrainResult(data, outputs=[checkpoint_output(c) for c in checkpoints],
                           primary=file_node(checkpoints[-1]) if checkpoints else None)
