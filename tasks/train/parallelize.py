"""How the model is parallelized on the training layout's DeviceMesh, in torchtitan's order:

    context parallelism (K/V all-gather)          mesh["cp"]              tasks.train.context_parallel.apply_cp
    tensor parallelism (+ sequence parallelism)   mesh["tp"]              apply_tp
    expert parallelism (MoE)                      the ep mesh             tasks.train.expert_parallel.apply_ep
    activation checkpointing                      per block               apply_ac
    torch.compile                                 per block               compile_blocks
    FSDP2 (HSDP with dp_replicate > 1)            mesh["dp_shard_cp"]     apply_fsdp

`parallelize_model` applies them to a GPT or a pipeline stage of one (tasks/train/pipeline.py:
the same attribute names, tok_emb / norm / lm_head may be None and blocks other stages hold are
parameterless placeholders). The `parallelism: ddp` shorthand keeps DistributedDataParallel
(`parallelize`). The training worker and benchmarks/gpu_mfu.py build the model through these, so
a benchmark measures what training runs.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tasks.train.moe import MoE
from tasks.train.torch_private import private


def _blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(index, block) of the transformer blocks this model (or pipeline stage) holds: a stage's
    placeholders for other stages' layers have no parameters and are skipped."""
    return [(i, b) for i, b in enumerate(model.blocks) if any(True for _ in b.parameters())]


# ---------------------------------------------------------------------- tensor parallelism

def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = True) -> None:
    """Megatron tensor parallelism with torch's parallelize_module (torchtitan's Llama plan), in place.

    Per block: the q/k/v projections and the MLP's gate/up are split by output rows (ColwiseParallel:
    each rank computes its heads and its slice of the hidden layer), the attention output and the
    MLP's down projection by input columns (RowwiseParallel), so each block costs one all-reduce
    forward and one backward per sublayer. With sequence parallelism the residual stream, the norms
    and the dropout between them hold 1/tp of the sequence (Shard(1)): the all-reduce becomes a
    reduce-scatter + all-gather pair and activation memory outside attention and MLP drops by tp.
    Attention gathers the whole sequence before its projections, so RoPE tables and document masks
    see every position. The embedding is split by vocabulary rows; the output head by vocabulary
    rows too (a tied head is the same Shard(0) weight), and the logits are gathered (Replicate) for
    the loss. Norm weights are replicated DTensors whose gradients are partial sums over the
    sequence shards (reduced by FSDP, which always wraps a mesh layout).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream between sublayers
    if model.tok_emb is not None:
        parallelize_module(model.tok_emb, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=seq))
    for _, block in _blocks(model):
        plan = {
            "attn": PrepareModuleInput(input_layouts=(seq, None, None, None),
                                       desired_input_layouts=(Replicate(), None, None, None), use_local_output=True),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
        if block.attn.q_norm is not None:
            # QK-norm weights act on this rank's heads (dim 2 of (B, T, heads, head_dim)): replicated
            # DTensors whose gradients sum over the head shards
            plan.update({"attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                         "attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)})
        if isinstance(block.mlp, MoE):
            # a sparse MLP runs whole on every tp rank of a replica, on the gathered sequence: routing,
            # expert-load counts, router losses and (under ep) the all-to-alls are exactly those of
            # one process, and its gradients need no tp reduction; the experts are sharded by ep
            plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True)
        else:
            plan.update({
                "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                          use_local_output=True),
                "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
                "mlp.w2": RowwiseParallel(output_layouts=seq),
            })
        parallelize_module(block, tp_mesh, plan)
    if model.norm is None:
        return
    if sequence_parallel:
        parallelize_module(model.norm, tp_mesh, SequenceParallel())  # output: a Shard(1) DTensor
    if model.lm_head is not None:
        # only the Shard(0) weight matters: GPT._head reads lm_head.weight (tied: tok_emb.weight,
        # already Shard(0) from the embedding's plan) with the final norm's output as a DTensor
        parallelize_module(model.lm_head, tp_mesh, ColwiseParallel())

    def head_input(module, args, out):  # the full sequence, replicated: logits come out vocab-sharded
        if not isinstance(out, DTensor):
            out = DTensor.from_local(out, tp_mesh, [Replicate()], run_check=False)
        return out.redistribute(tp_mesh, [Replicate()])

    def gather_logits(module, args, out):  # vocab-sharded logits -> every rank's full local logits
        def full(t):
            return t.redistribute(tp_mesh, [Replicate()]).to_local() if isinstance(t, DTensor) else t
        return tuple(full(t) for t in out) if isinstance(out, tuple) else full(out)

    model.norm.register_forward_hook(head_input)
    model.register_forward_hook(gather_logits)


# ---------------------------------------------------------------------- activation checkpointing

def _selective_policy_fn():
    """torchtitan's op-level selective checkpointing: keep the outputs of the expensive ops (matmuls,
    attention, reduce-scatters), except every second matmul, and recompute everything else (norms,
    RoPE, activations, elementwise) in the backward. A fresh counter per checkpointed forward, so the
    recomputation makes the same save/recompute choice as the forward did."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    # profiler markers compute nothing, but FSDP opens a different number of them in a forward and in
    # its recomputation (a one-rank FSDP group, as the experts' under ep with dp_shard == ep, skips its
    # all-gather in one only): counted, the recomputation finds no saved entry for them and stops.
    # torch ignores aten.detach for the same reason; add the markers to that set
    private("SAC_IGNORED_OPS").update({torch.ops.profiler._record_function_enter_new.default,
                                      torch.ops.profiler._record_function_exit._RecordFunction})
    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_cudnn_attention.default, torch.ops._c10d_functional.reduce_scatter_tensor.default,
            aten.max.default}
    counts = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = "recompute_mm" if ctx.is_recompute else "forward_mm"
        if func == aten.mm.default:
            counts[key] += 1
        keep = func in save and not (func == aten.mm.default and counts[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_ac(model: nn.Module, mode: str) -> None:
    """train.activation_checkpointing: "full" keeps only each block's input and recomputes the block
    in the backward; "selective" recomputes the cheap ops only (_selective_policy_fn); "none". Each
    block is replaced by a non-reentrant checkpoint_wrapper of itself (state dict keys unchanged:
    the wrapper strips its prefix). Full checkpointing of compiled tensor-parallel blocks is refused
    at config load (ParallelDims.check)."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"train.activation_checkpointing: unknown mode {mode!r}")
    CheckpointImpl, checkpoint_wrapper = private("CheckpointImpl"), private("checkpoint_wrapper")

    for i, block in _blocks(model):
        kw = {"context_fn": _selective_policy_fn} if mode == "selective" else {}
        # with dropout the recomputation must draw the forward's masks (else wrong gradients): the
        # RNG state is saved per block and replayed; without dropout that save is skipped
        dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in block.modules()) or any(
            isinstance(getattr(m, "dropout", None), float) and m.dropout > 0 for m in block.modules())
        wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                     preserve_rng_state=dropout, **kw)
        wrapped.ac_mode = mode
        model.blocks[i] = wrapped


# ---------------------------------------------------------------------- compile and data parallelism

def compile_blocks(model: nn.Module) -> None:
    """torch.compile every transformer block, in place (nn.Module.compile), so parameter names and
    checkpoints are unchanged; the per-block graph is the same for every layer (torchtitan style)."""
    for _, block in _blocks(model):
        block.compile()


def mp_policy(tcfg):
    """FSDP2's mixed precision: bf16 compute and all-gathers, fp32 gradient reduction and master weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if tcfg.dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, mesh, dims, tcfg) -> None:
    """FSDP2 fully_shard per block (one all-gather per block: memory holds one full block at a time),
    then the root (embedding, final norm, head), on mesh["dp_shard_cp"]; HSDP (replicate over
    dp_replicate, shard within dp_shard x cp) on the 2-D mesh when dp_replicate > 1. Tensor-parallel
    DTensors become 2-D (dp, tp) DTensors. Applied even when the data-parallel mesh has one rank: it
    casts under the mixed-precision policy and reduces the tensor-parallel partial gradients the same
    way for every layout. Under pipeline parallelism the parameters stay gathered between the
    micro-batches' forward and backward (torchtitan's default)."""
    from torch.distributed.fsdp import fully_shard

    fsdp_mesh = mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else mesh["dp_shard_cp"]
    kw = {"mesh": fsdp_mesh, "mp_policy": mp_policy(tcfg), "reshard_after_forward": dims.pp == 1}
    for _, block in _blocks(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def parallelize_model(model: nn.Module, dims, mesh, tcfg, device: torch.device) -> nn.Module:
    """Parallelize `model` (a GPT or a pipeline stage) in place on the world mesh of `dims`
    (ParallelDims.build_mesh) and return the module to call: `model` itself, or the DDP wrapper for
    the `parallelism: ddp` shorthand. Build the optimizer afterwards: parameters become DTensors.
    Collective: every rank calls it."""
    if dims.legacy_ddp:
        return parallelize(model, tcfg, device)
    if dims.cp > 1:  # before the wrappers: it marks the attention modules themselves
        from tasks.train.context_parallel import apply_cp

        apply_cp(model, mesh["cp"], model.cfg.seq_len)
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], dims.sequence_parallel)
        if tcfg.compile and model.tok_emb is not None:
            # the embedding's output is an AsyncCollectiveTensor (its reduce in flight); a compiled
            # block given one as input returns a wrong input gradient (torch 2.13): hand it a plain copy
            model.tok_emb.register_forward_hook(lambda module, args, out: out.clone())
    if dims.ep > 1 and any(isinstance(b.mlp, MoE) for _, b in _blocks(model)):
        from tasks.train.expert_parallel import apply_ep

        apply_ep(model, mesh, dims, mp_policy=mp_policy(tcfg), reshard_after_forward=dims.pp == 1)
    apply_ac(model, tcfg.activation_checkpointing)
    if tcfg.compile:
        compile_blocks(model)
    apply_fsdp(model, mesh, dims, tcfg)
    return model


def parallelize(model: nn.Module, tcfg, device: torch.device) -> nn.Module:
    """The `parallelism: ddp` shorthand (no mesh): checkpoint, compile and wrap in DDP over all ranks;
    returns the DDP wrapper. Every other layout, `fsdp2` included, goes through parallelize_model."""
    apply_ac(model, tcfg.activation_checkpointing)
    if tcfg.compile:
        compile_blocks(model)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


# ---------------------------------------------------------------------- what was built

def describe_built(model: nn.Module, wrapped: nn.Module) -> str:
    """What was actually built, per dimension, for the start-up line (the config only says what was
    asked for): the data-parallel wrapper and its mesh, parameters sharded on each mesh dimension
    (from the DTensors' placements), blocks checkpointed and compiled."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    on_dim: dict[str, int] = defaultdict(int)
    for p in params:
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(p.device_mesh.ndim))
            for name, placement in zip(names, p.placements):
                # FSDP over tp shards is a _StridedShard, no subclass of Shard: count what is not replicated
                if not (placement.is_replicate() or placement.is_partial()) and p.device_mesh.size(names.index(name)) > 1:
                    on_dim[name] += 1
    if isinstance(wrapped, DDP):
        how = f"DDP over {wrapped.process_group.size()} ranks"
    elif isinstance(model, FSDPModule):
        group = private("FSDPModule._get_fsdp_state")(model)._fsdp_param_group
        fsdp_mesh = group.mesh_info.mesh if group else None
        dims = "x".join(f"{n} {s}" for n, s in zip(fsdp_mesh.mesh_dim_names or ("dp",), fsdp_mesh.shape)) \
            if fsdp_mesh is not None else "?"
        how = f"{'HSDP' if fsdp_mesh is not None and fsdp_mesh.ndim == 2 else 'FSDP2'} on {dims}"
    else:
        how = type(wrapped).__name__
    blocks = [b for _, b in _blocks(model)]
    ac = [getattr(b, "ac_mode", None) for b in blocks]
    compiled = sum(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    sharded = ", ".join(f"{n} {c}" for n, c in sorted(on_dim.items())) or "none"
    ac_text = f"{sum(a is not None for a in ac)}/{len(blocks)} blocks checkpointed" + \
        (f" ({next(a for a in ac if a)})" if any(ac) else "")
    return (f"built {how}: {len(params)} parameters, sharded per mesh dim: {sharded}; {ac_text}; "
            f"{compiled}/{len(blocks)} blocks compiled")


# ---------------------------------------------------------------------- per-step contexts

def autocast_context(tcfg, device: torch.device, wrapped: nn.Module | None = None):
    """bf16 autocast where FSDP2 does not cast (DDP: weights stay fp32); FSDP2 casts through its
    MixedPrecisionPolicy. Without `wrapped`, decided by train.parallelism."""
    if tcfg.dtype != "bf16":
        return contextlib.nullcontext()
    if wrapped is not None:
        from torch.distributed.fsdp import FSDPModule

        fsdp = isinstance(wrapped, FSDPModule)
    else:
        fsdp = tcfg.parallelism == "fsdp2"
    return contextlib.nullcontext() if fsdp else torch.autocast(device.type, dtype=torch.bfloat16)


def grad_sync_context(wrapped: nn.Module, last_micro: bool):
    """Reduce gradients across ranks only on the last micro-batch of a step."""
    if isinstance(wrapped, DDP):
        return contextlib.nullcontext() if last_micro else wrapped.no_sync()
    wrapped.set_requires_gradient_sync(last_micro)  # FSDP2
    return contextlib.nullcontext()
