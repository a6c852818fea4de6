"""Build the model without its weights, shard it, then fill this rank's shards (meta-device init).

Every rank used to build the whole GPT on the CPU before parallelize_model sharded it: rank memory
had to hold the full model first. Now the trainer builds it on torch.device("meta") (shapes only),
applies TP / EP / FSDP2 (parallelize_model) and pipeline splitting to the meta model, moves each part
to the device with `to_empty`, and only then writes the weights into this rank's shards.

The weights equal, bitwise, those of `torch.manual_seed(seed); GPT(cfg)` (the old whole-model init, and
a 1-process run's): building on meta records every `torch.nn.init` call the constructors make (default
Linear/Embedding inits that the GPT's own init overwrites included, since they advance the CPU RNG), with
its arguments and the parameter's name. `materialize` reseeds the CPU generator and replays the calls in
the same order, each on a whole CPU tensor of that parameter's shape, and copies this rank's shard
(`distribute_tensor(..., src_data_rank=None)`, cut locally, no communication) into the parameter; a
parameter another pipeline stage holds is generated and dropped, so the RNG stream stays the same. The
peak is one whole parameter at a time, never the model. Tensors that no init function sets (RMSNorm's
ones, the MoE's zero buffers, the RoPE tables) are set by `_set_constants`; anything set by neither
raises, so a new module cannot silently start from uninitialised memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from tasks.train.metrics import clean_fqn
from tasks.train.model import GPT, GPTConfig, RMSNorm, rope_tables
from tasks.train.moe import MoE


@dataclass
class InitRecord:
    """The nn.init calls of one GPT construction, in order: (function, parameter name, shape, dtype, kwargs)."""
    seed: int
    calls: list[tuple] = field(default_factory=list)


class _RecordInits(TorchFunctionMode):
    """Records torch.nn.init calls (they dispatch through torch functions with the tensor as `tensor=`)."""

    def __init__(self, calls: list):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" and "tensor" in kwargs and not args:
            self.calls.append((func, kwargs["tensor"], {k: v for k, v in kwargs.items() if k != "tensor"}))
        return func(*args, **kwargs)


def build_on_meta(cfg: GPTConfig, seed: int) -> tuple[GPT, InitRecord]:
    """The GPT with meta tensors (no memory, no RNG drawn) and the record `materialize` replays."""
    raw: list = []
    with torch.device("meta"), _RecordInits(raw):
        model = GPT(cfg)
    names = {id(t): n for n, t in model.named_parameters()}
    record = InitRecord(seed)
    for func, t, kwargs in raw:
        if kwargs.get("generator") is not None:
            raise ValueError(f"{func.__name__} with its own generator cannot be replayed from the seed")
        if id(t) not in names:  # e.g. an init of a buffer or a temporary: not replayable by name
            raise ValueError(f"{func.__name__} on a tensor that is not a parameter of the GPT cannot be replayed")
        record.calls.append((func, names[id(t)], tuple(t.shape), t.dtype, kwargs))
    return model, record


def _local_shard(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        return distribute_tensor(full.to(target.to_local().device), target.device_mesh, target.placements,
                                 src_data_rank=None).to_local()
    return full


def _set_constants(part: nn.Module, cfg: GPTConfig, done: set[str]) -> None:
    """What the constructors set without an init function (kept in step with model.py and moe.py)."""
    for name, module in part.named_modules():
        prefix = clean_fqn(f"{name}." if name else "")
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
            done.add(prefix + "weight")
        elif isinstance(module, MoE):
            module.expert_bias.zero_()
            module.tokens_per_expert.zero_()
            done.update({prefix + "expert_bias", prefix + "tokens_per_expert"})
    if hasattr(part, "rope_cos"):
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        part.rope_cos.copy_(cos)
        part.rope_sin.copy_(sin)
        done.update({"rope_cos", "rope_sin"})


@torch.no_grad()
def materialize(parts: list[nn.Module], record: InitRecord, cfg: GPTConfig, device: torch.device) -> dict:
    """Allocate this rank's (sharded) parts on `device` and set their weights as `GPT(cfg)` after
    `torch.manual_seed(record.seed)` would: see the module docstring. Every rank calls it (no
    communication). Leaves the CPU RNG where the old init left it. Returns what it allocated, for
    layout.json: this rank's parameter bytes and the largest whole tensor it generated on the way."""
    owned: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for part in parts:
        part.to_empty(device=device)
        owned.update({clean_fqn(n): p for n, p in part.named_parameters()})
        _set_constants(part, cfg, done)
    torch.manual_seed(record.seed)
    largest = 0
    for func, name, shape, dtype, kwargs in record.calls:
        full = torch.empty(shape, dtype=dtype)
        largest = max(largest, full.nbytes)
        func(full, **kwargs)  # on the CPU generator, as the whole-model construction drew it
        if name in owned:
            target = owned[name]
            (target.to_local() if hasattr(target, "to_local") else target).copy_(_local_shard(full, target))
            done.add(name)
    missing = [n for part in parts for n, _ in list(part.named_parameters()) + list(part.named_buffers())
               if clean_fqn(n) not in done]
    if missing:
        raise RuntimeError(f"meta-device init left {missing[:5]} unset: give them an init in meta_init._set_constants")
    local = [(t.to_local() if hasattr(t, "to_local") else t) for t in owned.values()]
    return {"rank_param_bytes": sum(t.nbytes for t in local), "largest_init_tensor_bytes": largest}
