"""The training layout as one DeviceMesh of named dimensions (torchtitan's ParallelDims).

    world = pp x dp_replicate x dp_shard x cp x tp        ep borrows ranks from dp_shard

`ParallelDims.from_config` resolves train.parallel (and the `parallelism: ddp | fsdp2` shorthand)
against the world size and the model, and refuses a layout that cannot run (heads or layers not
divisible, too few pipeline micro-batches, ...) naming the field, before any process starts: the
pipeline config's validator calls it, so `crucible run` fails at load time. `build_mesh` makes the
DeviceMesh inside the worker. No torch import at module level: the config module imports this.
"""
from __future__ import annotations

from dataclasses import dataclass

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class LayoutError(ValueError):
    """A train.parallel layout that cannot run; the message names the field."""


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    world: int
    legacy_ddp: bool = False  # the `parallelism: ddp` shorthand: DistributedDataParallel over all ranks
    sequence_parallel: bool = True
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1
    stages_per_rank: int = 1  # pipeline stages each pp rank holds (2 for interleaved_1f1b)

    # ------------------------------------------------------------------ resolution and checks

    @classmethod
    def from_config(cls, cfg, world: int | None = None) -> "ParallelDims":
        """The layout of `cfg` (a PipelineConfig) on `world` ranks (default nnodes x nproc_per_node).
        Raises LayoutError naming the field of the first thing that cannot run."""
        tcfg, mcfg = cfg.train, cfg.model
        p = tcfg.parallel
        world = world or tcfg.nnodes * tcfg.nproc_per_node
        explicit = (p.tp, p.pp, p.cp, p.ep, p.dp_replicate) != (1, 1, 1, 1, 1) or p.dp_shard != -1
        legacy_ddp = tcfg.parallelism == "ddp" and not explicit
        others = p.pp * p.dp_replicate * p.cp * p.tp
        if legacy_ddp:
            dp_replicate, dp_shard = world, 1
        else:
            dp_replicate = p.dp_replicate
            if p.dp_shard == -1:
                if world % others:
                    raise LayoutError(f"train.parallel: pp x dp_replicate x cp x tp = {others} does not divide "
                                      f"the world size {world} (train.nnodes x train.nproc_per_node)")
                dp_shard = world // others
            else:
                dp_shard = p.dp_shard
        if dp_shard == 0:
            raise LayoutError("train.parallel.dp_shard must be -1 (the rest of the world) or a positive size")
        product = p.pp * dp_replicate * dp_shard * p.cp * p.tp
        if product != world:
            raise LayoutError(f"train.parallel: pp {p.pp} x dp_replicate {dp_replicate} x dp_shard {dp_shard} x "
                              f"cp {p.cp} x tp {p.tp} = {product}, but the world size is {world} "
                              f"(train.nnodes x train.nproc_per_node)")
        stages_per_rank = 2 if p.pp_schedule == "interleaved_1f1b" else 1
        microbatches = p.pp_microbatches or p.pp * stages_per_rank
        dims = cls(pp=p.pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=p.cp, tp=p.tp, ep=p.ep, world=world,
                   legacy_ddp=legacy_ddp, sequence_parallel=p.sequence_parallel, pp_schedule=p.pp_schedule,
                   pp_microbatches=microbatches if p.pp > 1 else 1, stages_per_rank=stages_per_rank)
        dims.check(cfg)
        return dims

    def check(self, cfg) -> None:
        """Each dimension against the model and the batch."""
        tcfg, mcfg = cfg.train, cfg.model
        moe = mcfg.moe
        if self.cp > 1:
            check_cp(self, mcfg)
        if self.tp > 1:
            if mcfg.n_head % self.tp:
                raise LayoutError(f"train.parallel.tp ({self.tp}) must divide model.n_head ({mcfg.n_head})")
            hidden = mlp_hidden(mcfg.d_model, mcfg.mlp_ratio)
            if hidden % self.tp:
                raise LayoutError(f"train.parallel.tp ({self.tp}) must divide the MLP hidden size ({hidden}, "
                                  f"from model.d_model and model.mlp_ratio)")
            if self.sequence_parallel and (mcfg.seq_len // self.cp) % self.tp:
                per_cp = f" / cp ({self.cp}), the tokens a cp rank holds," if self.cp > 1 else ""
                raise LayoutError(f"train.parallel.tp ({self.tp}) must divide model.seq_len ({mcfg.seq_len})"
                                  f"{per_cp} with sequence parallelism (train.parallel.sequence_parallel)")
            if tcfg.compile and tcfg.activation_checkpointing == "full":
                # torch 2.13: the compiled tensor-parallel block saves a DeviceMesh for its backward,
                # which the checkpoint's saved-tensor check rejects at the first step
                raise LayoutError("train.activation_checkpointing: full cannot checkpoint torch.compile'd "
                                  "tensor-parallel blocks (train.compile with train.parallel.tp > 1); use "
                                  "selective, or train.compile: false")
        if self.ep > 1:
            if not moe.n_experts:
                raise LayoutError("train.parallel.ep > 1 needs a mixture-of-experts model (model.moe.n_experts)")
            if moe.n_experts % self.ep:
                raise LayoutError(f"train.parallel.ep ({self.ep}) must divide model.moe.n_experts ({moe.n_experts})")
            if self.dp_shard % self.ep:
                raise LayoutError(f"train.parallel.ep ({self.ep}) must divide dp_shard ({self.dp_shard}): "
                                  f"expert parallelism borrows those ranks")
        if self.pp > 1:
            stages = self.pp * self.stages_per_rank
            if mcfg.n_layer % stages:
                raise LayoutError(f"train.parallel.pp: model.n_layer ({mcfg.n_layer}) must split evenly into "
                                  f"{stages} pipeline stages (pp {self.pp} x {self.stages_per_rank} per rank "
                                  f"for {self.pp_schedule})")
            if mcfg.tie_embeddings:
                raise LayoutError("train.parallel.pp > 1 needs model.tie_embeddings: false (the embedding and "
                                  "the output head live on different pipeline stages)")
            if tcfg.doc_mask:
                raise LayoutError("train.doc_mask is not supported with train.parallel.pp > 1")
            if self.pp_microbatches < self.pp:
                raise LayoutError(f"train.parallel.pp_microbatches ({self.pp_microbatches}) must be at least "
                                  f"pp ({self.pp}): fewer leave pipeline stages idle for the whole step")
            if self.pp_schedule == "interleaved_1f1b" and self.pp_microbatches % self.pp:
                raise LayoutError(f"train.parallel.pp_microbatches ({self.pp_microbatches}) must be a multiple of "
                                  f"pp ({self.pp}) for interleaved_1f1b")
        samples, _ = self.global_batch(tcfg, mcfg.seq_len)
        if self.pp > 1 and (samples // self.dp) % self.pp_microbatches:
            raise LayoutError(f"train.parallel.pp_microbatches ({self.pp_microbatches}) must divide the "
                              f"{samples // self.dp} sequences each data-parallel rank trains per step")
        check_ramp(self, tcfg, mcfg.seq_len)

    def global_batch(self, tcfg, seq_len: int) -> tuple[int, int]:
        """(global samples per optimizer step, micro-batches per data-parallel rank per step): the batch
        is split over the dp ranks only (tp, pp and cp ranks of one replica see the same samples)."""
        per_micro = tcfg.micro_batch_size * self.dp
        if tcfg.batch_tokens is None:
            return per_micro * tcfg.grad_accum_steps, tcfg.grad_accum_steps
        if tcfg.batch_tokens % seq_len:
            raise LayoutError(f"train.batch_tokens ({tcfg.batch_tokens}) must be a multiple of model.seq_len "
                              f"({seq_len})")
        samples = tcfg.batch_tokens // seq_len
        if samples % per_micro:
            raise LayoutError(f"train.batch_tokens gives {samples} sequences per step, not a multiple of "
                              f"train.micro_batch_size x data-parallel ranks = {per_micro}")
        return samples, samples // per_micro

    # ------------------------------------------------------------------ derived sizes

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each sees different samples."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        if self.legacy_ddp:
            return f"ddp x{self.world}"
        parts = [f"{name} {getattr(self, name)}" for name in MESH_DIMS if getattr(self, name) > 1]
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        if self.pp > 1:
            parts.append(f"{self.pp_schedule} x{self.pp_microbatches} micro-batches")
        return " x ".join(parts) or "1 process"

    def build_mesh(self, device_type: str):
        """The world DeviceMesh with every dimension named (size-1 ones included), plus the flattened
        "dp" (dp_replicate x dp_shard: data loading), "dp_shard_cp" (FSDP) and "dp_cp" (the ranks that
        see different tokens: loss averaging, expert loads) meshes."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, tuple(getattr(self, d) for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)
        from tasks.train.torch_private import private

        flatten = private("DeviceMesh._flatten")
        flatten(mesh["dp_replicate", "dp_shard"], "dp")
        flatten(mesh["dp_shard", "cp"], "dp_shard_cp")
        flatten(mesh["dp_replicate", "dp_shard", "cp"], "dp_cp")
        return mesh


def check_cp(dims: ParallelDims, mcfg) -> None:
    """Context parallelism (tasks/train/context_parallel.py) against the model (it composes with
    every other dimension and with document masks); raises LayoutError naming the field."""
    if mcfg.seq_len % (2 * dims.cp):
        raise LayoutError(f"train.parallel.cp ({dims.cp}): model.seq_len ({mcfg.seq_len}) must be a multiple of "
                          f"2 x cp = {2 * dims.cp} (each cp rank takes two of 2 x cp equal chunks of every sequence)")


def step_granularity(dims: ParallelDims, tcfg) -> int:
    """Sequences the global batch must be a multiple of on this layout: one micro-batch per
    data-parallel rank, and with a pipeline pp_microbatches of them (each rank's batch splits into
    the schedule's micro-batches)."""
    g = tcfg.micro_batch_size * dims.dp
    return g * dims.pp_microbatches if dims.pp > 1 else g


def check_ramp(dims: ParallelDims, tcfg, seq_len: int) -> None:
    """The ramp settings against the layout; raises LayoutError naming the field."""
    start, length = tcfg.batch_ramp_start_tokens, tcfg.batch_ramp_tokens
    if start is None:
        if length:
            raise LayoutError("train.batch_ramp_tokens is set without train.batch_ramp_start_tokens "
                              "(the batch the ramp starts from)")
        return
    if not length:
        raise LayoutError("train.batch_ramp_tokens must be > 0 with train.batch_ramp_start_tokens: the tokens "
                          "over which the batch grows to the full batch")
    full = dims.global_batch(tcfg, seq_len)[0] * seq_len
    unit = step_granularity(dims, tcfg) * seq_len
    if start >= full:
        raise LayoutError(f"train.batch_ramp_start_tokens ({start}) must be below the full batch of {full} tokens "
                          "(train.batch_tokens, or micro_batch_size x dp x grad_accum_steps x seq_len)")
    if start % unit:
        raise LayoutError(f"train.batch_ramp_start_tokens ({start}) must be a multiple of the step granularity "
                          f"{unit} tokens (micro_batch_size {tcfg.micro_batch_size} x dp {dims.dp} x seq_len {seq_len}"
                          + (f" x pp_microbatches {dims.pp_microbatches}" if dims.pp > 1 else "") + ")")


def mlp_hidden(d_model: int, mlp_ratio: float = 8 / 3) -> int:
    """The dense SwiGLU MLP's hidden size: mlp_ratio x d_model rounded up to a multiple of 32 (one
    formula for the model, the layout checks and the planner)."""
    import math

    return 32 * math.ceil(int(mlp_ratio * d_model) / 32)
