"""torchrun entry point: one process per rank, data-parallel training with DDP.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tasks.train.worker \
        --config-json run/config.json --tokens-index run/tokens/index.json --out-dir run/train \
        --run-name tiny-001

Rank 0 writes train_log.jsonl and the console lines, logs metrics to MLflow when MLFLOW_RUN_ID
is set (with MLFLOW_TRACKING_URI), and after each checkpoint emits the Prefect event
`crucible.checkpoint.saved` when PREFECT_API_URL is set.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tasks.config import PipelineConfig
from tasks.tokens.binfile import load_index
from tasks.train.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from tasks.train.data import RandomWindows
from tasks.train.metrics import MetricsLogger, drain_events, emit_checkpoint_event
from tasks.train.model import GPT, GPTConfig
from tasks.train.optimizer import build_optimizer
from tasks.train.schedule import lr_at, set_lr


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tasks.train.worker", description=__doc__.split("\n")[0])
    p.add_argument("--config-json", required=True, type=Path, help="PipelineConfig as JSON")
    p.add_argument("--tokens-index", required=True, type=Path, help="index.json of the tokens stage")
    p.add_argument("--out-dir", required=True, type=Path)
    p.add_argument("--run-name", required=True)
    p.add_argument("--run-id", default=os.environ.get("MLFLOW_RUN_ID") or None,
                   help="MLflow/crucible run id for events (default: $MLFLOW_RUN_ID)")
    return p.parse_args(argv)


def _flat_params(cfg: PipelineConfig) -> dict:
    out = {}
    for section in ("model", "train"):
        for k, v in getattr(cfg, section).model_dump().items():
            out[f"{section}.{k}"] = v
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = PipelineConfig.model_validate_json(args.config_json.read_text())
    tcfg = cfg.train
    torch.set_num_threads(tcfg.threads_per_proc)
    dist.init_process_group(backend=tcfg.backend)
    try:
        return train(cfg, args)
    finally:
        dist.destroy_process_group()


def train(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    tcfg = cfg.train
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if tcfg.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)

    index = load_index(args.tokens_index)
    gcfg = GPTConfig.from_model_config(cfg.model, index["vocab_size"])
    data = RandomWindows(args.tokens_index, "train", gcfg.seq_len, tcfg.micro_batch_size,
                         seed=tcfg.seed, rank=rank)
    torch.manual_seed(tcfg.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    model = GPT(gcfg).to(device)
    optimizer = build_optimizer(model, tcfg)

    start_step = 0
    if tcfg.resume and (ckpts := list_checkpoints(out_dir)):
        start_step = load_checkpoint(model, optimizer, ckpts[-1])
        if rank == 0:
            print(f"[train] resumed from {ckpts[-1]} at step {start_step}", flush=True)
    elif rank == 0 and (stale := list_checkpoints(out_dir)):
        # a fresh run owns out_dir, as it owns train_log.jsonl: older checkpoints would be mistaken for ours
        print(f"[train] resume is off: removing {len(stale)} old checkpoint(s) under {out_dir / 'checkpoints'}",
              flush=True)
        for p in stale:
            shutil.rmtree(p)
    ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)

    metrics = None
    if rank == 0:
        metrics = MetricsLogger(out_dir, tcfg.max_steps, tcfg.log_every,
                                tracking_uri=os.environ.get("MLFLOW_TRACKING_URI") or None,
                                run_id=os.environ.get("MLFLOW_RUN_ID") or None,
                                resume_step=start_step)
        metrics.log_params({**_flat_params(cfg), "n_params": model.num_params(), "world_size": world,
                            "vocab_size": gcfg.vocab_size, "train_tokens": index["splits"]["train"]["tokens"]})
        print(f"[train] {model.num_params():,} params | world {world} x {tcfg.threads_per_proc} threads | "
              f"train split {index['splits']['train']['tokens']:,} tokens | steps {start_step + 1}..{tcfg.max_steps}",
              flush=True)

    meta_base = {
        "model": gcfg.to_dict(),
        "vocab_size": gcfg.vocab_size,
        "eos_id": index["eos_id"],
        "tokenizer_sha256": index.get("tokenizer_sha256"),
        "tokens_index": str(Path(args.tokens_index).resolve()),
        "run_name": args.run_name,
        "run_id": args.run_id,
        "world_size": world,
    }
    accum = tcfg.grad_accum_steps
    tokens_per_step = tcfg.micro_batch_size * gcfg.seq_len * accum * world
    ddp.train()
    for step in range(start_step + 1, tcfg.max_steps + 1):
        t0 = time.perf_counter()
        lr = lr_at(step, tcfg)
        set_lr(optimizer, lr)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            x, y = (t.to(device) for t in data.batch(step, micro))
            # all-reduce gradients only on the last micro-batch
            sync = contextlib.nullcontext() if micro == accum - 1 else ddp.no_sync()
            with sync:
                _, loss = ddp(x, y)
                (loss / accum).backward()
            loss_sum += loss.detach()
        # total norm before clipping (gradients are identical on every rank after DDP's all-reduce)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        optimizer.step()
        loss_avg = loss_sum / accum
        dist.all_reduce(loss_avg, op=dist.ReduceOp.SUM)  # gloo has no AVG
        loss_val = loss_avg.item() / world
        dt = time.perf_counter() - t0
        if not math.isfinite(loss_val):
            raise FloatingPointError(f"loss is {loss_val} at step {step} (lr {lr:.3g}): stopping")
        if metrics is not None:
            metrics.log_step(step, loss=loss_val, grad_norm=float(grad_norm), lr=lr,
                             tokens_per_s=tokens_per_step / dt)
        if step % tcfg.checkpoint_every == 0 or step == tcfg.max_steps:
            path = save_checkpoint(model, optimizer, step, out_dir,
                                   {**meta_base, "train_loss": loss_val})
            if rank == 0:
                print(f"[checkpoint] step {step} -> {path}", flush=True)
                emit_checkpoint_event(path, step, args.run_id, args.run_name)
    if metrics is not None:
        metrics.close()
        drain_events()
    return 0


if __name__ == "__main__":
    sys.exit(main())
