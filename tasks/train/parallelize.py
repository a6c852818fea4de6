"""How the model is compiled, wrapped for data parallelism (DDP or FSDP2) and run in mixed precision.

The training worker and benchmarks/gpu_mfu.py build the model through these, so a benchmark
measures what training runs.
"""
from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tasks.train.model import GPT


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
