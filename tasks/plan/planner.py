"""Scaling-law planner: model size, tokens, FLOPs, time, cost and a parallel layout.

Conventions (each one is also written into the plan's `assumptions`):

* Compute-optimal data: D = tokens_per_param x N (Chinchilla, Hoffmann et al. 2022; 20 by default).
  A FLOP budget C alone is read in the same 6ND convention Chinchilla uses, so N = sqrt(C / (6 x 20))
  and D = 20 N: 1e22 FLOPs gives about 9.13e9 parameters and 1.83e11 tokens.
* Training FLOPs per token = 6 N + 12 L d T (PaLM, Chowdhery et al. 2022, appendix B: 6N + 12 L H Q T,
  where H heads x Q head width = d_model and T = sequence length; the same count torchtitan uses for
  MFU). The 12 is 2 attention matmuls (QK^T and AV) x 3 (forward + backward) x 2 FLOPs per
  multiply-add; the causal mask's halving is not discounted and activation recomputation is not
  counted. `flops_6nd` is the 6 N D part alone, `flops` includes attention.
* When n_layer / d_model are not given the shape is estimated from N ~= 12 L d^2 (attention 4 d^2 +
  MLP 8 d^2 per layer, true both for a 4x GELU MLP and a SwiGLU MLP of width 8/3 d; embeddings
  ignored) with d_model / n_layer = aspect_ratio (128, as in GPT-3 175B and Llama 7B), d_model
  rounded to a multiple of 128.
* Mixture of experts: `active_params` (parameters used per token) drive the FLOPs, the shape estimate
  and the compute-optimal token count; total `params` drive memory and checkpoint size.
* Memory, as this repository's trainer holds it (FSDP2, tasks/train/parallelize.py): model states
  take (fp32 weights 4 + fp32 grads 4 + Adam m, v 8) = 16 bytes per parameter, sharded over
  tp x pp x dp_shard ranks, MoE layers' over pp x dp_shard only (they run whole on each tp rank)
  (`model_state_bytes_per_gpu`; tests/test_plan.py checks it against the measured per-rank bytes of
  the parallelized model). The sharded fp32 weights are the master copy:
  with bf16, FSDP2's mixed precision gathers a bf16 copy of one layer at a time (the `gathered` term,
  plan.compute_weight_bytes); there is no separate master copy (plan.master_bytes 0; 4 for a
  trainer keeping bf16 weights). A checkpoint keeps the weights and Adam states: 12 bytes per parameter.
* Activations (activation_bytes): Korthikanti et al.'s 34 bytes per token and width per layer,
  split over tp; full checkpointing keeps each layer's 2-byte input; the output layer keeps fp32
  log-probs (4 B x seq_len x vocab_size, Llama 3's 128,256 unless given), which tp does not split.
  A sequence whose activations do not fit in half the memory at a node's tp is split over
  context-parallel ranks (cp, tasks/train/context_parallel.py) without recompute where some tp x cp
  within a node fits (the cheaper lever: cp's K/V all-gathers stay on NVLink, full checkpointing
  costs ~1/3 more compute), else with full checkpointing and the smallest cp that then fits: 1/cp
  of everything but each layer's all-gathered K/V; tests/test_plan.py checks that term against
  the bytes autograd saves.
* Shape for the trainer: n_head = d_model / 128 (head width 128; an estimated d_model >= 128 x
  gpus_per_node is a multiple of 128 x gpus_per_node, so every tp inside a node divides the heads);
  tp must divide the heads and the MLP width, pp the layers (an estimated n_layer is rounded to a
  multiple of the chosen pp). `tasks/plan/emit.py` turns a plan into a config fragment.
"""
from __future__ import annotations

import functools
import math

from tasks.config import EnergyConfig, GpuSpec, PlanConfig
from tasks.core.energy import plan_energy
from tasks.train.flops import dense_and_attention_flops
from tasks.train.parallel_dims import mlp_hidden

SECONDS_PER_DAY = 86_400.0
ACT_BYTES_PER_TOKEN_PER_D = 34  # 16-bit activations of one layer: 34·s·b·h bytes (Korthikanti et al. 2022)
ACT_VALUE_BYTES = 2  # 16-bit activations: full recompute keeps each layer's input, 2·s·b·h bytes
LOGIT_BYTES = 4  # the trainer's cross-entropy keeps fp32 log-probs of every position for the backward
DEFAULT_VOCAB = 128_256  # Llama 3's vocabulary: the output layer's size when a plan gives none
MAX_CP = 64  # context parallel degrees tried: powers of two up to this


def activation_bytes(n_layer: int, seq_len: int, d_model: int, *, tp: int = 1, cp: int = 1,
                     checkpointed: bool = False, vocab_size: int = 0,
                     per_token_per_d: float = ACT_BYTES_PER_TOKEN_PER_D, value_bytes: float = ACT_VALUE_BYTES) -> float:
    """Activation bytes one GPU keeps for the backward of one sequence through n_layer layers and
    the output layer.

    A layer keeps per_token_per_d · seq_len · d_model / tp bytes (tensor + sequence parallelism
    splits them all), of which K and V are 2 values per token and width. Context parallelism
    (tasks/train/context_parallel.py) keeps 1/cp of the rest but the whole sequence's K and V (this
    rank's heads), all-gathered, saved by attention for the backward, and one more copy of the
    attention output (each query chunk's SDPA keeps its own output, the projection their
    concatenation): per layer seq_len · d_model / tp · ((per_token_per_d - v) / cp + 2 v),
    v = value_bytes. Full activation
    checkpointing keeps each layer's input (value_bytes per token and width, split over tp x cp)
    plus one layer's activations while it is recomputed. The output layer keeps LOGIT_BYTES per
    position and vocabulary entry (fp32 log-probs), 1/cp of them on a cp rank but all on each tp
    rank (the trainer gathers the logits); at long context and a large vocabulary it is the largest
    term (Llama 3 8B at 128k tokens: 67 GB), what cp splits and tp does not. tests/test_plan.py
    measures the cp term on CPU."""
    kv = 2 * value_bytes
    one_layer = seq_len * d_model / tp * (per_token_per_d if cp == 1 else (per_token_per_d - kv + value_bytes) / cp + kv)
    logits = LOGIT_BYTES * seq_len * vocab_size / cp
    if not checkpointed:
        return n_layer * one_layer + logits
    return n_layer * value_bytes * seq_len * d_model / (tp * cp) + one_layer + logits


class PlanError(ValueError):
    """Missing, contradictory or out-of-range planner input; the message says which."""


def _positive(name: str, value: float | int | None, *, integer: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise PlanError(f"{name} must be a positive finite number, got {value!r}")
    if integer and int(value) != value:
        raise PlanError(f"{name} must be a whole number, got {value!r}")


HEAD_DIM = 128  # attention head width of the planned shapes (Llama, GPT-3 large models)


def estimate_shape(params: float, aspect_ratio: float = 128.0, *, n_layer: int | None = None,
                   d_model: int | None = None, heads_multiple: int = 1) -> tuple[int, int]:
    """(n_layer, d_model) for a dense transformer of `params` non-embedding parameters.

    Uses N ~= 12·L·d²; whichever of n_layer / d_model is given is kept and the other derived. An
    estimated d_model is a multiple of 128, and of 128 x heads_multiple once it reaches that (so
    d_model / 128 heads split evenly over up to heads_multiple tensor-parallel ranks).
    """
    if n_layer and d_model:
        return int(n_layer), int(d_model)
    if d_model:
        return max(1, round(params / (12 * d_model**2))), int(d_model)
    if n_layer:
        return int(n_layer), max(1, round(math.sqrt(params / (12 * n_layer))))
    # L = d / aspect  =>  N = 12 d³ / aspect  =>  d = (aspect · N / 12)^(1/3)
    d = (aspect_ratio * params / 12) ** (1 / 3)
    d = max(128, 128 * round(d / 128))
    wide = HEAD_DIM * heads_multiple
    if d >= wide:
        d = wide * round(d / wide)
    return max(1, round(params / (12 * d * d))), int(d)


def heads_for(d_model: int) -> int:
    """Attention heads for a width: head width 128 where it divides, else the widest even head
    width that does (the trainer needs an even head width for RoPE)."""
    for head_dim in (HEAD_DIM, 96, 64, 32, 16, 8, 4, 2):
        if d_model % head_dim == 0:
            return d_model // head_dim
    raise PlanError(f"d_model ({d_model}) must be even: the head width must be even for RoPE")


def model_state_bytes_per_gpu(params: float, *, tp: int, pp: int, dp_shard: int, cfg: PlanConfig,
                              moe_params: float = 0.0) -> float:
    """Bytes of weights, gradients, master weights and optimizer states on each GPU: the dense
    parameters' states sharded over tp x pp x dp_shard ranks (FSDP2 shards within dp_shard; replicas
    repeat them); `moe_params` (of `params`: the MoE layers' router and experts) over pp x dp_shard
    only, since an MoE layer runs whole on every tp rank (experts sharded by ep x FSDP within dp_shard,
    tasks/train/parallelize.py apply_tp)."""
    per_param = cfg.weight_bytes + cfg.grad_bytes + cfg.master_bytes + cfg.optimizer_bytes
    return ((params - moe_params) / tp + moe_params) * per_param / (pp * dp_shard)


def moe_shape(params: float, active_params: float, n_layer: int, d_model: int, top_k: int = 2,
              n_experts: int | None = None) -> dict:
    """Experts of a mixture-of-experts plan whose shape came from its active parameters: each layer
    holds attention (4 d²) and routed SwiGLU experts (3 d H each); top_k of them make the active
    parameters, n_experts (default: as many as the total parameters hold) the total."""
    per_layer = active_params / n_layer - 4 * d_model**2
    hidden = 32 * max(1, round(per_layer / (3 * d_model * top_k) / 32))
    expert = 3 * d_model * hidden
    if n_experts is None:
        n_experts = max(top_k + 1, round((params / n_layer - 4 * d_model**2) / expert))
    if n_experts <= top_k:
        raise PlanError(f"n_experts ({n_experts}) must exceed top_k ({top_k}) in a mixture of experts")
    return {"n_experts": int(n_experts), "top_k": int(top_k), "expert_hidden": int(hidden),
            "params_of_shape": float(n_layer * (4 * d_model**2 + n_experts * expert)),
            "active_params_of_shape": float(n_layer * (4 * d_model**2 + top_k * expert))}


def expert_parallel(n_experts: int, dp_shard: int, tp: int, gpus_per_node: int, cp: int = 1) -> int:
    """train.parallel.ep of a mixture of experts: the largest divisor of n_experts that divides dp_shard
    (the trainer carves the ep ranks out of it), at most 8 and with ep x cp x tp ranks within a node
    (the mesh is (pp, dp_replicate, dp_shard, cp, tp): an ep group is ep consecutive dp_shard ranks,
    cp x tp apart, and its all-to-alls stay on NVLink only if the group spans one node)."""
    return max(d for d in _divisors(n_experts)
               if dp_shard % d == 0 and d <= 8 and d * cp * tp <= gpus_per_node)


def fsdp_shard(dp: int, limit: int) -> int:
    """dp_shard of a dp-way data-parallel group: the largest divisor of dp up to `limit` (HSDP
    replicates the rest, dp_replicate = dp / dp_shard)."""
    return max(d for d in _divisors(dp) if d <= limit)


def _divisors(n: int) -> list[int]:
    return sorted({d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)})


def _largest_tp(gpus: int, n_head: int, d_model: int, cfg: PlanConfig) -> int:
    """The largest power-of-two tensor-parallel degree within a node that divides the GPUs, the heads
    and the MLP width (what the trainer's layout check accepts)."""
    tp = 1
    while (tp * 2 <= min(cfg.gpus_per_node, gpus) and gpus % (tp * 2) == 0
           and n_head % (tp * 2) == 0 and mlp_hidden(d_model) % (tp * 2) == 0):
        tp *= 2
    return tp


def suggest_layout(*, gpus: int, total_params: float, n_layer: int, d_model: int, seq_len: int,
                   spec: GpuSpec, cfg: PlanConfig, n_head: int | None = None, layers_fixed: bool = True,
                   moe_params: float = 0.0, vocab_size: int = DEFAULT_VOCAB) -> dict:
    """Tensor / context / pipeline / data parallel degrees for `gpus` GPUs, with the reasoning spelled out.

    1. Activations (activation_bytes) must fit in half the usable memory (a 1F1B pipeline's first
       stage holds pp in-flight microbatches of L/pp layers, so about L layers' worth whatever pp
       is). The levers, in order: tensor parallelism within a node; if even a full node of tp is not
       enough, cp without recompute if some tp x cp within a node fits (K/V all-gathers on NVLink beat
       full checkpointing's ~1/3 more compute), else full checkpointing, then cp if still too long:
       cp the smallest power of two (seq_len a multiple of 2 cp) that fits, from data parallelism. tp is then the smallest power of two
       with which the activations fit at that cp. The output layer's logits count too: cp splits
       them, tp does not.
    2. pp: 1 unless the model states, 16 bytes x total params / (tp·pp), sharded by FSDP over at
       most `fsdp_shard_limit` data-parallel ranks (dp_shard; x cp when cp > 1), plus an all-gathered layer pair, do not fit in
       the rest. Before adding a stage tp is raised to a full node (its traffic stays on NVLink,
       while a pipeline adds a bubble); each stage needs at least one layer.
    3. dp: the remaining GPUs, FSDP sharding over dp_shard of them (fsdp_shard) and replicating.

    tp divides the heads (n_head, default heads_for(d_model)), the MLP width and seq_len / cp
    (sequence parallelism); pp divides n_layer unless `layers_fixed` is False (the planner then
    rounds the estimated layers to it).
    """
    mem = spec.memory_gb * 1e9 * cfg.usable_memory_fraction
    state_bytes_per_param = cfg.weight_bytes + cfg.grad_bytes + cfg.master_bytes + cfg.optimizer_bytes
    states = total_params * state_bytes_per_param
    layer_params = total_params / n_layer
    n_head = n_head or heads_for(d_model)
    tp_max = _largest_tp(gpus, n_head, d_model, cfg)
    tp_options = [1 << i for i in range(tp_max.bit_length())]

    def activations(tp: int, checkpointed: bool, cp: int = 1) -> float:
        return activation_bytes(n_layer, seq_len, d_model, tp=tp, cp=cp, checkpointed=checkpointed,
                                vocab_size=vocab_size)

    cp_options = [c for c in (1 << i for i in range(MAX_CP.bit_length()))
                  if c == 1 or (seq_len % (2 * c) == 0 and gpus % c == 0)]

    def tps(cp: int, in_node: bool = False) -> list[int]:  # tp dividing gpus / cp, seq_len / cp (tp x cp in a node)
        return [t for t in tp_options if (gpus // cp) % t == 0 and (seq_len // cp) % t == 0
                and (not in_node or t * cp <= cfg.gpus_per_node)]

    # recompute (~1/3 more compute) or cp: no recompute where some cp with tp x cp within a node fits
    # (its K/V all-gathers stay on NVLink, the mesh puts cp beside tp), else full checkpointing
    checkpointed = not any(activations(t, False, c) <= mem / 2 for c in cp_options for t in tps(c, True))
    if not checkpointed:  # cp and its tp kept within a node
        cp_options = [c for c in cp_options if tps(c, True)]
        tps = functools.partial(tps, in_node=True)

    def fits_at(cp: int) -> bool:
        return activations(max(tps(cp)), checkpointed, cp) <= mem / 2

    # the smallest cp with which some tp fits the activations (else the one that leaves the least)
    cp = next((c for c in cp_options if fits_at(c)), None) or min(
        cp_options, key=lambda c: activations(max(tps(c)), checkpointed, c))
    tp_act = next((t for t in tps(cp) if activations(t, checkpointed, cp) <= mem / 2), max(tps(cp)))

    def shard_of(tp: int, pp: int) -> int:  # dp_shard; FSDP shards over dp_shard x cp (the trainer's dp_shard_cp)
        return fsdp_shard(gpus // (tp * pp * cp), cfg.fsdp_shard_limit)

    def states_per_gpu(tp: int, pp: int) -> float:
        return model_state_bytes_per_gpu(total_params, tp=tp, pp=pp, dp_shard=shard_of(tp, pp) * cp, cfg=cfg,
                                         moe_params=moe_params)

    def per_gpu(tp: int, pp: int) -> float:
        gathered = 2 * layer_params * cfg.compute_weight_bytes / tp  # FSDP: current layer + prefetched next
        return states_per_gpu(tp, pp) + gathered + activations(tp, checkpointed, cp)

    def stages_ok(pp: int) -> bool:
        return pp <= n_layer and (not layers_fixed or n_layer % pp == 0)

    choice = None
    for pp in _divisors(gpus // cp):
        if pp > n_layer:
            break
        if not stages_ok(pp):
            continue
        for tp in (t for t in tps(cp) if t >= tp_act and (gpus // (pp * cp)) % t == 0):
            if per_gpu(tp, pp) <= mem:
                choice = (tp, pp)
                break
        if choice:
            break
    fits = choice is not None
    if not fits:  # report the most model-parallel layout there is, flagged as not fitting
        pp = max(d for d in _divisors(gpus // (max(tps(cp)) * cp)) if stages_ok(d))
        choice = (max(tps(cp)), pp)
    tp, pp = choice
    dp = gpus // (tp * pp * cp)
    dp_shard = shard_of(tp, pp)
    microbatches = cfg.microbatches_per_stage * pp if pp > 1 else 1
    bubble = (pp - 1) / (microbatches + pp - 1)
    need_gb = per_gpu(tp, pp) / 1e9
    why = _layout_rationale(locals())
    return {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "dp_shard": dp_shard, "dp_replicate": dp // dp_shard,
            "n_head": n_head, "microbatches": microbatches, "bubble_fraction": bubble,
            "activation_checkpointing": checkpointed, "fits": fits,
            "activation_gb_per_gpu": activations(tp, checkpointed, cp) / 1e9,
            "model_state_gb_per_gpu": states_per_gpu(tp, pp) / 1e9,
            "memory_per_gpu_gb": need_gb, "rationale": "; ".join(why)}


def _layout_rationale(v: dict) -> list[str]:
    """suggest_layout's reasoning, one clause per degree, from its local variables `v`."""
    tp, tp_act, tp_max, pp, cp, dp, dp_shard = (v[k] for k in ("tp", "tp_act", "tp_max", "pp", "cp", "dp", "dp_shard"))
    n_layer, mem, cfg, states, gpus = v["n_layer"], v["mem"], v["cfg"], v["states"], v["gpus"]
    activations, checkpointed, fits = v["activations"], v["checkpointed"], v["fits"]
    why = [f"tp={tp}: " + (
        f"with tensor (+sequence) parallelism over {tp} GPU(s) of a node{f' and cp={cp}' if cp > 1 else ''}, one "
        f"sequence's activations through all {n_layer} layers take {activations(tp, checkpointed, cp) / 1e9:.1f} GB "
        f"per GPU, within half of the {mem / 1e9:.0f} GB usable" if tp == tp_act else
        f"raised from {tp_act} to {tp} (tensor parallelism stays on the node's NVLink) before adding "
        "pipeline stages")]
    if checkpointed:
        why.append("full activation checkpointing assumed: without it the activations do not fit even "
                   f"at tp={tp_max}, nor with any cp x tp within a node of {cfg.gpus_per_node}")
    if cp > 1:
        why.append(f"cp={cp}: the {v['seq_len']}-token sequence's activations "
                   f"({activations(tp_max, checkpointed) / 1e9:.1f} GB at tp={tp_max}"
                   f"{' with checkpointing' if checkpointed else ', without checkpointing'}) do not fit in "
                   "half the memory: split over "
                   f"{cp} context-parallel ranks (each keeps 1/{cp} of them plus every layer's gathered K/V) "
                   f"they take {activations(tp, checkpointed, cp) / 1e9:.1f} GB; the cp ranks come from data "
                   f"parallelism (FSDP shards over dp_shard x cp = {dp_shard * cp})")
    state_bytes_per_param = v["state_bytes_per_param"]
    why.append(f"pp={pp}: " + (
        f"the most model parallelism {gpus} GPU(s) and {n_layer} layers allow, and still the model states "
        f"({states / 1e9:.0f} GB = {state_bytes_per_param:g} B x {v['total_params']:.3g} params) do not fit"
        if not fits else
        f"model states ({states / 1e9:.0f} GB = {state_bytes_per_param:g} B x {v['total_params']:.3g} params) "
        f"/ tp, FSDP-sharded over up to {cfg.fsdp_shard_limit} data-parallel ranks, fit next to the "
        "activations, so no pipeline" if pp == 1 else
        f"model states ({states / 1e9:.0f} GB) / (tp·pp), FSDP-sharded over up to {cfg.fsdp_shard_limit} "
        f"data-parallel ranks, only fit with {pp} pipeline stages across nodes; 1F1B with "
        f"{v['microbatches']} microbatches ({cfg.microbatches_per_stage} per stage) idles "
        f"(pp-1)/(m+pp-1) = {v['bubble']:.1%} of the time"))
    why.append(f"dp={dp}: the remaining GPUs replicate the tp x pp{' x cp' if cp > 1 else ''} model group (FSDP "
               f"shards within groups of dp_shard={dp_shard}{f' x cp={cp}' if cp > 1 else ''}, "
               f"dp_replicate={dp // dp_shard})")
    spec = v["spec"]
    why.append(f"estimated {v['need_gb']:.1f} GB of {spec.memory_gb:g} GB per GPU in use" if fits else
               f"does NOT fit: about {v['need_gb']:.0f} GB per GPU needed with {spec.memory_gb:g} GB each; "
               "use more GPUs, GPUs with more memory, or a smaller model")
    return why


def _timing(flops: float, gpus: int, spec: GpuSpec, mfu: float) -> dict:
    seconds = flops / (gpus * spec.peak_bf16_flops * mfu)
    gpu_hours = seconds * gpus / 3600.0
    return {"seconds": seconds, "days": seconds / SECONDS_PER_DAY, "gpu_hours": gpu_hours,
            "cost_usd": gpu_hours * spec.price_per_hour}


def _pick_gpus(flops: float, spec: GpuSpec, mfu: float, layout_for, cfg: PlanConfig) -> int:
    """Fewest GPUs finishing within target_days whose layout fits: 1, 2, 4, 8, then whole nodes."""
    need = flops / (spec.peak_bf16_flops * mfu * cfg.target_days * SECONDS_PER_DAY)
    node = cfg.gpus_per_node
    if need <= node:
        n = 1
        while n < need:
            n *= 2
        n = min(n, node)
    else:
        n = node * math.ceil(need / node)
    for _ in range(64):  # small powers of two first, then grow by nodes
        if layout_for(n)["fits"]:
            return n
        n = n * 2 if n < node else max(node * math.ceil(n * 1.25 / node), n + node)
    return n


def _time_cost_energy(flops: float, gpus: int, spec: GpuSpec, mfu: float, key: str, energy: EnergyConfig | None,
                      assumptions: list[str]) -> dict:
    """_timing plus the energy and CO2e of its GPU-hours (tasks.core.energy.plan_energy: the constants
    the stages' measurements use); its assumption appended."""
    timing = _timing(flops, gpus, spec, mfu)
    footprint = plan_energy(timing["gpu_hours"], key, spec.tdp_w, energy)
    assumptions.append(footprint.pop("energy_assumption"))
    return {**timing, **footprint}


def _check_inputs(params, tokens, flops, gpus, gpu, mfu, seq_len, n_layer, d_model, active_params,
                  cfg: PlanConfig) -> tuple[float, str, GpuSpec]:
    """Validate make_plan's arguments; returns (mfu, gpu key, its spec). Raises PlanError."""
    for name, value in (("params", params), ("tokens", tokens), ("flops", flops),
                        ("active_params", active_params), ("mfu", mfu)):
        _positive(name, value)
    for name, value in (("gpus", gpus), ("seq_len", seq_len), ("n_layer", n_layer), ("d_model", d_model)):
        _positive(name, value, integer=True)
    mfu = cfg.mfu if mfu is None else float(mfu)
    if mfu > 1:
        raise PlanError(f"mfu is a fraction of peak in (0, 1], got {mfu}")
    key = str(gpu).lower()
    if key not in cfg.gpus:
        raise PlanError(f"unknown gpu {gpu!r}; known: {', '.join(sorted(cfg.gpus))} (add one under plan.gpus)")
    if active_params is not None:
        if params is None:
            raise PlanError("active_params needs params, the total parameter count of the MoE model")
        if active_params > params:
            raise PlanError(f"active_params ({active_params:.3g}) cannot exceed params ({params:.3g})")
    if params is None and flops is None:
        raise PlanError("give params (a parameter count) or flops (a compute budget), or both")
    if params is not None and tokens is not None and flops is not None:
        raise PlanError("params, tokens and flops over-determine the plan: give at most two of them")
    return mfu, key, cfg.gpus[key]


def _size_and_tokens(params, tokens, flops, active_params, ratio: float,
                     assumptions: list[str]) -> tuple[float, float, float]:
    """(params, tokens, compute_params) from whichever of params / tokens / flops were given, the
    missing ones following Chinchilla's 6ND convention; notes each derivation in `assumptions`."""
    compute_params = active_params if active_params is not None else params
    if params is None:  # a FLOP budget, perhaps with a token count
        if tokens is not None:
            params = flops / (6 * tokens)
            assumptions.append(f"params = flops / (6 x tokens) = {params:.3g}")
        else:
            params = math.sqrt(flops / (6 * ratio))
            tokens = ratio * params
            assumptions.append(f"compute-optimal split of the budget (Chinchilla): N = sqrt(C / (6 x {ratio:g})) "
                               f"= {params:.3g} params, D = {ratio:g} N = {tokens:.3g} tokens")
        compute_params = params
    elif tokens is None:
        if flops is not None:
            tokens = flops / (6 * compute_params)
            assumptions.append(f"tokens = flops / (6 x {'active ' if active_params else ''}params) = {tokens:.3g}")
        else:
            tokens = ratio * compute_params
            assumptions.append(f"tokens = {ratio:g} x {'active ' if active_params else ''}params (Chinchilla "
                               "compute-optimal ratio, Hoffmann et al. 2022)")
    if flops is not None:
        assumptions.append("a FLOP budget is read as 6·N·D (Chinchilla's convention); the attention term "
                           "comes on top of it in `flops`")
    if active_params is not None:
        assumptions.append("MoE: FLOPs, the shape estimate and the default token count use active_params; "
                           "memory, layout and checkpoint size use the total params (no settled "
                           "compute-optimal ratio exists for MoE)")
    return params, tokens, compute_params


def _hardware_assumptions(key: str, spec: GpuSpec, mfu: float, cfg: PlanConfig, vocab_size: int) -> list[str]:
    """How time, cost, checkpoint size and layout were computed, as plan assumptions."""
    state_bytes = cfg.weight_bytes + cfg.grad_bytes + cfg.master_bytes + cfg.optimizer_bytes
    return [
        f"time = flops / (gpus x peak x MFU) with {key} peak {spec.peak_bf16_flops:.4g} FLOP/s dense BF16 and "
        f"MFU {mfu:g}; the MFU is end to end, so pipeline bubbles, stalls and restarts are inside it",
        f"cost = gpu_hours x ${spec.price_per_hour:g}/GPU-hour (a ballpark on-demand price; set plan.gpus)",
        f"checkpoint = params x ({cfg.weight_bytes:g} weights + {cfg.master_bytes:g} separate master + "
        f"{cfg.optimizer_bytes:g} Adam m, v) bytes; model states in memory also hold "
        f"{cfg.grad_bytes:g}-byte gradients ({state_bytes:g} bytes per param, sharded over tp x pp x dp_shard x cp, "
        "a mixture of experts' MoE layers over pp x dp_shard only; "
        f"FSDP2 keeps fp32 sharded weights as the master copy and gathers {cfg.compute_weight_bytes:g}-byte "
        "compute copies one layer at a time)",
        "layout: tp inside a node sized by activations; a sequence too long for it takes the smallest context "
        "parallelism cp with which it fits without recompute while tp x cp stays within a node (cp's K/V "
        "all-gathers on NVLink, cheaper than full checkpointing's ~1/3 more compute), else full activation "
        "checkpointing and then the smallest cp that fits (activations / cp plus each layer's gathered K/V; the "
        f"output layer's fp32 log-probs, {LOGIT_BYTES} B x seq_len x vocab_size {vocab_size:,}, / cp), pp across nodes only when "
        "FSDP-sharded model states do not fit, dp for the rest; bubble = (pp-1)/(microbatches+pp-1) for 1F1B",
    ]


def _moe_plan(params: float, active_params: float, n_layer: int, d_model: int, top_k: int,
              n_experts: int | None, layout: dict, cfg: PlanConfig, assumptions: list[str]) -> dict:
    """The experts' shape and expert parallelism of a mixture-of-experts plan (assumptions appended)."""
    moe = moe_shape(params, active_params, n_layer, d_model, top_k, n_experts)
    moe["ep"] = expert_parallel(moe["n_experts"], layout["dp_shard"], layout["tp"], cfg.gpus_per_node, layout["cp"])
    assumptions.append(f"expert parallelism ep={moe['ep']}: each rank holds {moe['n_experts'] // moe['ep']} "
                       f"of the {moe['n_experts']} experts per layer, ep groups within a node")
    assumptions.append(f"MoE experts: {moe['n_experts']} routed SwiGLU experts of width {moe['expert_hidden']} "
                       f"per layer, top-{top_k}: width from the active params, count from the total "
                       f"(this shape holds {moe['params_of_shape']:.3g} total, "
                       f"{moe['active_params_of_shape']:.3g} active)")
    return moe


def make_plan(params: float | None = None, tokens: float | None = None, flops: float | None = None,
              gpus: int | None = None, gpu: str = "h100", mfu: float | None = None, seq_len: int = 4096,
              n_layer: int | None = None, d_model: int | None = None, active_params: float | None = None,
              cfg: PlanConfig | None = None, n_head: int | None = None, n_experts: int | None = None,
              top_k: int = 2, energy: EnergyConfig | None = None, vocab_size: int = DEFAULT_VOCAB) -> dict:
    """A training plan from a parameter count and/or a FLOP budget; see the module docstring.

    Give `params` (tokens default to the compute-optimal count, or follow from `flops`), or `flops`
    alone (compute-optimal split), or `flops` with `tokens`. `active_params` (MoE) needs `params`,
    the total. `gpus` None picks the fewest GPUs that finish within `cfg.target_days`; `mfu` None
    takes `cfg.mfu`. Energy and CO2e: tasks.core.energy.plan_energy with `energy` (default EnergyConfig()),
    the constants the stages' measurements use. Raises PlanError on missing or invalid input.
    """
    cfg = cfg or PlanConfig()
    mfu, key, spec = _check_inputs(params, tokens, flops, gpus, gpu, mfu, seq_len, n_layer, d_model,
                                   active_params, cfg)
    for name, value in (("n_head", n_head), ("n_experts", n_experts), ("top_k", top_k), ("vocab_size", vocab_size)):
        _positive(name, value, integer=True)
    if n_experts is not None and active_params is None:
        raise PlanError("n_experts plans a mixture of experts: give active_params (and params, the total) too")
    if n_head and d_model and (d_model % n_head or (d_model // n_head) % 2):
        raise PlanError(f"n_head ({n_head}) must divide d_model ({d_model}) into an even head width")
    assumptions: list[str] = []
    params, tokens, compute_params = _size_and_tokens(params, tokens, flops, active_params,
                                                      cfg.tokens_per_param, assumptions)

    shape_given = n_layer is not None and d_model is not None
    layers_given = n_layer is not None
    n_layer, d_model = estimate_shape(compute_params, cfg.aspect_ratio, n_layer=n_layer, d_model=d_model,
                                      heads_multiple=cfg.gpus_per_node)
    n_head = n_head or heads_for(d_model)
    if not shape_given:
        assumptions.append(f"shape estimated from N ~= 12·L·d² with d_model/n_layer ~= {cfg.aspect_ratio:g} "
                           f"(d_model a multiple of 128, of {HEAD_DIM * cfg.gpus_per_node} from there on, unless "
                           f"given): n_layer={n_layer}, d_model={d_model}, n_head={n_head} (head width "
                           f"{d_model // n_head})")

    def flops_of(n_layer: int) -> tuple[float, float, float]:
        dense, attention = dense_and_attention_flops(compute_params, n_layer, d_model, seq_len)
        return dense * tokens, (dense + attention) * tokens, attention / (dense + attention)

    flops_6nd, total_flops, attention_fraction = flops_of(n_layer)
    assumptions.append("training FLOPs = (6N + 12·L·d_model·T) x tokens (PaLM appendix B, as torchtitan "
                       f"counts MFU; T = seq_len = {seq_len}); causal masking not discounted, activation "
                       "recomputation not counted")

    def layout_for(n: int, layers: int | None = None, fixed: bool = layers_given) -> dict:
        # a mixture of experts: all but the attention (4 d² a layer) is MoE layers, not tp-sharded
        moe_params = 0.0 if active_params is None else max(0.0, params - (layers or n_layer) * 4 * d_model**2)
        return suggest_layout(gpus=n, total_params=params, n_layer=layers or n_layer, d_model=d_model,
                              seq_len=seq_len, spec=spec, cfg=cfg, n_head=n_head, layers_fixed=fixed,
                              moe_params=moe_params, vocab_size=vocab_size)

    if gpus is None:
        gpus = _pick_gpus(total_flops, spec, mfu, layout_for, cfg)
        assumptions.append(f"gpus not given: the fewest ({gpus}) that finish within {cfg.target_days:g} days "
                           "and hold the model states")
    gpus = int(gpus)
    layout = layout_for(gpus)
    if n_layer % layout["pp"]:  # estimated layers: rounded to whole pipeline stages (the trainer's rule)
        rounded = layout["pp"] * max(1, round(n_layer / layout["pp"]))
        assumptions.append(f"n_layer rounded from {n_layer} to {rounded}, a multiple of pp={layout['pp']} "
                           "(each pipeline stage holds as many layers)")
        n_layer = rounded
        layout = layout_for(gpus, rounded, True)
        flops_6nd, total_flops, attention_fraction = flops_of(n_layer)
    assumptions += _hardware_assumptions(key, spec, mfu, cfg, vocab_size)
    if not layout["fits"]:
        assumptions.append(f"WARNING: the model does not fit on {gpus} x {key}: {layout['rationale']}")
    state_bytes = cfg.weight_bytes + cfg.grad_bytes + cfg.master_bytes + cfg.optimizer_bytes
    ckpt_bytes = cfg.weight_bytes + cfg.master_bytes + cfg.optimizer_bytes
    moe = None if active_params is None else _moe_plan(params, compute_params, n_layer, d_model, top_k,
                                                         n_experts, layout, cfg, assumptions)
    return {
        "moe": moe,
        "params": float(params),
        "active_params": float(compute_params),
        "tokens": float(tokens),
        "tokens_per_param": float(tokens / compute_params),
        "flops_budget": None if flops is None else float(flops),
        "flops": float(total_flops),
        "flops_6nd": float(flops_6nd),
        "attention_flops_fraction": float(attention_fraction),
        "n_layer": n_layer,
        "d_model": d_model,
        "n_head": n_head,
        "seq_len": int(seq_len),
        "vocab_size": int(vocab_size),
        "shape_estimated": not shape_given,
        "gpu": key,
        "gpus": gpus,
        "peak_flops_per_gpu": spec.peak_bf16_flops,
        "mfu": mfu,
        **_time_cost_energy(total_flops, gpus, spec, mfu, key, energy, assumptions),
        "model_state_bytes": float(params * state_bytes),
        "checkpoint_bytes": float(params * ckpt_bytes),
        "layout": layout,
        "assumptions": assumptions,
    }
