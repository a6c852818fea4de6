"""The training loop of one torchrun rank, in torchtitan's shape: a Trainer that builds the model,
data and optimizer, then `train()`s step by step (`train_step`), checkpoints (`maybe_checkpoint`),
and handles loss spikes (`on_spike`: skip the batch; on a persistent spike roll back to a
checkpoint and skip the data, or, with none to roll back to, re-baseline the detector).
`state_dict` / `load_state_dict` are the loop's own state saved in each checkpoint's meta (loader
position, skipped data ranges, rollbacks, spike detector), next to the model, optimizer and RNG
states.

The layout (train.parallel, tasks/train/parallel_dims.py) is one DeviceMesh of (pp, dp_replicate,
dp_shard, cp, tp); the `parallelism: ddp` shorthand keeps plain DDP over all ranks. The data is split
over the data-parallel ranks only (the "dp" mesh dimension: the tp / pp / cp ranks of one replica read
the same samples; a cp rank keeps its slice of each sequence, tasks/train/context_parallel.py), the
loss is averaged over them and the cp ranks, the gradient norm is reduced over every mesh its
gradients live on (tasks/train/grad_norm.py). A rank holds `model_parts` (one module, or its pipeline
stages) and one optimizer per part; checkpoints merge the parts' state dicts, so a checkpoint moves
between layouts (DCP reshards on load). Rank 0 writes out_dir/layout.json: what was built on every
rank (tasks/train/metrics.py rank_layout).

Rank 0 writes train_log.jsonl and the console lines, logs to MLflow when the job names an MLflow
run, and reports each published checkpoint and spike action to the event sink (tasks/train/events.py).

out_dir and tokens_index may be object-store URIs (read and written through tasks/core/fs.py, the
run files' one access layer): the token files are then read from this node's cache
(tasks/train/remote.py), checkpoints go to the store (tasks/train/checkpoint.py), and rank 0's logs
are written in the node's working directory and copied to out_dir after each published
checkpoint and at the end (`push_logs`), so a resume on any node continues them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tasks.core.layout import CHECKPOINTS_DIR
from tasks.core.fs import download_file, is_file, is_remote, join, name_of, remove, sha256, upload, write_text
from tasks.config import PipelineConfig
from tasks.tokens.binfile import load_index
from tasks.train.checkpoint import (MANIFEST, apply_retention, capture_rng_state, init_from_checkpoint,
                                    latest_checkpoint, list_checkpoints, new_checkpoint_group, remove_checkpoint,
                                    restore_checkpoint, restore_rng_state, start_checkpoint, weights_sha256)
from tasks.train import parallelize as par
from tasks.train.batch_ramp import BatchRamp, tokens_trained_from_meta
from tasks.train.data import GlobalWindows
from tasks.train.events import EventSink, NoEvents
from tasks.train.flops import flops_per_token
from tasks.train.grad_norm import clip_grad_norm_
from tasks.train.meta_init import build_on_meta, materialize
from tasks.train.metrics import LAYOUT_FILE, SPIKE_LOG, TRAIN_LOG, MetricsLogger, rank_layout
from tasks.train.model import GPT, GPTConfig, lm_loss
from tasks.train.moe import balance_experts, moe_metrics, set_moe_loss_scale
from tasks.train.optimizer import OptimizersContainer
from tasks.train.parallel_dims import MESH_DIMS, ParallelDims
from tasks.train.parallelize import autocast_context, describe_built, grad_sync_context
from tasks.train.pipeline import build_pipeline
from tasks.train.remote import run_work_dir, stage_tokens
from tasks.train.schedule import lr_at, schedule_record, set_lr
from tasks.train.spikes import SpikeDetector


INIT_FILE = "init.json"  # a continued run: the checkpoint its step 0 came from, and its weights' hash


@dataclass(frozen=True)
class TrainJob:
    """What one worker process trains: its command line and what torchrun tells it. tokens_index and
    out_dir are local Paths or object-store URIs (strings)."""
    tokens_index: Path | str
    out_dir: Path | str
    run_name: str
    run_id: str | None = None  # MLflow/crucible run id, recorded in checkpoints and events
    restart: int = 0  # torchrun's restart attempt: > 0 resumes from the newest checkpoint
    local_rank: int = 0
    mlflow_tracking_uri: str | None = None
    mlflow_run_id: str | None = None


@dataclass
class StepResult:
    step: int
    pos: int  # loader position (global sample) the step's batch began at
    end: int  # loader position after the step
    lr: float
    loss: float  # cross-entropy, averaged over ranks and micro-batches
    z_loss: float
    grad_norm: float  # global norm before clipping
    spike: dict | None  # SpikeDetector.check's finding: the batch was skipped
    seconds: float


def flat_params(cfg: PipelineConfig) -> dict:
    """The model and train config sections as MLflow params ("model.d_model", ...)."""
    out = {}
    for section in ("model", "train"):
        for k, v in getattr(cfg, section).model_dump().items():
            out[f"{section}.{k}"] = v
    return out


def seed_rank_streams(seed: int) -> None:
    """Seed this process's torch, numpy and python RNGs (dropout etc.)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def data_parallel_coords(mesh, rank: int, world: int) -> tuple[int, int, int]:
    """(dp_rank, dp_size, pp_rank) of this rank: which slice of each global batch it reads and which
    pipeline stage it runs; (rank, world, 0) for the legacy DDP shorthand (no mesh)."""
    if mesh is None:
        return rank, world, 0
    return mesh["dp"].get_local_rank(), mesh["dp"].size(), mesh["pp"].get_local_rank()


def stream_coords(mesh, rank: int, world: int) -> tuple[int, int, int]:
    """(stream index, stream count, pp_rank) of this rank's dropout stream: one per data-parallel
    replica, and within a replica per cp rank (its slice holds other positions); the tp ranks of one
    replica share theirs. (rank, world, 0) for the legacy DDP shorthand."""
    dp_rank, dp_size, pp_rank = data_parallel_coords(mesh, rank, world)
    if mesh is None:
        return dp_rank, dp_size, pp_rank
    cp = mesh["cp"]
    return dp_rank + dp_size * cp.get_local_rank(), dp_size * cp.size(), pp_rank


def rank_stream_seed(seed: int, dp_rank: int, dp_size: int, pp_rank: int, step: int = 0) -> int:
    """The seed of a rank's dropout streams: distinct per data-parallel replica (and cp slice:
    `stream_coords`) and pipeline stage, shared by the tp ranks of one replica (they compute the same
    replicated activations);
    `step` > 0 derives fresh ones on a resume whose saved streams do not fit the layout."""
    return seed + 1 + dp_rank + dp_size * pp_rank + 7919 * step


def saved_streams_fit(meta: dict, dims: ParallelDims, world: int) -> bool:
    """Whether a checkpoint's per-rank RNG states can be reused: only when it was saved under the
    same mesh (every rank has the same replica / stage / tp coordinates), not merely the same world."""
    saved = meta.get("layout") or {}
    return meta.get("world_size") == world and bool(saved) and all(
        saved.get(d) == getattr(dims, d) for d in (*MESH_DIMS, "legacy_ddp"))


class Trainer:
    """Training of the configured GPT on one rank of the train.parallel layout. Collective: every rank
    builds one (after the process group is initialised) and calls `train()`."""

    def __init__(self, cfg: PipelineConfig, job: TrainJob, events: EventSink | None = None):
        self.cfg, self.tcfg, self.job = cfg, cfg.train, job
        self.events = events or NoEvents()
        tcfg = self.tcfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if tcfg.device == "cuda":
            self.device = torch.device("cuda", job.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.out_dir = job.out_dir if is_remote(job.out_dir) else Path(job.out_dir).resolve()
        # where rank 0's logs are written: out_dir itself, or this node's working dir for a remote one
        self.log_dir = run_work_dir(cfg.storage, self.out_dir) if self.remote else self.out_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)

        tokens_index = job.tokens_index
        # every checkpoint's signed meta records the hash of the index this run trains from: readers hold
        # the index they score on to it (tasks.train.checkpoint.trained_index_problem)
        self.index_sha256 = sha256(tokens_index, self.storage)
        if is_remote(tokens_index):  # the launcher staged it once per node: found in the node's cache
            tokens_index, fetched = stage_tokens(tokens_index, cfg.storage)
            print(f"[tokens] rank {self.rank}: {job.tokens_index} read from {tokens_index} "
                  f"({fetched} file(s) downloaded)", flush=True)
        self.index = load_index(tokens_index)
        self.gcfg = GPTConfig.from_model_config(cfg.model, self.index["vocab_size"])
        # the layout: checked at config load already; here against the world torchrun really started
        self.dims = ParallelDims.from_config(cfg, self.world)
        self.mesh = None if self.dims.legacy_ddp else self.dims.build_mesh(self.device.type)
        # the data-parallel coordinates: which slice of each global batch this rank reads
        self.dp_rank, self.dp_size, self.pp_rank = data_parallel_coords(self.mesh, self.rank, self.world)
        # the ranks that see different tokens (losses, expert loads; looked up once, not per step): the
        # data-parallel ranks, and their cp ranks (each holds a slice of every sequence)
        self.tokens_group = dist.group.WORLD if self.mesh is None else self.mesh["dp_cp"].get_group()
        self.tokens_ranks = dist.get_world_size(self.tokens_group)
        self.pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 else None
        self.data = GlobalWindows(tokens_index, "train", self.gcfg.seq_len, tcfg.micro_batch_size,
                                  seed=tcfg.seed, documents=tcfg.doc_mask)
        self.global_samples, self.accum = self.dims.global_batch(tcfg, self.gcfg.seq_len)
        # a batch-size ramp (tasks/train/batch_ramp.py) sets each step's global_samples / accum from
        # the tokens trained so far (ramp_tokens, checkpointed in the meta's schedule record)
        self.full_samples, self.ramp_tokens = self.global_samples, 0
        self.ramp = BatchRamp.for_layout(tcfg, self.dims, self.gcfg.seq_len)
        torch.manual_seed(tcfg.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
        self.init_record = None
        if self.dims.legacy_ddp:  # DDP replicates the whole model anyway
            self.model = GPT(self.gcfg).to(self.device)
        else:  # shapes only: built, sharded, then filled shard by shard (tasks/train/meta_init.py)
            self.model, self.init_record = build_on_meta(self.gcfg, tcfg.seed)
        self.n_params = self.model.num_params()
        self.flops_per_token = flops_per_token(self.model.num_active_params(), self.gcfg.n_layer,
                                               self.gcfg.n_head, self.gcfg.head_dim, self.gcfg.seq_len)
        self.moe_stats: dict = {}  # the last step's balance_experts stats (MoE layers)
        self.layout_info: dict = {}  # extra fields for layout.json (e.g. the pipeline's stages)
        self.pipeline = None  # pp > 1: this rank's stages and schedule (tasks/train/pipeline.py)
        # params still on the meta device when sharded: no rank ever holds the whole model
        built_on_meta = self.init_record is not None and all(t.is_meta for t in self.model.parameters())
        model_bytes = sum(t.numel() * t.element_size() for t in self.model.parameters())
        self.model_parts, self.wrapped = self.build_model_parts()
        # cp > 1 (tasks/train/context_parallel.py): micro_batch keeps this rank's slice of each sequence
        self.context_parallel = getattr(self.model_parts[0], "context_parallel", None)
        if self.context_parallel is not None:
            self.layout_info["context_parallel"] = {"cp": self.dims.cp, "seq_len": self.gcfg.seq_len,
                                                    "local_seq_len": self.context_parallel.local_len,
                                                    "sharding": "load-balanced: chunks i and 2 cp - 1 - i"}
        if self.init_record is not None:
            self.layout_info["init"] = {"built_on_meta": built_on_meta, "model_param_bytes": model_bytes,
                                        **materialize(self.model_parts, self.init_record, self.gcfg, self.device)}
        self.optimizer = OptimizersContainer(self.model_parts, tcfg)
        # per-rank RNG streams after the shared init, saved in checkpoints: dropout differs per
        # data-parallel replica, cp slice and pipeline stage, and is the same on the tp ranks of one replica
        seed_rank_streams(rank_stream_seed(tcfg.seed, *stream_coords(self.mesh, self.rank, self.world)))
        self.data_rng = np.random.default_rng([tcfg.seed, self.rank])  # per-rank data stream, checkpointed
        self.detector = SpikeDetector(tcfg.spike_window, tcfg.spike_min_history, tcfg.spike_sigma,
                                      tcfg.spike_rollback_after, loss_ratio=tcfg.spike_loss_ratio,
                                      grad_ratio=tcfg.spike_grad_ratio)
        self.consumed_samples, self.skip_ranges, self.rollbacks = 0, [], 0
        self.start_step = 0
        self.metrics: MetricsLogger | None = None
        self.pending = None  # the checkpoint being written (async), published by finish_checkpoint
        self.ckpt_group = None

    def build_model_parts(self) -> tuple[list[torch.nn.Module], torch.nn.Module]:
        """(this rank's model parts, the module a forward calls). Without pipeline parallelism one
        part: the model parallelized in place on the mesh (tasks/train/parallelize.py: TP + SP, EP,
        activation checkpointing, compile, FSDP2 / HSDP), or wrapped in DDP for `parallelism: ddp`."""
        if self.dims.legacy_ddp:
            return [self.model], par.parallelize(self.model, self.tcfg, self.device)
        if self.dims.pp > 1:
            return self.build_pipeline_parts()
        model = par.parallelize_model(self.model, self.dims, self.mesh, self.tcfg, self.device)
        return [model], model

    def build_pipeline_parts(self) -> tuple[list[torch.nn.Module], torch.nn.Module]:
        """pp > 1: this pp rank's stages of the model (tasks/train/pipeline.py), each parallelized on
        the mesh like a whole model; `self.pipeline` runs the schedule. The whole model is dropped:
        the layers of other stages live on other ranks."""
        dims, mesh, tcfg, device = self.dims, self.mesh, self.tcfg, self.device

        def parallelize_fn(part):
            return par.parallelize_model(part, dims, mesh, tcfg, device)

        self.pipeline = build_pipeline(self.model, dims, mesh, device, self.compute_loss, parallelize_fn)
        self.model = None
        self.layout_info["pipeline"] = self.pipeline.record()
        parts = self.pipeline.model_parts
        return parts, parts[0]

    @property
    def storage(self) -> dict:
        """The fsspec options of a remote out_dir / tokens_index (storage.options)."""
        return self.cfg.storage.options

    @property
    def remote(self) -> bool:
        return is_remote(self.out_dir)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """The loop's state as saved in a checkpoint's meta ("trainer")."""
        return {"consumed_samples": self.consumed_samples, "skip_ranges": [list(r) for r in self.skip_ranges],
                "rollbacks": self.rollbacks, "spike": self.detector.state()}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state.get("consumed_samples", 0))
        self.skip_ranges = [tuple(r) for r in state.get("skip_ranges", [])]
        self.rollbacks = int(state.get("rollbacks", 0))
        self.data.skip_ranges = list(self.skip_ranges)
        self.detector.load(state.get("spike") or {})

    def restore(self, ckpt: Path | str) -> int:
        """Collective: load model, optimizer, loop and RNG states from `ckpt`; returns its step."""
        # meta and RNG states from the copy whose files were verified with the tensors
        step, meta, rng = restore_checkpoint(self.model_parts, self.optimizer, ckpt, self.rank, self.storage)
        state = meta.get("trainer") or {}
        self.load_state_dict(state)
        if "consumed_samples" not in state:  # a checkpoint from before the loader position was saved
            self.consumed_samples = step * self.global_samples
        recorded = tokens_trained_from_meta(meta)  # the ramp goes on from there (a run without one: its data)
        self.ramp_tokens = recorded if recorded is not None else self.consumed_samples * self.gcfg.seq_len
        rng = rng if saved_streams_fit(meta, self.dims, self.world) else None
        if rng is not None:
            restore_rng_state(rng, self.data_rng)
        else:  # another layout: the per-rank streams cannot carry over; derive fresh ones
            seed_rank_streams(rank_stream_seed(self.tcfg.seed, *stream_coords(self.mesh, self.rank, self.world), step))
            self.data_rng.bit_generator.state = np.random.default_rng(
                [self.tcfg.seed, self.rank, step]).bit_generator.state
        return step

    def resume_or_clean(self) -> int:
        """The step to start after: the newest checkpoint's when resuming (train.resume, or a
        torchrun restart), else 0, with a fresh run's leftovers removed. Collective."""
        out_dir, restart, start_step = self.out_dir, self.job.restart, 0
        resume = self.tcfg.resume or restart > 0
        ckpt = latest_checkpoint(out_dir, storage_options=self.storage) if resume else None
        if ckpt is not None:
            start_step = self.restore(ckpt)
            if self.rank == 0:
                why = f"restart {restart} (torchrun)" if restart else "resume"
                print(f"[train] {why}: resumed from {ckpt} at step {start_step}, "
                      f"data position {self.consumed_samples}", flush=True)
        elif not resume and self.rank == 0 and (stale := list_checkpoints(out_dir, self.storage)):
            # a fresh run owns out_dir, as it owns train_log.jsonl: older checkpoints would be mistaken for ours
            print(f"[train] resume is off: removing {len(stale)} old checkpoint(s) under "
                  f"{join(out_dir, CHECKPOINTS_DIR)}", flush=True)
            for p in stale:
                remove_checkpoint(p, self.storage, ignore_errors=False)
        if self.rank == 0 and start_step == 0:
            remove(join(out_dir, CHECKPOINTS_DIR, MANIFEST), self.storage)
            remove(join(out_dir, SPIKE_LOG), self.storage)
            (self.log_dir / SPIKE_LOG).unlink(missing_ok=True)  # the same file unless out_dir is remote
        elif self.rank == 0 and self.remote:
            self.pull_logs()
        dist.barrier()
        if start_step == 0 and self.tcfg.init_from:
            self.init_from_champion()
        return start_step

    def init_from_champion(self) -> None:
        """Collective: step 0 of a continued run takes the weights (and, train.init_optimizer, the
        AdamW moments) of train.init_from, verified by its tree hash; rank 0 records in init.json
        what was loaded and the sha256 of the resulting weights."""
        tcfg = self.tcfg
        meta = init_from_checkpoint(self.model_parts, self.optimizer, tcfg.init_from, tcfg.init_sha256,
                                    with_optimizer=tcfg.init_optimizer, storage_options=self.storage)
        digest = weights_sha256(self.model_parts, self.pp_group)
        if self.rank == 0:
            source = tcfg.init_from if is_remote(tcfg.init_from) else str(Path(tcfg.init_from).resolve())
            record = {"init_from": source, "tree_sha256": tcfg.init_sha256,
                      "from_step": meta["step"], "from_run": meta.get("run_name"),
                      "optimizer_moments": tcfg.init_optimizer, "weights_sha256": digest}
            write_text(join(self.out_dir, INIT_FILE), json.dumps(record, indent=2) + "\n", self.storage)
            print(f"[train] initialised from {tcfg.init_from} (step {meta['step']} of {meta.get('run_name')}"
                  f"{', with its AdamW moments' if tcfg.init_optimizer else ''}); weights sha256 {digest[:16]}",
                  flush=True)

    # ------------------------------------------------------------------ the loop

    def train(self) -> int:
        tcfg = self.tcfg
        step = self.start_step = self.resume_or_clean()
        self.write_layout()
        if self.rank == 0:
            self.open_metrics()
        self.ckpt_group = new_checkpoint_group() if tcfg.async_checkpoint else None
        stop = tcfg.stop_at_step or tcfg.max_steps
        for part in self.model_parts:
            part.train()
        while step < stop:
            step += 1
            result = self.train_step(step)
            self.log_step(result)
            if result.spike is not None and (rolled_back_to := self.on_spike(result)) is not None:
                step = rolled_back_to
                continue
            self.maybe_checkpoint(step, result.loss, stop)
        self.finish_checkpoint()
        if self.metrics is not None:
            self.metrics.close()
            self.events.drain()
        if self.remote:  # every node's launcher reads the run's final log from the store once torchrun exits
            self.push_logs()
            dist.barrier()
        return 0

    def train_step(self, step: int) -> StepResult:
        """One optimizer step over the global batch; a batch the spike detector flags is skipped
        (no update). Raises FloatingPointError on a non-finite loss with spike detection off."""
        t0 = time.perf_counter()
        tcfg = self.tcfg
        if self.ramp is not None:  # this step's batch, and the warm-up, follow the ramp's tokens
            self.global_samples = self.ramp.samples_at(self.ramp_tokens)
            self.accum = self.ramp.micro_batches_at(self.ramp_tokens)
            self.ramp_tokens += self.global_samples * self.gcfg.seq_len
            lr = lr_at(step, tcfg, self.ramp_tokens, self.full_samples * self.gcfg.seq_len)
        else:
            lr = lr_at(step, tcfg)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        pos = self.data.step_start(self.consumed_samples)
        loss_sum = self.forward_backward(step, pos)
        # total norm before clipping, identical on every rank: DDP all-reduces the gradients; sharded
        # DTensor gradients (FSDP2, TP, experts) and pipeline stages are reduced over their meshes
        grad_norm = clip_grad_norm_(self.model_parts, tcfg.grad_clip, self.pp_group)
        loss_val, z_val = self.reduce_losses(loss_sum)
        spike = self.detector.check(loss_val, grad_norm) if tcfg.spike_detection else None
        if spike is None and not math.isfinite(loss_val):
            raise FloatingPointError(f"loss is {loss_val} at step {step} (lr {lr:.3g}): stopping")
        if spike is None:
            self.optimizer.step()
            self.moe_stats = self.balance_experts(update=True)
            self.detector.healthy(loss_val, grad_norm)
        else:
            self.optimizer.zero_grad(set_to_none=True)  # skip the batch: no update
            self.moe_stats = self.balance_experts(update=False)
        end = pos + self.global_samples
        self.consumed_samples = end
        return StepResult(step, pos, end, lr, loss_val, z_val, grad_norm, spike, time.perf_counter() - t0)

    def balance_experts(self, update: bool) -> dict:
        """MoE: the step's tokens per expert summed over the data-parallel and cp ranks, the experts' selection
        bias moved towards balance (not for a skipped batch), counts reset; per-layer stats for the log.
        Collective (dp group, and pp group for the other stages' layers)."""
        return balance_experts(self.model_parts, self.tokens_group, self.pp_group, update_bias=update)

    def reduce_losses(self, loss_sum: torch.Tensor) -> tuple[float, float]:
        """(cross-entropy, z-loss) of the step: this rank's micro-batch mean, averaged over the
        data-parallel and cp ranks (the tp ranks of a replica hold the same values; the cp ranks the
        means over their slices, each as many tokens, so their mean is the sequence's)."""
        loss_avg = loss_sum / self.accum
        dist.all_reduce(loss_avg, op=dist.ReduceOp.SUM, group=self.tokens_group)  # gloo has no AVG
        return loss_avg[0].item() / self.tokens_ranks, loss_avg[1].item() / self.tokens_ranks

    def grad_sync(self, last_micro: bool) -> contextlib.AbstractContextManager:
        """Gradients are reduced across data-parallel ranks only on the last micro-batch of a step."""
        stack = contextlib.ExitStack()
        for part in ([self.wrapped] if self.mesh is None else self.model_parts):
            stack.enter_context(grad_sync_context(part, last_micro))
        return stack

    def forward_backward(self, step: int, pos: int) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches of the step starting at loader
        position `pos`, gradients reduced on the last; returns the summed (cross-entropy, z-loss)."""
        tcfg, device, accum = self.tcfg, self.device, self.accum
        # MoE aux losses weigh as a micro-batch's loss: 1 / micro-batches (the pipeline's loss_fn divides so)
        set_moe_loss_scale(self.model_parts, 1 / (self.dims.pp_microbatches if self.dims.pp > 1 else accum))
        if self.pipeline is not None:
            return self.pipeline_forward_backward(pos)
        loss_sum = torch.zeros(2, device=device)  # cross-entropy, z-loss
        for micro in range(accum):
            x, y = self.micro_batch(pos, micro)
            doc_ids = positions = None
            if tcfg.doc_mask:
                doc_ids, positions = (t.to(device) for t in
                                      self.data.micro_batch_documents(pos, micro, self.dp_rank, self.dp_size))
                if self.context_parallel is not None:  # the mask needs every key's document: doc_ids stay whole
                    positions = self.context_parallel.shard(positions)
            x, y = x.to(device), y.to(device)
            with self.grad_sync(micro == accum - 1):
                with autocast_context(tcfg, device, self.wrapped):
                    logits, _ = self.wrapped(x, doc_ids=doc_ids, positions=positions)
                    loss, ce, z = self.compute_loss(logits, y)
                if self.rank == 0 and micro == 0 and step == self.start_step + 1:  # what the forward really ran in
                    print(f"[train] forward computes in {logits.dtype}; the optimizer updates "
                          f"{self.optimizer.param_groups[0]['params'][0].dtype} weights", flush=True)
                (loss / accum).backward()
            loss_sum[0] += ce.detach()
            if z is not None:
                loss_sum[1] += z.detach()
        return loss_sum

    def pipeline_forward_backward(self, pos: int) -> torch.Tensor:
        """pp > 1: this data-parallel rank's micro-batches of the step as one batch, which the pipeline
        schedule splits into pp_microbatches (the stages reduce gradients over dp after the last).
        Returns the (cross-entropy, z-loss) batch mean x accum: the sum forward_backward returns."""
        xs, ys = zip(*(self.micro_batch(pos, micro) for micro in range(self.accum)))
        return self.pipeline.step(torch.cat(xs), torch.cat(ys)) * self.accum

    def micro_batch(self, pos: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of this rank's micro-batch `micro` of the step starting at `pos`: the slice
        of its data-parallel rank (every tp / pp / cp rank of a replica reads the same); with cp > 1
        this rank's positions of each sequence."""
        x, y = self.data.micro_batch(pos, micro, self.dp_rank, self.dp_size)
        if self.context_parallel is not None:
            x, y = self.context_parallel.shard(x), self.context_parallel.shard(y)
        return x, y

    def compute_loss(self, logits: torch.Tensor, targets: torch.Tensor):
        """(loss to backpropagate, cross-entropy, z-loss or None) of one micro-batch."""
        return lm_loss(logits, targets, self.tcfg.z_loss)

    # ------------------------------------------------------------------ loss spikes

    def on_spike(self, result: StepResult) -> int | None:
        """The step's batch was skipped. On a persistent spike (spike_rollback_after in a row) roll
        back to the newest checkpoint before it and skip the data since; with no checkpoint to roll
        back to (or spike_max_rollbacks reached) re-baseline the detector instead, so a level shift
        is adopted rather than skipped for ever. Returns the step rolled back to, else None."""
        step, pos, end = result.step, result.pos, result.end
        persistent = self.detector.spiked(step, pos, result.loss, result.grad_norm)
        self.report_spike(step, "skip", **result.spike, data_range=[pos, end],
                          consecutive=self.detector.consecutive)
        if not persistent:
            return None
        first_step = self.detector.streak_first_step
        self.finish_checkpoint()  # a checkpoint still being written may be the rollback target
        target = latest_checkpoint(self.out_dir, before_step=first_step, storage_options=self.storage)
        if target is not None and self.rollbacks < self.tcfg.spike_max_rollbacks:
            return self.roll_back(target, step, end)
        why = "no checkpoint before the spike" if target is None else "spike_max_rollbacks reached"
        baseline = self.detector.rebaseline()
        self.report_spike(step, "rebaseline", reason=why, spike_steps=[first_step, step], **baseline)
        return None

    def roll_back(self, target: Path | str, step: int, end: int) -> int:
        """Restore checkpoint `target` and skip the data of the current spike streak (which ends
        at `step`, loader position `end`) from now on. Returns the step restored."""
        first_step, bad_start = self.detector.streak_first_step, self.detector.streak_start
        ranges = list(self.skip_ranges) + [(bad_start, end)]
        rollbacks = self.rollbacks + 1
        to_step = self.restore(target)
        self.skip_ranges, self.rollbacks = ranges, rollbacks
        self.data.skip_ranges = list(ranges)
        if self.metrics is not None:
            self.metrics.rewind(to_step)
        self.report_spike(to_step, "rollback", to_checkpoint=name_of(target), to_step=to_step,
                          skipped_data=[bad_start, end], spike_steps=[first_step, step], rollbacks=rollbacks)
        return to_step

    def report_spike(self, step: int, action: str, **details) -> None:
        """Rank 0: spikes.jsonl and MLflow (MetricsLogger.log_spike), and the event sink."""
        if self.metrics is not None:
            self.metrics.log_spike(step, action, **details)
            self.events.spike(action, step, self.job.run_id, self.job.run_name, **details)

    # ------------------------------------------------------------------ checkpoints

    def maybe_checkpoint(self, step: int, train_loss: float, stop: int) -> None:
        """Save at every checkpoint_every steps and at the last step. One save in flight at a time:
        an async one is published before the next starts."""
        tcfg = self.tcfg
        if not (step % tcfg.checkpoint_every == 0 or step == tcfg.max_steps or step == stop):
            return
        state = self.state_dict()
        self.finish_checkpoint()
        self.pending = start_checkpoint(self.model_parts, self.optimizer, step, self.out_dir,
                                        {**self.checkpoint_meta(), "train_loss": train_loss, "trainer": state},
                                        rng_state=capture_rng_state(self.data_rng),
                                        async_save=tcfg.async_checkpoint, process_group=self.ckpt_group,
                                        storage_options=self.storage)
        if not tcfg.async_checkpoint:
            self.finish_checkpoint()

    def finish_checkpoint(self) -> None:
        """Wait for the pending checkpoint, publish it, then (rank 0) manifest/retention and event:
        nothing refers to a checkpoint before it is complete."""
        if self.pending is None:
            return
        done, self.pending = self.pending, None
        path = done.wait_and_finalize()
        if self.rank == 0:
            apply_retention(self.out_dir, path, self.tcfg.keep_last_checkpoints, self.tcfg.keep_best_checkpoints,
                            storage_options=self.storage)
            self.push_logs()
            how = (f" (async: blocked {done.blocked_s:.2f}s, written in {done.write_s:.2f}s)"
                   if done.is_async else "")
            print(f"[checkpoint] step {done.step} -> {path}{how}", flush=True)
            self.events.checkpoint_saved(path, step=done.step, run_id=self.job.run_id, run_name=self.job.run_name)

    def checkpoint_meta(self) -> dict:
        """What every checkpoint's meta records besides the step, loss and loop state."""
        tcfg = self.tcfg
        return {
            "model": self.gcfg.to_dict(),
            "vocab_size": self.gcfg.vocab_size,
            "eos_id": self.index["eos_id"],
            "tokenizer_sha256": self.index.get("tokenizer_sha256"),
            "tokens_index_sha256": self.index_sha256,
            "tokens_val_sha256": self.index["splits"].get("val", {}).get("sha256"),
            "tokens_index": (self.job.tokens_index if is_remote(self.job.tokens_index)
                             else str(Path(self.job.tokens_index).resolve())),
            "run_name": self.job.run_name,
            "run_id": self.job.run_id,
            "world_size": self.world,
            "layout": self.layout_summary(),
            "global_batch_samples": self.global_samples,
            "train_options": {k: getattr(tcfg, k) for k in ("parallelism", "dtype", "compile", "doc_mask", "z_loss",
                                                            "activation_checkpointing")},
            "schedule": schedule_record(tcfg, self.ramp and self.ramp.record(self.ramp_tokens)),
        }

    # ------------------------------------------------------------------ the layout

    def layout_summary(self) -> dict:
        """The resolved layout (ParallelDims' fields and its one-line description): checkpoints
        record it, MLflow params and layout.json show it."""
        return {**dataclasses.asdict(self.dims), "describe": self.dims.describe()}

    def write_layout(self) -> None:
        """Collective: rank 0 writes out_dir/layout.json with every rank's record of what was built
        (mesh coordinates, parameter placements and local shapes, checkpointed blocks), the layout and
        `layout_info` (fields other parts of the trainer add, such as pipeline stages)."""
        mine = {**rank_layout(self.model_parts, self.rank, self.mesh),
                "dp_rank": self.dp_rank, "pp_rank": self.pp_rank}
        if self.context_parallel is not None:  # the sequence positions this rank's attention queries hold
            mine["context_parallel"] = self.context_parallel.record()
        gathered = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if self.rank == 0:
            record = {"dims": self.layout_summary(), "mesh": {d: getattr(self.dims, d) for d in MESH_DIMS},
                      "global_batch_samples": self.global_samples, "micro_batches_per_rank": self.accum,
                      "activation_checkpointing": self.tcfg.activation_checkpointing,
                      **self.layout_info, "ranks": gathered}
            write_text(join(self.out_dir, LAYOUT_FILE), json.dumps(record, indent=1) + "\n", self.storage)

    # ------------------------------------------------------------------ metrics (rank 0)

    def push_logs(self) -> None:
        """Rank 0 of a run with a remote out_dir: copy train_log.jsonl and spikes.jsonl to it."""
        if not self.remote or self.rank != 0:
            return
        for name in (TRAIN_LOG, SPIKE_LOG):
            if (self.log_dir / name).is_file():
                upload(self.log_dir / name, join(self.out_dir, name), self.storage)

    def pull_logs(self) -> None:
        """Rank 0 resuming a remote run: its logs as the store has them (this node may never have run it)."""
        for name in (TRAIN_LOG, SPIKE_LOG):
            (self.log_dir / name).unlink(missing_ok=True)
            if is_file(join(self.out_dir, name), self.storage):
                download_file(join(self.out_dir, name), self.log_dir / name, self.storage)

    def open_metrics(self) -> None:
        """Rank 0: the metrics logger (train_log.jsonl kept up to the start step), the run's
        params, and the start-up lines."""
        tcfg, gcfg, G, train_tokens = self.tcfg, self.gcfg, self.global_samples, self.index["splits"]["train"]["tokens"]
        self.metrics = MetricsLogger(self.log_dir, tcfg.max_steps, tcfg.log_every,
                                     tracking_uri=self.job.mlflow_tracking_uri, run_id=self.job.mlflow_run_id,
                                     resume_step=self.start_step)
        layout = {f"layout.{k}": v for k, v in self.layout_summary().items()}
        self.metrics.log_params({**flat_params(self.cfg), **layout, "n_params": self.n_params,
                                 "world_size": self.world, "vocab_size": gcfg.vocab_size, "train_tokens": train_tokens,
                                 "global_batch_samples": G, "grad_accum_steps_effective": self.accum})
        # the ddp / fsdp2 shorthand is named only where it chose the layout (train.parallel left at its defaults)
        shorthand = "" if tcfg.parallel != type(tcfg.parallel)() else f"{tcfg.parallelism} "
        print(f"[train] {self.n_params:,} params | layout {self.dims.describe()} | {shorthand}{tcfg.dtype}"
              f"{' compiled' if tcfg.compile else ''}{' doc-mask' if tcfg.doc_mask else ''} | "
              f"world {self.world} x {tcfg.threads_per_proc} threads | "
              f"global batch {G} x {gcfg.seq_len} tokens ({self.accum} micro-batch(es) per data-parallel rank) | "
              f"train split {train_tokens:,} tokens | steps {self.start_step + 1}..{tcfg.max_steps}",
              flush=True)
        print(f"[train] {describe_built(self.model_parts[0], self.wrapped)}", flush=True)
        if self.context_parallel is not None:
            cp = self.context_parallel
            print(f"[train] context parallel: cp {cp.cp}, each rank attends from {cp.local_len} of {cp.seq_len} "
                  f"positions (load-balanced chunks), K/V all-gathered per attention layer", flush=True)

    def log_step(self, r: StepResult) -> None:
        if self.metrics is None:
            return
        tokens_per_step = self.global_samples * self.gcfg.seq_len
        values = {"loss": r.loss, "grad_norm": r.grad_norm, "lr": r.lr, "tokens_per_s": tokens_per_step / r.seconds,
                  "flops_per_s": self.flops_per_token * tokens_per_step / r.seconds / self.world}
        if self.tcfg.z_loss:
            values["z_loss"] = r.z_loss
        if self.tcfg.peak_flops_per_s:
            values["mfu"] = values["flops_per_s"] / self.tcfg.peak_flops_per_s
        values["data_start"] = r.pos
        if self.ramp is not None:
            values["batch_tokens"] = (r.end - r.pos) * self.gcfg.seq_len
        if r.spike is not None:
            values["skipped"] = 1
        values.update(moe_metrics(self.moe_stats))  # moe/layer{i}/imbalance, moe/layer{i}/tokens_e{j}
        self.metrics.log_step(r.step, **values)
