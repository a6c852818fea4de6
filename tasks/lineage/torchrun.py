"""The torchrun training job as an OpenLineage job run of its own.

The train task (`train.torchrun_train`) launches torchrun; the torchrun job is a separate run, job
`<task job>.torchrun` (the dotted path of the job that launched it, as Airflow/Spark integrations
name child jobs), with a fresh run id, a `parent` facet naming the task run and the pipeline's `root`
run, jobType BATCH / TORCH / JOB, processing_engine torch, sourceCodeLocation of the worker torchrun
runs, and the resolved `model` + `train` config. Inputs: the token index and the train split the
workers read, and the tokenizer they were encoded with (when its sha256 is the one the index
records); outputs: the checkpoints and the training log. tasks/train/launcher.py emits START before
torchrun starts and COMPLETE after it exits 0, or FAIL with torchrun's error and log tail.
"""
from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from tasks.core.fs import is_file, is_remote, location, read_text, sha256
from tasks.core.storage import stored
from tasks.lineage.artifacts import token_split_paths
from tasks.lineage.emitter import ActiveRun, JobRef, LineageEmitter, dataset_for_path, new_run_id, package_version
from tasks.lineage.facets import CrucibleConfigRunFacet

log = logging.getLogger("crucible.lineage")

WORKER_CODE = "tasks/train/worker.py"
JOB_DOC = ("torchrun job: data-parallel training of the GPT model (tasks/train/worker.py, one process per rank "
           "under torch.distributed.run), reading the train token split and writing torch.distributed "
           "checkpoints and the training log.")
DOCS = {
    "checkpoint": "torch.distributed checkpoint of the model (and optimizer) after training step {step}.",
    "train_log": "Training metrics of the torchrun job, one JSON object per logged step (loss, lr, grad norm, "
                 "throughput).",
}


def checkpoint_step(checkpoint: str | Path) -> str:
    """The training step in a checkpoint directory's name (step-000100 -> "100")."""
    digits = "".join(ch for ch in Path(checkpoint).name if ch.isdigit())
    return str(int(digits)) if digits else Path(checkpoint).name


def checkpoint_output(checkpoint: str | Path):
    """A checkpoint as an output dataset. One on a store is versioned by its tree hash as its run's
    signed manifest records it (tasks.train.checkpoint.manifest_tree_sha256), not by reading back
    every object it wrote; None there: hashed on the store."""
    version = None
    if is_remote(checkpoint):
        from tasks.train.checkpoint import manifest_tree_sha256

        version = manifest_tree_sha256(*stored(checkpoint))
    return dataset_for_path(checkpoint, output=True, version=version,
                            doc=DOCS["checkpoint"].format(step=checkpoint_step(checkpoint)))


@dataclass
class TorchrunLineage:
    """What the launcher needs to emit the torchrun job's events: the emitter, the task run that
    launches torchrun (the parent), the pipeline's root run, run facets for every event (e.g.
    crucible_links) and the tokenizer the token shards were encoded with."""

    emitter: LineageEmitter
    parent: JobRef
    root: JobRef | None = None
    run_facets: dict = field(default_factory=dict)
    tokenizer: str | Path | None = None
    run_id: str = field(default_factory=new_run_id)

    @property
    def job(self) -> JobRef:
        return JobRef(f"{self.parent.name}.torchrun", self.run_id)

    def inputs(self, tokens_index: str | Path) -> list:
        index_path = location(tokens_index)
        index_path = index_path if is_remote(index_path) else index_path.resolve()
        inputs = [dataset_for_path(index_path)] + [dataset_for_path(p) for p in token_split_paths(index_path, ("train",))]
        # locations as named and read where they lie (stored()): a store run's tokenizer is a URI, and
        # Path() would make 's3://' 's3:/', no file, and the tokenizer silently drops out of lineage
        tokenizer = location(self.tokenizer) if self.tokenizer else None
        if tokenizer is not None and is_file(*stored(tokenizer)):
            try:
                expected = json.loads(read_text(*stored(index_path))).get("tokenizer_sha256")
            except (OSError, ValueError):
                expected = None
            if expected and sha256(*stored(tokenizer)) == expected:
                inputs.append(dataset_for_path(tokenizer))
            else:
                log.warning("tokenizer %s is not the one %s was encoded with: not a torchrun input",
                            tokenizer, index_path)
        return inputs

    @staticmethod
    def outputs(result: dict) -> list:
        """Outputs of a finished run (run_training's result): its checkpoints and training log."""
        outputs = [checkpoint_output(c) for c in result.get("checkpoints", [])]
        if result.get("train_log") and is_file(*stored(result["train_log"])):  # an object-store run's: its object
            outputs.append(dataset_for_path(result["train_log"], output=True, doc=DOCS["train_log"]))
        return outputs

    @contextmanager
    def run(self, cfg, tokens_index: str | Path) -> Iterator[ActiveRun]:
        """START now; COMPLETE with what the body adds to `outputs`, or FAIL with its error."""
        dumped = cfg.model_dump(mode="json")
        facets = {**self.run_facets,
                  "crucible_config": CrucibleConfigRunFacet(config={k: dumped[k] for k in ("model", "train")})}
        with self.emitter.run(self.job, parent=self.parent, root=self.root, inputs=self.inputs(tokens_index),
                              job_type="JOB", integration="TORCH", engine=("torch", package_version("torch")),
                              run_facets=facets, job_doc=JOB_DOC, code_path=WORKER_CODE) as active:
            yield active

    def around(self, cfg, tokens_index: str | Path, train: Callable[[], dict]) -> dict:
        """`train()` (a run_training result) as this job's run, its checkpoints and log the outputs."""
        with self.run(cfg, tokens_index) as job:
            result = train()
            job.outputs += self.outputs(result)
        return result
