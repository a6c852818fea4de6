"""torchrun entry point: one process per rank, data-parallel training with DDP or FSDP2.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tasks.train.worker \
        --config-json run/config.json --tokens-index run/tokens/index.json --out-dir run/train \
        --run-name tiny-001

Rank 0 writes train_log.jsonl and the console lines, logs metrics to MLflow when MLFLOW_RUN_ID
is set (with MLFLOW_TRACKING_URI), and after each checkpoint emits the Prefect event
`crucible.checkpoint.saved` when PREFECT_API_URL is set.

Options (train.*): parallelism ddp | fsdp2 (fully_shard per block, then the root; works on CPU
with gloo), dtype fp32 | bf16 (DDP: autocast over fp32 weights; FSDP2: bf16 compute parameters,
fp32 sharded master weights and fp32 gradient reduction), compile (torch.compile per block),
doc_mask (document-aware attention from the token index's document starts), z_loss,
async_checkpoint (checkpoints written in the background; published only once complete).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tasks.config import PipelineConfig
from tasks.tokens.binfile import load_index
from tasks.train.checkpoint import (MANIFEST, apply_retention, capture_rng_state, latest_checkpoint,
                                    list_checkpoints, load_checkpoint, new_checkpoint_group, read_meta,
                                    read_rng_state, restore_rng_state, start_checkpoint)
from tasks.train.data import GlobalWindows
from tasks.train.metrics import (SPIKE_LOG, MetricsLogger, drain_events, emit_checkpoint_event,
                                 emit_spike_event)
from tasks.train.model import GPT, GPTConfig, lm_loss
from tasks.train.optimizer import build_optimizer
from tasks.train.schedule import lr_at, set_lr
from tasks.train.spikes import SpikeDetector


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
    # Keys in the rendezvous store carry the restart attempt: after torchrun restarts the workers,
    # a stale address of a dead rank from the previous attempt must not be read (gloo then fails
    # with "connection refused").
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group(backend=tcfg.backend, store=dist.PrefixStore(f"crucible/attempt-{restart}", store),
                            rank=rank, world_size=world)
    try:
        return train(cfg, args)
    finally:
        dist.destroy_process_group()


def flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> int:
    """Training FLOPs per token as torchtitan counts them: 6N for the matmuls of forward and
    backward, plus 12 * L * H * Q * T for attention scores and values. N counts the tied
    embedding once: as the output projection it is a real matmul. The planner's count (one
    implementation: what a run logs as MFU is what `crucible plan` predicts)."""
    from tasks.plan.planner import flops_per_token as planned

    dense, attention = planned(n_params, n_layer, n_head * head_dim, seq_len)
    return int(dense + attention)


def parse_faults(text: str | None) -> list[tuple[str, int, int, int | None]]:
    """CRUCIBLE_TRAIN_FAULTS, a test hook: comma-separated `corrupt:A[-B]` (the batches of steps
    A..B, counted as in a run without skips, become random token ids with the loss scaled by 100)
    and `kill:S[:RANK]` (SIGKILL this process at the start of step S, first attempt only)."""
    faults = []
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        kind, _, rest = item.partition(":")
        parts = rest.split(":")
        a, _, b = parts[0].partition("-")
        faults.append((kind, int(a), int(b or a), int(parts[1]) if len(parts) > 1 else None))
    return faults


def compile_blocks(model: GPT) -> None:
    """torch.compile every transformer block, in place (nn.Module.compile), so parameter names and
    checkpoints are unchanged; the per-block graph is the same for every layer (torchtitan style)."""
    for block in model.blocks:
        block.compile()


def parallelize(model: GPT, tcfg, device: torch.device) -> torch.nn.Module:
    """Compile and wrap the model for data parallelism; returns the module to call. Under FSDP2
    that is `model` itself (sharded in place), under DDP the DDP wrapper. Build the optimizer
    afterwards: FSDP2 replaces the parameters with sharded DTensors."""
    if tcfg.compile:
        compile_blocks(model)
    if tcfg.parallelism == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if tcfg.dtype == "bf16" else MixedPrecisionPolicy())
        for block in model.blocks:  # one all-gather per block: memory holds one full block at a time
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)  # embedding, final norm (and lm_head)
        return model
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def describe_built(model: GPT, wrapped: torch.nn.Module) -> str:
    """What parallelize actually built, for the start-up line (the config only says what was
    asked for): the wrapper, how many parameters are sharded DTensors, how many blocks compiled."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    sharded = sum(isinstance(p, DTensor) for p in params)
    compiled = sum(getattr(b, "_compiled_call_impl", None) is not None for b in model.blocks)
    return (f"built {type(wrapped).__name__}: {sharded}/{len(params)} parameters sharded, "
            f"{compiled}/{len(model.blocks)} blocks compiled")


def autocast_context(tcfg, device: torch.device):
    """bf16 autocast for DDP (weights stay fp32); FSDP2 casts through its MixedPrecisionPolicy."""
    if tcfg.dtype == "bf16" and tcfg.parallelism == "ddp":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def grad_sync_context(wrapped: torch.nn.Module, last_micro: bool):
    """Reduce gradients across ranks only on the last micro-batch of a step."""
    if isinstance(wrapped, DDP):
        return contextlib.nullcontext() if last_micro else wrapped.no_sync()
    wrapped.set_requires_gradient_sync(last_micro)  # FSDP2
    return contextlib.nullcontext()


def global_batch(tcfg, seq_len: int, world: int) -> tuple[int, int]:
    """(global samples per optimizer step, micro-batches per rank per step)."""
    per_micro = tcfg.micro_batch_size * world
    if tcfg.batch_tokens is None:
        return per_micro * tcfg.grad_accum_steps, tcfg.grad_accum_steps
    if tcfg.batch_tokens % seq_len:
        raise ValueError(f"train.batch_tokens ({tcfg.batch_tokens}) must be a multiple of seq_len ({seq_len})")
    samples = tcfg.batch_tokens // seq_len
    if samples % per_micro:
        raise ValueError(f"train.batch_tokens gives {samples} sequences per step, not a multiple of "
                         f"micro_batch_size x world size = {per_micro}")
    return samples, samples // per_micro


def train(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    tcfg = cfg.train
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    faults = parse_faults(os.environ.get("CRUCIBLE_TRAIN_FAULTS"))
    if tcfg.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)

    index = load_index(args.tokens_index)
    gcfg = GPTConfig.from_model_config(cfg.model, index["vocab_size"])
    data = GlobalWindows(args.tokens_index, "train", gcfg.seq_len, tcfg.micro_batch_size, seed=tcfg.seed,
                         documents=tcfg.doc_mask)
    G, accum = global_batch(tcfg, gcfg.seq_len, world)
    torch.manual_seed(tcfg.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    model = GPT(gcfg).to(device)
    n_params, n_matmul_params = model.num_params(), model.num_matmul_params()
    wrapped = parallelize(model, tcfg, device)
    optimizer = build_optimizer(model, tcfg)
    # per-rank RNG streams after the shared init (dropout differs per rank); saved in checkpoints
    torch.manual_seed(tcfg.seed + 1 + rank)
    np.random.seed((tcfg.seed + 1 + rank) % 2**32)
    random.seed(tcfg.seed + 1 + rank)
    data_rng = np.random.default_rng([tcfg.seed, rank])  # per-rank data generator (fault hook)
    detector = SpikeDetector(tcfg.spike_window, tcfg.spike_min_history, tcfg.spike_sigma,
                             tcfg.spike_rollback_after)
    trainer = {"consumed_samples": 0, "skip_ranges": [], "rollbacks": 0}

    def restore(ckpt: Path) -> int:
        step = load_checkpoint(model, optimizer, ckpt)
        meta = read_meta(ckpt)
        tr = meta.get("trainer") or {}
        trainer.update(consumed_samples=int(tr.get("consumed_samples", 0)),
                       skip_ranges=[tuple(r) for r in tr.get("skip_ranges", [])],
                       rollbacks=int(tr.get("rollbacks", 0)))
        if "consumed_samples" not in tr:  # a checkpoint from before the loader position was saved
            trainer["consumed_samples"] = step * G
        data.skip_ranges = list(trainer["skip_ranges"])
        detector.load(tr.get("spike") or {})
        rng = read_rng_state(ckpt, rank) if meta.get("world_size") == world else None
        if rng is not None:
            restore_rng_state(rng, data_rng)
        else:  # another world size: the per-rank streams cannot carry over; derive fresh ones
            torch.manual_seed(tcfg.seed + 1 + rank + 7919 * step)
            np.random.seed((tcfg.seed + 1 + rank + 7919 * step) % 2**32)
            random.seed(tcfg.seed + 1 + rank + 7919 * step)
            data_rng.bit_generator.state = np.random.default_rng([tcfg.seed, rank, step]).bit_generator.state
        return step

    start_step = 0
    resume = tcfg.resume or restart > 0
    ckpt = latest_checkpoint(out_dir) if resume else None
    if ckpt is not None:
        start_step = restore(ckpt)
        if rank == 0:
            why = f"restart {restart} (torchrun)" if restart else "resume"
            print(f"[train] {why}: resumed from {ckpt} at step {start_step}, "
                  f"data position {trainer['consumed_samples']}", flush=True)
    elif not resume and rank == 0 and (stale := list_checkpoints(out_dir)):
        # a fresh run owns out_dir, as it owns train_log.jsonl: older checkpoints would be mistaken for ours
        print(f"[train] resume is off: removing {len(stale)} old checkpoint(s) under {out_dir / 'checkpoints'}",
              flush=True)
        for p in stale:
            shutil.rmtree(p)
    if rank == 0 and start_step == 0:
        (out_dir / "checkpoints" / MANIFEST).unlink(missing_ok=True)
        (out_dir / SPIKE_LOG).unlink(missing_ok=True)
    dist.barrier()

    metrics = None
    if rank == 0:
        metrics = MetricsLogger(out_dir, tcfg.max_steps, tcfg.log_every,
                                tracking_uri=os.environ.get("MLFLOW_TRACKING_URI") or None,
                                run_id=os.environ.get("MLFLOW_RUN_ID") or None,
                                resume_step=start_step)
        metrics.log_params({**_flat_params(cfg), "n_params": n_params, "world_size": world,
                            "vocab_size": gcfg.vocab_size, "train_tokens": index["splits"]["train"]["tokens"],
                            "global_batch_samples": G, "grad_accum_steps_effective": accum})
        print(f"[train] {n_params:,} params | {tcfg.parallelism} {tcfg.dtype}"
              f"{' compiled' if tcfg.compile else ''}{' doc-mask' if tcfg.doc_mask else ''} | "
              f"world {world} x {tcfg.threads_per_proc} threads | "
              f"global batch {G} x {gcfg.seq_len} tokens ({accum} micro-batch(es) per rank) | "
              f"train split {index['splits']['train']['tokens']:,} tokens | steps {start_step + 1}..{tcfg.max_steps}",
              flush=True)
        print(f"[train] {describe_built(model, wrapped)}", flush=True)

    meta_base = {
        "model": gcfg.to_dict(),
        "vocab_size": gcfg.vocab_size,
        "eos_id": index["eos_id"],
        "tokenizer_sha256": index.get("tokenizer_sha256"),
        "tokens_index": str(Path(args.tokens_index).resolve()),
        "run_name": args.run_name,
        "run_id": args.run_id,
        "world_size": world,
        "global_batch_samples": G,
        "train_options": {k: getattr(tcfg, k) for k in ("parallelism", "dtype", "compile", "doc_mask", "z_loss")},
    }
    ckpt_group = new_checkpoint_group() if tcfg.async_checkpoint else None
    pending = None  # the checkpoint being written (async), published by finish_checkpoint

    def finish_checkpoint() -> None:
        """Wait for the pending checkpoint, publish it, then (rank 0) manifest/retention and event:
        nothing refers to a checkpoint before it is complete."""
        nonlocal pending
        if pending is None:
            return
        done, pending = pending, None
        path = done.wait_and_finalize()
        if rank == 0:
            apply_retention(out_dir, path, tcfg.keep_last_checkpoints, tcfg.keep_best_checkpoints)
            how = (f" (async: blocked {done.blocked_s:.2f}s, written in {done.write_s:.2f}s)"
                   if done.is_async else "")
            print(f"[checkpoint] step {done.step} -> {path}{how}", flush=True)
            emit_checkpoint_event(path, step=done.step, run_id=args.run_id, run_name=args.run_name)

    tokens_per_step = G * gcfg.seq_len
    fpt = flops_per_token(n_matmul_params, gcfg.n_layer, gcfg.n_head, gcfg.head_dim, gcfg.seq_len)
    stop = tcfg.stop_at_step or tcfg.max_steps
    wrapped.train()
    step = start_step
    while step < stop:
        step += 1
        t0 = time.perf_counter()
        for kind, a, _, who in faults:
            if kind == "kill" and a == step and restart == 0 and who in (None, rank):
                print(f"[fault] rank {rank}: SIGKILL at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        lr = lr_at(step, tcfg)
        set_lr(optimizer, lr)
        optimizer.zero_grad(set_to_none=True)
        pos = data.step_start(trainer["consumed_samples"])
        corrupt = any(kind == "corrupt" and (a - 1) * G <= pos < b * G for kind, a, b, _ in faults)
        loss_sum = torch.zeros(2, device=device)  # cross-entropy, z-loss
        for micro in range(accum):
            x, y = data.micro_batch(pos, micro, rank, world)
            doc_ids = positions = None
            if tcfg.doc_mask:
                doc_ids, positions = (t.to(device) for t in data.micro_batch_documents(pos, micro, rank, world))
            if corrupt:
                x = torch.from_numpy(data_rng.integers(0, gcfg.vocab_size, size=tuple(x.shape)))
                y = torch.from_numpy(data_rng.integers(0, gcfg.vocab_size, size=tuple(y.shape)))
            x, y = x.to(device), y.to(device)
            with grad_sync_context(wrapped, micro == accum - 1):
                with autocast_context(tcfg, device):
                    logits, _ = wrapped(x, doc_ids=doc_ids, positions=positions)
                    loss, ce, z = lm_loss(logits, y, tcfg.z_loss)
                if rank == 0 and micro == 0 and step == start_step + 1:  # what the forward really ran in
                    print(f"[train] forward computes in {logits.dtype}; the optimizer updates "
                          f"{optimizer.param_groups[0]['params'][0].dtype} weights", flush=True)
                if corrupt:
                    loss, ce = loss * 100.0, ce * 100.0
                (loss / accum).backward()
            loss_sum[0] += ce.detach()
            if z is not None:
                loss_sum[1] += z.detach()
        # total norm before clipping (identical on every rank: DDP all-reduces the gradients;
        # under FSDP2 the norm of the sharded DTensor gradients is reduced across ranks)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        loss_avg = loss_sum / accum
        dist.all_reduce(loss_avg, op=dist.ReduceOp.SUM)  # gloo has no AVG
        loss_val = loss_avg[0].item() / world
        z_val = loss_avg[1].item() / world
        end = pos + G
        spike = detector.check(loss_val, grad_norm) if tcfg.spike_detection else None
        if spike is None and not math.isfinite(loss_val):
            raise FloatingPointError(f"loss is {loss_val} at step {step} (lr {lr:.3g}): stopping")
        if spike is None:
            optimizer.step()
            detector.healthy(loss_val, grad_norm)
        else:
            optimizer.zero_grad(set_to_none=True)  # skip the batch: no update
        trainer["consumed_samples"] = end
        dt = time.perf_counter() - t0
        if metrics is not None:
            values = {"loss": loss_val, "grad_norm": grad_norm, "lr": lr, "tokens_per_s": tokens_per_step / dt,
                      "flops_per_s": fpt * tokens_per_step / dt / world}
            if tcfg.z_loss:
                values["z_loss"] = z_val
            if tcfg.peak_flops_per_s:
                values["mfu"] = values["flops_per_s"] / tcfg.peak_flops_per_s
            values["data_start"] = pos
            if spike is not None:
                values["skipped"] = 1
            metrics.log_step(step, **values)
        if spike is not None:
            persistent = detector.spiked(step, pos)
            details = {**spike, "data_range": [pos, end], "consecutive": detector.consecutive}
            if metrics is not None:
                metrics.log_spike(step, "skip", **details)
                emit_spike_event("skip", step, args.run_id, args.run_name, **details)
            if persistent:
                first_step, bad_start = detector.streak_first_step, detector.streak_start
                finish_checkpoint()  # a checkpoint still being written may be the rollback target
                target = latest_checkpoint(out_dir, before_step=first_step)
                if target is not None and trainer["rollbacks"] < tcfg.spike_max_rollbacks:
                    ranges = list(trainer["skip_ranges"]) + [(bad_start, end)]
                    rollbacks, spike_step = trainer["rollbacks"] + 1, step
                    step = restore(target)
                    trainer.update(skip_ranges=ranges, rollbacks=rollbacks)
                    data.skip_ranges = list(ranges)
                    info = {"to_checkpoint": target.name, "to_step": step, "skipped_data": [bad_start, end],
                            "spike_steps": [first_step, spike_step], "rollbacks": rollbacks}
                    if metrics is not None:
                        metrics.rewind(step)
                        metrics.log_spike(step, "rollback", **info)
                        emit_spike_event("rollback", step, args.run_id, args.run_name, **info)
                    continue
                if metrics is not None:
                    why = "no checkpoint before the spike" if target is None else "spike_max_rollbacks reached"
                    metrics.log_spike(step, "rollback_unavailable", reason=why)
                    emit_spike_event("rollback_unavailable", step, args.run_id, args.run_name, reason=why)
        if step % tcfg.checkpoint_every == 0 or step == tcfg.max_steps or step == stop:
            tr_state = {**trainer, "skip_ranges": [list(r) for r in trainer["skip_ranges"]],
                        "spike": detector.state()}
            finish_checkpoint()  # one save in flight at a time
            pending = start_checkpoint(model, optimizer, step, out_dir,
                                       {**meta_base, "train_loss": loss_val, "trainer": tr_state},
                                       rng_state=capture_rng_state(data_rng),
                                       async_save=tcfg.async_checkpoint, process_group=ckpt_group)
            if not tcfg.async_checkpoint:
                finish_checkpoint()
    finish_checkpoint()
    if metrics is not None:
        metrics.close()
        drain_events()
    return 0


if __name__ == "__main__":
    sys.exit(main())
