"""torchrun entry point: one process per rank, training in the train.parallel layout (one DeviceMesh of
pp x dp_replicate x dp_shard x cp x tp, ep for MoE experts) or the ddp / fsdp2 shorthand.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tasks.train.worker \
        --config-json run/config.json --tokens-index run/tokens/index.json --out-dir run/train \
        --run-name tiny-001

Parses the arguments, joins the process group, runs the Trainer (tasks/train/trainer.py) and
leaves the group. Rank 0 logs metrics to MLflow when MLFLOW_RUN_ID is set (with
MLFLOW_TRACKING_URI; run_training sets both). This entry sends no events; the pipeline's entry,
flows/train_worker.py, runs the same `main` with a Prefect event sink.

Options (train.*): parallel (the layout: FSDP2 / HSDP, tensor + sequence parallelism, pipeline
schedules, expert parallelism; tasks/train/parallel_dims.py), parallelism ddp | fsdp2 (the shorthand
where train.parallel is left at its defaults; fully_shard per block, then the root; works on CPU with
gloo), activation_checkpointing none | selective | full, dtype fp32 | bf16 (DDP: autocast over fp32 weights; FSDP2: bf16 compute parameters,
fp32 sharded master weights and fp32 gradient reduction), compile (torch.compile per block),
doc_mask (document-aware attention from the token index's document starts), z_loss,
async_checkpoint (checkpoints written in the background; published only once complete).
--tokens-index and --out-dir may be object-store URIs (s3://...), with the config's storage.options.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from tasks.core.fs import location
from tasks.train.events import EventSink
from tasks.train.launcher import read_train_config
from tasks.train.trainer import TrainJob, Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tasks.train.worker", description=__doc__.split("\n")[0])
    p.add_argument("--config-json", required=True, type=Path, help="PipelineConfig as JSON")
    # a path, or an object-store URI (s3://...: Path would fold its "//")
    p.add_argument("--tokens-index", required=True, type=location, help="index.json of the tokens stage")
    p.add_argument("--out-dir", required=True, type=location)
    p.add_argument("--run-name", required=True)
    p.add_argument("--run-id", default=os.environ.get("MLFLOW_RUN_ID") or None,
                   help="MLflow/crucible run id for events (default: $MLFLOW_RUN_ID)")
    return p.parse_args(argv)


def init_process_group(backend: str, restart: int) -> None:
    # Keys in the rendezvous store carry the restart attempt: after torchrun restarts the workers,
    # a stale address of a dead rank from the previous attempt must not be read (gloo then fails
    # with "connection refused").
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"crucible/attempt-{restart}", store),
                            rank=rank, world_size=world)


def main(argv: list[str] | None = None, events: EventSink | None = None,
         make_trainer: Callable[..., Trainer] = Trainer) -> int:
    """Train one rank. `events` receives checkpoint and spike reports (default: none);
    `make_trainer` builds the Trainer from (cfg, job, events)."""
    args = parse_args(argv)
    cfg = read_train_config(args.config_json)  # signed by the stack, else refused before anything runs
    torch.set_num_threads(cfg.train.threads_per_proc)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    init_process_group(cfg.train.backend, restart)
    try:
        job = TrainJob(args.tokens_index, args.out_dir, args.run_name, args.run_id, restart=restart,
                       local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                       mlflow_tracking_uri=os.environ.get("MLFLOW_TRACKING_URI") or None,
                       mlflow_run_id=os.environ.get("MLFLOW_RUN_ID") or None)
        return make_trainer(cfg, job, events).train()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
