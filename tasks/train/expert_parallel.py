"""Expert parallelism (train.parallel.ep): each MoE layer's experts sharded over ep ranks.

    world = pp x dp_replicate x dp_shard x cp x tp,   dp_shard -> (dp_shard_mod_ep, ep)

The ep ranks are carved out of dp_shard (torchtitan borrows them from the data-parallel ranks): an
ep group holds E/ep experts per rank and its ranks see different tokens. In each MoE layer a rank
routes its own tokens, sends every expert's token group to the rank holding that expert
(all_to_all_single, counts first), runs its local experts on what it received, and sends the
results back (the reverse all-to-all, also the backward of the first). Nothing is dropped.

Expert weights become DTensors Shard(0) on the ep mesh, so a DCP checkpoint records the global
(E, ...) tensors and loads into any layout (one process, FSDP, another ep). Gradients: a rank's
expert gradient sums the loss gradients of its whole ep group's tokens; the expert weights'
_ScaleGrad(1/ep) and FSDP's averaging over the remaining ranks that see other tokens and hold the
same experts (dp_replicate x dp_shard_mod_ep x cp) make it the average over all dp x cp ranks,
exactly what every other parameter gets.

`apply_ep` runs after tensor parallelism and before FSDP (tasks/train/parallelize.py): it shards
the experts, wraps each GroupedExperts in its own fully_shard over dp_replicate x dp_shard_mod_ep x cp
(even a single rank's: FSDP then leaves them alone when it wraps the block and the root, and casts
them like the rest under the mixed-precision policy), and installs the dispatchers.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from tasks.train.moe import counting, moe_layers


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: rows x[sum(in_splits[:r]) ...] go to rank r of `group`;
    the gradient travels the reverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return g, None, None, None


class ExpertDispatcher:
    """MoE.dispatcher under expert parallelism: (token rows grouped by global expert, counts (E,),
    the local GroupedExperts) -> the experts' outputs for those rows, in the same order."""

    def __init__(self, group, n_experts: int):
        self.group = group
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.n_local = n_experts // self.ep
        self.rows_sent_away = 0  # token rows sent to other ep ranks since balance_experts last logged them

    def __call__(self, routed: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        ep, n_local = self.ep, self.n_local
        # rank r holds experts [r * n_local, (r + 1) * n_local): rows grouped by expert are grouped by rank
        with torch.no_grad():
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts, group=self.group)  # n_local counts from/to each rank
            recv = recv.view(ep, n_local)  # [source rank, local expert]
            in_splits = counts.view(ep, n_local).sum(1).tolist()
            out_splits = recv.sum(1).tolist()
            # received rows come in (source, local expert) blocks; the experts want them by
            # (local expert, source): a stable sort of the block ids keeps each block's row order
            block = torch.repeat_interleave(torch.arange(ep * n_local, device=counts.device), recv.flatten())
            perm = torch.argsort((block % n_local) * ep + block // n_local, stable=True)
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        if experts.training and counting():
            self.rows_sent_away += sum(in_splits) - in_splits[self.rank]
        x = _AllToAll.apply(routed, out_splits, in_splits, self.group)
        y = experts(x[perm], recv.sum(0).tolist())[inverse]
        return _AllToAll.apply(y, in_splits, out_splits, self.group)


def expert_mesh(mesh, dims):
    """The world mesh with dp_shard split into ("dp_shard_mod_ep", "ep"), ep innermost (an ep group
    is ep consecutive dp_shard ranks), plus "dp_shard_mod_ep_cp", the ranks that hold the same experts
    and see other tokens within a replica: dp_shard_mod_ep, and the cp ranks (each with its own ep
    groups, over its slice of the sequences), registered on the world mesh (look it up there, with
    "dp_replicate" beside it for HSDP). Collective: creates the process groups."""
    from tasks.train.torch_private import private

    emesh = private("DeviceMesh._unflatten")(mesh, "dp_shard", (dims.dp_shard // dims.ep, dims.ep),
                                             ("dp_shard_mod_ep", "ep"))
    private("DeviceMesh._flatten")(emesh["dp_shard_mod_ep", "cp"], "dp_shard_mod_ep_cp")
    return emesh


def apply_ep(model: nn.Module, mesh, dims, *, mp_policy=None, reshard_after_forward: bool = True) -> None:
    """Shard every MoE layer's experts over the ep mesh of `mesh` (ParallelDims.build_mesh's world
    mesh) and FSDP-wrap them over the other data-parallel ranks; a no-op when dims.ep == 1 (the
    experts are then sharded with their block like any parameter). Call after tensor parallelism
    and before fully_shard of the blocks and the root. Collective."""
    if dims.ep <= 1:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    layers = moe_layers(model)
    if not layers:
        raise ValueError("train.parallel.ep > 1 but the model has no MoE layer")
    emesh = expert_mesh(mesh, dims)
    ep_mesh = emesh["ep"]
    shard_dim = "dp_shard_mod_ep_cp"  # dp_shard_mod_ep x cp: the same experts, other tokens
    fsdp_mesh = mesh["dp_replicate", shard_dim] if dims.dp_replicate > 1 else mesh[shard_dim]
    for _, moe in layers:
        experts = moe.experts
        for name in ("w1", "w3", "w2"):
            full = getattr(experts, name)
            # every rank built the same full weights from the seed: each keeps its rows, no communication
            local = distribute_tensor(full.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(local, requires_grad=full.requires_grad))
        experts.grad_scale = 1.0 / dims.ep
        moe.dispatcher = ExpertDispatcher(ep_mesh.get_group(), moe.n_experts)
        fully_shard(experts, mesh=fsdp_mesh, mp_policy=mp_policy or MixedPrecisionPolicy(),
                    reshard_after_forward=reshard_after_forward)

