"""Pipeline parallelism (train.parallel.pp > 1) with torch.distributed.pipelining, torchtitan style.

Every rank builds the full GPT from the same seed (so its weights equal a 1-process model's), then
keeps only its stages: the pipeline has pp x stages_per_rank stages (2 per rank for
interleaved_1f1b), stage s runs on pp rank s % pp ("loop" assignment: rank r holds stages r, r + pp,
...), each stage an even contiguous slice of the transformer blocks, the first also the token
embedding, the last the final norm and the output head.

A stage is a `GPTStage`, whose parameter names are exactly the full GPT's (tok_emb.weight,
blocks.{i}.…, norm.weight, lm_head.weight): its `blocks` ModuleList keeps a parameterless
`AbsentBlock` at every index it does not hold, and tok_emb / norm / lm_head are None where the
stage lacks them. So DCP checkpoints reshard between pipelined and unpipelined layouts by name,
and parallelize_fn (TP / FSDP / activation checkpointing) applies to each stage as to a GPT.

`build_pipeline` wraps each stage in a PipelineStage on mesh["pp"]'s group and builds the schedule
(1f1b, interleaved_1f1b or gpipe) over dims.pp_microbatches micro-batches. `Pipeline.step(x, y)`
runs forward and backward over one data-parallel rank's batch; the loss function divides each
micro-batch's loss by the number of micro-batches (the schedule's own scaling is off), so the
summed gradients are the mean over the rank's batch, as a 1-process step's are over its batch;
data parallelism then averages over dp ranks as without pipelining. The step's (cross-entropy,
z-loss) means are summed over the pp group, so every stage has them (for logging and spike checks).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from tasks.train.model import GPT, GPTConfig
from tasks.train.moe import uncounted
from tasks.train.torch_private import private

SCHEDULES = {"1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B", "gpipe": "ScheduleGPipe"}


class AbsentBlock(nn.Module):
    """Stands in a GPTStage's `blocks` for a layer another stage holds: no parameters, so the held
    blocks keep their index (and so their checkpoint names). Never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this pipeline stage does not hold that layer")


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The pipeline stages pp rank `pp_rank` runs (loop style: stage s on rank s % pp)."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def stage_layers(stage: int, n_stages: int, n_layer: int) -> range:
    """The transformer blocks of stage `stage`: an even contiguous slice (n_layer divisible is
    checked with the config, ParallelDims.check)."""
    if n_layer % n_stages:
        raise ValueError(f"{n_layer} layers do not split evenly into {n_stages} pipeline stages")
    per = n_layer // n_stages
    return range(stage * per, (stage + 1) * per)


def stage_layout(pp: int, stages_per_rank: int, n_layer: int) -> list[dict]:
    """What each pp rank holds, for the layout record: [{"pp_rank", "stages": [{"stage", "layers",
    "tok_emb", "lm_head"}]}]. The same on every rank (no communication)."""
    n_stages = pp * stages_per_rank
    return [{"pp_rank": r,
             "stages": [{"stage": s, "layers": list(stage_layers(s, n_stages, n_layer)),
                         "tok_emb": s == 0, "lm_head": s == n_stages - 1}
                        for s in stage_ids(r, pp, stages_per_rank)]}
            for r in range(pp)]


class GPTStage(nn.Module):
    """One pipeline stage of a GPT, holding the full model's own modules (not copies) for its
    layers. forward: token ids (first stage) or the previous stage's hidden states -> hidden states,
    or logits on the last stage. Runs GPT.forward's own middle (GPT._trunk) without document masks
    (refused with pp)."""

    def __init__(self, model: GPT, layers: range, first: bool, last: bool):
        super().__init__()
        cfg: GPTConfig = model.cfg
        self.cfg = cfg
        self.layers = list(layers)
        self.tok_emb = model.tok_emb if first else None
        self.drop = model.drop
        self.blocks = nn.ModuleList(model.blocks[i] if i in layers else AbsentBlock() for i in range(cfg.n_layer))
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        if last and self.lm_head is None:
            raise ValueError("a pipelined GPT needs an untied output head (model.tie_embeddings: false)")
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        # tokens per sequence of the current step: a later stage's input may be sequence-sharded
        # (tensor parallelism with sequence parallelism), so its own width is not the sequence length
        self.seq_len = cfg.seq_len
        self.context_parallel = None  # context_parallel.apply_cp: the stage sees this rank's slice of the sequence

    @property
    def is_first(self) -> bool:
        return self.tok_emb is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.context_parallel is not None:  # RoPE at the slice's global positions, as GPT.forward
            at = self.context_parallel.on("positions", self.rope_cos.device)
            cos, sin = self.rope_cos[at], self.rope_sin[at]
        else:
            cos, sin = self.rope_cos[:self.seq_len], self.rope_sin[:self.seq_len]
        return GPT._trunk(self, h, cos, sin, layers=self.layers)  # GPT.forward's own code


def split_model(model: GPT, pp_rank: int, pp: int, stages_per_rank: int) -> list[tuple[int, GPTStage]]:
    """(stage index, GPTStage) for each stage pp rank `pp_rank` runs, made of `model`'s modules."""
    n_stages = pp * stages_per_rank
    return [(s, GPTStage(model, stage_layers(s, n_stages, model.cfg.n_layer), s == 0, s == n_stages - 1))
            for s in stage_ids(pp_rank, pp, stages_per_rank)]


LossFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]]


class Pipeline:
    """This pp rank's part of the pipeline: its stage modules (after parallelize_fn) and the schedule.

    A schedule's stages learn the shapes they send and receive from the first step they run, and
    keep them: a step whose micro-batches have another shape (a batch-size ramp grows the batch)
    gets a schedule of its own, built once per shape over the same modules."""

    def __init__(self, model_parts: list[nn.Module], stage_indices: list[int], n_stages: int, schedule: str,
                 n_microbatches: int, pp_group: dist.ProcessGroup, device: torch.device, compute_loss: LossFn):
        from torch.distributed.pipelining import schedules

        self.model_parts, self.stage_indices, self.n_stages = model_parts, stage_indices, n_stages
        self.n_microbatches, self.pp_group, self.device = n_microbatches, pp_group, device
        self.schedule_cls = getattr(schedules, SCHEDULES[schedule])
        self.multi = issubclass(self.schedule_cls, schedules.PipelineScheduleMulti)
        if not self.multi and len(model_parts) != 1:
            raise ValueError(f"{schedule} runs one stage per pp rank, this rank has {len(model_parts)}")
        self._compute_loss = compute_loss
        self._schedules: dict[tuple[int, ...], object] = {}  # micro-batch shape -> schedule
        self._ce: list[torch.Tensor] = []
        self._z: list[torch.Tensor] = []

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_indices

    def _stages(self) -> list[GPTStage]:
        return [p for p in self.model_parts if isinstance(p, GPTStage)]

    def record(self) -> dict:
        """For the layout record: the schedule class, the micro-batches, and the stages every pp
        rank holds (stage_layout)."""
        pp, n_layer = dist.get_world_size(self.pp_group), self._stages()[0].cfg.n_layer
        return {"schedule": self.schedule_cls.__name__, "microbatches": self.n_microbatches,
                "ranks": stage_layout(pp, len(self.stage_indices), n_layer)}

    def schedule_for(self, shape: tuple[int, ...]):
        """The schedule for micro-batches of token shape `shape` (built on first use)."""
        if shape not in self._schedules:
            from torch.distributed.pipelining import PipelineStage

            stages = [PipelineStage(part, index, self.n_stages, self.device, group=self.pp_group)
                      for part, index in zip(self.model_parts, self.stage_indices)]
            schedule = self.schedule_cls(stages if self.multi else stages[0], n_microbatches=self.n_microbatches,
                                         loss_fn=self._loss, scale_grads=False)
            # the first step infers the stages' shapes by running them (forward and loss) once on
            # the first micro-batch: not a training forward, so MoE layers must not count its tokens
            private("_PipelineSchedule._initialize_pp_stages")  # a clear error if torch dropped it
            infer = schedule._initialize_pp_stages

            def initialize_uncounted(*args, **kwargs):
                with uncounted():
                    return infer(*args, **kwargs)
            schedule._initialize_pp_stages = initialize_uncounted
            self._schedules[shape] = schedule
        return self._schedules[shape]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one data-parallel rank's batch x, y (B, T), B split into
        n_microbatches. Collective over the pp group. Returns (cross-entropy, z-loss) averaged over
        the batch, the same on every pp rank (z-loss 0 when off)."""
        if x.size(0) % self.n_microbatches:
            raise ValueError(f"a batch of {x.size(0)} sequences does not split into {self.n_microbatches} "
                             f"pipeline micro-batches (train.parallel.pp_microbatches)")
        for part in self._stages():
            part.seq_len = x.size(1)
        schedule = self.schedule_for((x.size(0) // self.n_microbatches, x.size(1)))
        self._ce.clear()
        self._z.clear()
        target = y.to(self.device) if self.has_last else None
        if self.has_first:
            schedule.step(x.to(self.device), target=target)
        else:
            schedule.step(target=target)
        out = torch.zeros(2, device=self.device)
        if self.has_last:
            # a schedule's first step also calls the loss once to infer the backward's shapes: the
            # step's micro-batches are the last n_microbatches calls
            if len(self._ce) < self.n_microbatches:
                raise RuntimeError(f"the pipeline computed {len(self._ce)} micro-batch losses, "
                                   f"expected {self.n_microbatches}")
            out[0] = torch.stack(self._ce[-self.n_microbatches:]).sum()
            out[1] = torch.stack(self._z[-self.n_microbatches:]).sum()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.pp_group)  # only the last stage adds
        return out / self.n_microbatches

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: the trainer's loss of one micro-batch divided by the number of
        micro-batches (the schedule does not scale), its parts recorded for `step`."""
        total, ce, z = self._compute_loss(logits, targets)
        self._ce.append(ce.detach().float().reshape(()))
        self._z.append(torch.zeros((), device=ce.device) if z is None else z.detach().float().reshape(()))
        return total / self.n_microbatches


def build_pipeline(model: GPT, dims, mesh, device: torch.device, compute_loss: LossFn,
                   parallelize_fn: Callable[[nn.Module], nn.Module] | None = None) -> Pipeline:
    """This rank's stages of `model` (on the meta device, or built whole with the same seed on every
    rank), each passed through parallelize_fn (TP / FSDP / activation checkpointing; it may return the module it wraps in),
    run by PipelineStages on mesh["pp"] under the dims.pp_schedule schedule over
    dims.pp_microbatches micro-batches. compute_loss(logits, targets) -> (loss, ce, z or None)."""
    pp_mesh = mesh["pp"]
    pp_rank, pp_group = pp_mesh.get_local_rank(), pp_mesh.get_group()
    parts, indices = [], []
    for index, part in split_model(model, pp_rank, dims.pp, dims.stages_per_rank):
        if not any(t.is_meta for t in part.parameters()):  # meta: allocated after sharding (meta_init)
            part = part.to(device)
        if parallelize_fn is not None:
            part = parallelize_fn(part) or part
        parts.append(part)
        indices.append(index)
    return Pipeline(parts, indices, dims.pp * dims.stages_per_rank, dims.pp_schedule, dims.pp_microbatches,
                    pp_group, device, compute_loss)
