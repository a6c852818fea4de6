"""The total gradient norm of a model laid out on a DeviceMesh, and clipping by it (torchtitan's
dist_utils.clip_grad_norm_, generalised to gradients on several meshes).

A rank's gradients may be plain tensors (one process, DDP: already equal on every rank) or DTensors
on different meshes: FSDP2's dp_shard mesh, a 2-D (dp_shard, tp) mesh under FSDP + TP, an expert mesh.
torch.nn.utils.clip_grad_norm_ stacks the per-tensor norms, which fails for DTensors of different
meshes, so here each gradient contributes the sum of squares of its local shard; the sums of the
gradients sharded over the same mesh dimensions are added up and all-reduced over exactly those
dimensions (a dimension a gradient is replicated over holds copies: summing it would count them
twice). A gradient still Partial on a dimension is reduced there first. Under pipeline parallelism
each pp rank holds other layers: the squares are summed over the "pp" group too. Every rank ends
with the same total norm, equal to one process's up to float rounding.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn


def _grads(parts: Iterable[nn.Module]) -> list[torch.Tensor]:
    return [p.grad for part in parts for p in part.parameters() if p.grad is not None]


def total_norm(parts: Iterable[nn.Module], pp_group: "dist.ProcessGroup | None" = None) -> torch.Tensor:
    """The L2 norm of all gradients of the model (fp32 scalar tensor, identical on every rank).
    `parts`: the rank's model parts; `pp_group`: the "pp" mesh group when the stages are spread
    over ranks (None without pipeline parallelism)."""
    from torch.distributed.tensor import DTensor, Replicate

    grads = _grads(parts)
    device = grads[0].device if grads else torch.device("cpu")
    # (mesh, the mesh dims the gradient is sharded over) -> local sum of squares
    sums: dict[tuple, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float32, device=device))
    for g in grads:
        if not isinstance(g, DTensor):
            sums[(None, ())] += g.detach().float().square().sum()
            continue
        if any(p.is_partial() for p in g.placements):  # unreduced: reduce it (rare)
            g = g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])
        # any placement but Replicate splits the tensor: Shard, and FSDP's _StridedShard over TP shards
        # (which is no subclass of Shard)
        sharded = tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())
        sums[(g.device_mesh, sharded)] += g.to_local().detach().float().square().sum()
    total = torch.zeros((), dtype=torch.float32, device=device)
    # the same keys in the same order on every rank of a mesh: gradients are built by the same code
    for (mesh, dims), s in sums.items():
        for d in dims:  # reducing one dimension after another sums over their product
            dist.all_reduce(s, op=dist.ReduceOp.SUM, group=mesh.get_group(d))
        total += s
    if pp_group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
    return total.sqrt()


def clip_grad_norm_(parts: Iterable[nn.Module], max_norm: float,
                    pp_group: "dist.ProcessGroup | None" = None) -> float:
    """Scale every gradient by min(1, max_norm / total norm) in place (torch's clip_grad_norm_
    rule, eps 1e-6); returns the total norm before clipping as a float."""
    from torch.distributed.tensor import DTensor

    parts = list(parts)
    norm = total_norm(parts, pp_group)
    value = float(norm)
    coef = max_norm / (value + 1e-6)
    if coef < 1.0 and math.isfinite(value):
        for g in _grads(parts):
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return value
