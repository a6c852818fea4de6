"""The train stage: torchrun training on the token shards, writing distributed checkpoints."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

from tasks.config import PipelineConfig
from tasks.core.sections import Reads
from tasks.core.stage import Stage, StageInputs, TrainResult
from tasks.core.storage import push_path, run_uri
from tasks.lineage import dataset_for_path
from tasks.lineage.artifacts import token_split_paths
from tasks.lineage.emitter import file_node
from tasks.lineage.torchrun import TorchrunLineage, checkpoint_output


class TrainStage(Stage):
    name, task, flow = "train", "torchrun_train", "train"
    doc = "Train the GPT model under torchrun (DDP) on the token shards, saving torch.distributed checkpoints."
    result_type = TrainResult

    def input_datasets(self, cfg, inputs: StageInputs) -> list:
        datasets = [dataset_for_path(inputs.tokens_index)] + [dataset_for_path(p) for p in
                                                              token_split_paths(inputs.tokens_index)]
        if cfg.train.init_from:  # a continued run: the champion's checkpoint it starts from (and, upstream, its data)
            datasets.append(dataset_for_path(cfg.train.init_from))
        return datasets

    def run(self, cfg: Annotated[PipelineConfig, Reads("model", "train", "storage")], inputs, ctx) -> TrainResult:
        from tasks.train import run_training

        out_dir, tokens_index = ctx.stage_dir(self.name), Path(inputs.tokens_index)
        out_uri = run_uri(out_dir)
        kwargs = {"worker_module": ctx.worker_module} if ctx.worker_module else {}

        def train() -> dict:
            if out_uri is None:
                return run_training(cfg, tokens_index, out_dir, ctx.tracking_uri, ctx.mlflow_run_id, ctx.run_name,
                                    **kwargs)
            # an object-store run_root: the ranks read the token files from the store and DCP writes the
            # checkpoints there; the result names them by their URIs, and the stages after this one read
            # them there (nothing is copied back). The lineage log (with the torchrun job's START) goes
            # first: a triggered flow on another machine finds the training run that wrote a checkpoint there
            if ctx.layout.lineage_log.is_file():
                push_path(ctx.layout.lineage_log)
            return run_training(_reading_the_store(cfg), run_uri(tokens_index), out_uri, ctx.tracking_uri,
                                ctx.mlflow_run_id, ctx.run_name, **kwargs)

        if ctx.lineage is None:
            data = train()
        else:  # the torchrun job is a lineage run of its own, child of this stage's run
            torchrun = TorchrunLineage(ctx.lineage.emitter, parent=ctx.lineage.job, root=ctx.lineage.root,
                                       run_facets={"crucible_links": ctx.lineage.links},
                                       tokenizer=inputs.tokenizer)  # as named: a URI stays one
            data = torchrun.around(cfg, tokens_index, train)
            data["lineage_run_id"] = torchrun.run_id
        checkpoints = data["checkpoints"]
        return TrainResult(data, outputs=[checkpoint_output(c) for c in checkpoints],
                           primary=file_node(checkpoints[-1]) if checkpoints else None)


def _reading_the_store(cfg):
    """`cfg` with a checkpoint to start from given by its object: a node without this working copy
    reads it there (verified against train.init_sha256 after download)."""
    init_uri = run_uri(cfg.train.init_from) if cfg.train.init_from else None
    if init_uri is None:
        return cfg
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"init_from": init_uri})})

