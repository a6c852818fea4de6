"""Mixture-of-experts MLP (model.moe): token-choice top-k routing, dropless, with shared experts.

    scores = softmax | sigmoid(router(x))                          (N tokens, E experts), fp32
    chosen = top_k(scores + expert_bias)                           bias steers selection only
    weight = scores[chosen] (/ their sum with route_norm)          weights never see the bias
    y      = sum_k weight_k * expert_k(x) + shared(x)              experts are SwiGLUs

- Dropless: every token reaches its k experts. Token slots are sorted by expert and each expert
  runs one matmul over its contiguous group (no capacity factor, no padding, nothing dropped).
- DeepSeek-V3 auxiliary-loss-free balancing: `tokens_per_expert` counts the slots each expert got
  in training forwards; after each optimizer step `balance_experts` sums the counts over the
  data-parallel ranks and moves `expert_bias` by bias_update_rate * sign(mean load - load).
- Optional Switch load-balancing loss (aux_loss) and ST-MoE router z-loss (router_z_loss): their
  gradient is injected by `_AddLossGrad`, an identity on the layer's output, so the forward value
  (and the logged loss) is the language-model loss alone and nothing has to carry the extra loss
  out of the layer; under pipelining the stage's backward reaches it like any other gradient.
- Expert parallelism (tasks/train/expert_parallel.py) swaps in a dispatcher that moves each
  expert's token group to the rank holding that expert (all-to-all) and back; this module then
  only sees its E/ep local experts' rows.

Parameter names are a contract with the checkpoint, export and parallelism code:
router.weight (E, d), buffer expert_bias (E,), experts.w1 / w3 (E, H, d), experts.w2 (E, d, H),
shared (SwiGLU of hidden H x n_shared_experts, or None).
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tasks.train.mlp import SwiGLU
from tasks.train.torch_private import private


@dataclass
class MoEArgs:
    """model.moe (tasks/config.py MoEConfig) as the model carries it and checkpoints record it."""
    n_experts: int = 0  # 0: dense model
    top_k: int = 2
    n_shared_experts: int = 0
    every_n_layers: int = 1
    expert_hidden: int | None = None  # None: the dense MLP's hidden size
    score_func: str = "softmax"
    route_norm: bool = True
    bias_update_rate: float = 1e-3
    aux_loss: float = 0.0
    router_z_loss: float = 0.0

    @classmethod
    def of(cls, value) -> "MoEArgs":
        """From a MoEArgs, a dict (a checkpoint's meta) or a pydantic MoEConfig."""
        if isinstance(value, cls):
            return value
        if value is None:
            return cls()
        if not isinstance(value, dict):
            value = value.model_dump()
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:  # a newer config's option this model would silently ignore
            raise ValueError(f"model.moe: unknown option(s) {sorted(unknown)}")
        return cls(**value)

    def to_dict(self) -> dict:
        return asdict(self)

    def is_moe_layer(self, i: int) -> bool:
        """Layer i's MLP is sparse when (i + 1) % every_n_layers == 0 (Qwen's decoder_sparse_step)."""
        return self.n_experts > 0 and (i + 1) % self.every_n_layers == 0


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by `scale`. Expert parallelism uses it on
    the expert weights: each ep rank's expert gradient already sums its ep group's token
    contributions, and the data-parallel reduction that follows averages, so 1/ep here makes the
    result the same average over all data-parallel ranks that every other parameter gets."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class _AddLossGrad(torch.autograd.Function):
    """Returns `out` unchanged; its backward also gives `loss` the gradient `scale`, as if
    scale * loss had been added to the objective (Megatron's MoEAuxLossAutoScaler idea)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = torch.full(ctx.loss_shape, ctx.scale, dtype=ctx.loss_dtype, device=grad.device)
        return grad, g, None


def _local(w: torch.Tensor) -> torch.Tensor:
    """The rows of an expert weight this rank holds (a DTensor sharded over the ep mesh under
    expert parallelism, a plain tensor otherwise)."""
    return w.to_local() if hasattr(w, "to_local") else w


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: w1 (gate) and w3 (up) (E, H, d), w2 (down) (E, d, H).
    forward takes the token rows already grouped by expert (counts[e] rows for expert e, in order)."""

    def __init__(self, n_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.grad_scale = 1.0  # 1/ep under expert parallelism (see _ScaleGrad)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ws = []
        for w in (self.w1, self.w3, self.w2):
            w = _local(w)
            if self.grad_scale != 1.0:
                w = _ScaleGrad.apply(w, self.grad_scale)
            ws.append(w.to(x.dtype))  # bf16 activations with fp32 weights the FSDP policy did not cast
        w1, w3, w2 = ws
        if len(counts) != w1.size(0):
            raise ValueError(f"{len(counts)} token groups for {w1.size(0)} local experts")
        # one matmul per expert over its contiguous group; an empty group still runs (a (0, d)
        # matmul), so every local expert weight gets a gradient (zero) on every rank
        outs = [F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e])
                for e, xe in enumerate(torch.split(x, counts))]
        return torch.cat(outs) if outs else x.new_empty(0, w2.size(1))


def _in_backward() -> bool:
    """True while autograd's engine runs a backward (activation checkpointing recomputes the
    forward then): the recomputation must not count tokens a second time."""
    return private("_current_graph_task_id")() != -1


_uncounted = 0  # > 0 inside `uncounted()`


@contextlib.contextmanager
def uncounted():
    """Forwards that are not training steps' (a pipeline stage's shape inference runs the stage on
    a batch, or on empty tensors, before the first real micro-batch) count no tokens per expert."""
    global _uncounted
    _uncounted += 1
    try:
        yield
    finally:
        _uncounted -= 1


def counting() -> bool:
    """Whether a training forward now counts tokens per expert (see `uncounted`, `_in_backward`)."""
    return not _uncounted and not _in_backward()


class MoE(nn.Module):
    """The sparse MLP of one block (blocks.{i}.mlp); input and output (..., d_model)."""

    def __init__(self, d_model: int, dense_hidden: int, args: MoEArgs):
        super().__init__()
        self.args = args
        E = args.n_experts
        hidden = args.expert_hidden or dense_hidden
        self.n_experts, self.top_k, self.hidden = E, args.top_k, hidden
        self.router = nn.Linear(d_model, E, bias=False)
        self.experts = GroupedExperts(E, d_model, hidden)
        self.shared = SwiGLU(d_model, hidden * args.n_shared_experts) if args.n_shared_experts else None
        # selection-only bias (aux-loss-free balancing); saved: it is part of the trained routing
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
        # token slots per expert since the last balance_experts (training forwards only); integer, so
        # exact and left alone by model.to(dtype); not saved: a checkpoint is taken after the reset
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.int64), persistent=False)
        self.dispatcher = None  # expert_parallel.ExpertDispatcher under expert parallelism
        self.loss_scale = 1.0  # gradient the aux and z losses get (set_moe_loss_scale: 1 / micro-batches)
        # context parallelism: the cp group, whose ranks hold the rest of these sequences; the Switch
        # loss's expert fractions are counted over it (context_parallel.apply_cp)
        self.sequence_group = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits (N, E), scores (N, E) (at least fp32), chosen experts (N, k), weights (N, k))."""
        logits = self.router(x)
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: fp32 scores
        scores = torch.sigmoid(wide) if self.args.score_func == "sigmoid" else torch.softmax(wide, dim=-1)
        with torch.no_grad():
            chosen = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.args.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, scores, chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N, k = x.size(0), self.top_k
        logits, scores, chosen, weights = self.route(x)
        flat = chosen.reshape(-1)  # token slot j = token j // k
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order within
        counts = torch.bincount(flat, minlength=self.n_experts)
        token_of_slot = order // k
        routed = x[token_of_slot]
        if self.dispatcher is None:
            y = self.experts(routed, counts.tolist())
        else:
            y = self.dispatcher(routed, counts, self.experts)
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        out = x.new_zeros(x.shape, dtype=y.dtype).index_add_(0, token_of_slot, y)  # y is bf16 under autocast
        if self.shared is not None:
            out = out + self.shared(x)
        if self.training:
            if counting():
                self.tokens_per_expert += counts
            extra = self._router_losses(logits, scores, counts, N)
            if extra is not None and torch.is_grad_enabled():
                out = _AddLossGrad.apply(out, extra, self.loss_scale)
        return out.view(shape)

    def _router_losses(self, logits: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor,
                       n_tokens: int) -> torch.Tensor | None:
        """aux_loss x Switch load-balancing loss + router_z_loss x ST-MoE z-loss of this batch, or None.

        Switch (Fedus et al. 2021): E * sum_e f_e * P_e, f_e the fraction of token slots sent to
        expert e (not differentiable), P_e the mean routing probability of e (scores normalised per
        token, so sigmoid scores count as a distribution too); 1 when perfectly balanced.
        z-loss (Zoph et al. 2022): mean over tokens of logsumexp(router logits)^2."""
        a = self.args
        total = None
        if a.aux_loss:
            probs = scores / scores.sum(dim=-1, keepdim=True)
            if self.sequence_group is not None:
                # f over the whole sequences (not differentiable): each cp rank's f x its own P, averaged
                # over the cp ranks with the gradients, is then the whole batch's loss
                counts = counts.clone()
                dist.all_reduce(counts, group=self.sequence_group)
                n_tokens *= dist.get_world_size(self.sequence_group)
            f = counts.to(probs.dtype) / (n_tokens * self.top_k)
            total = a.aux_loss * self.n_experts * (f * probs.mean(dim=0)).sum()
        if a.router_z_loss:
            z = a.router_z_loss * torch.logsumexp(logits.to(scores.dtype), dim=-1).pow(2).mean()
            total = z if total is None else total + z
        return total


# ---------------------------------------------------------------------- training-loop helpers


def moe_layers(model_parts) -> list[tuple[int, MoE]]:
    """(layer index, MoE) of every sparse layer in the given model(s) (pipeline stages hold some
    blocks each; ModuleDict or ModuleList blocks, indexed by their name)."""
    parts = model_parts if isinstance(model_parts, (list, tuple)) else [model_parts]
    found = []
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                found.append((_layer_index(name), module))
    return sorted(found, key=lambda t: t[0])


def _layer_index(name: str) -> int:
    """'blocks.3.mlp' (possibly under wrappers' prefixes) -> 3; a lone MoE layer ('') is layer 0."""
    if not name:
        return 0
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "blocks" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    raise ValueError(f"cannot tell the layer of MoE module {name!r}")


def set_moe_loss_scale(model_parts, scale: float) -> None:
    """The gradient each MoE layer's aux and z losses get per forward: the weight the step's
    objective gives one micro-batch (1 / micro-batches per rank, as the cross-entropy's `loss / accum`),
    so the balancing pressure is the same in every layout and accumulation split."""
    for _, moe in moe_layers(model_parts):
        moe.loss_scale = scale


@torch.no_grad()
def balance_experts(model_parts, dp_group=None, pp_group=None, update_bias: bool = True) -> dict[int, dict]:
    """After an optimizer step: each MoE layer's token counts summed over the data-parallel ranks
    (`dp_group`: the ranks that saw different tokens, dp x cp; never tp, whose ranks saw the same;
    None: this process alone), expert_bias += bias_update_rate * sign(mean load - load) (DeepSeek-V3;
    not with update_bias False, for a skipped batch), counts reset.
    Returns {layer: {"tokens": [...], "imbalance": max/mean (, "ep_sent": token rows this rank sent
    to other ep ranks since the last call)}}, every layer's with `pp_group` (the pipeline ranks
    holding the other layers), else this rank's layers only.

    Collective over dp_group (and pp_group); every rank ends with the same bias."""
    import torch.distributed as dist

    layers = moe_layers(model_parts)
    stats: dict[int, dict] = {}
    if layers:
        counts = torch.stack([m.tokens_per_expert for _, m in layers])  # one collective for all layers
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(counts, group=dp_group)
        for (i, m), c in zip(layers, counts.double()):
            rate = m.args.bias_update_rate
            if rate and update_bias:
                delta = rate * torch.sign(c.mean() - c)
                # centred: a shift common to all experts changes no selection, and this keeps the
                # bias from drifting with sign's asymmetries
                m.expert_bias += (delta - delta.mean()).to(m.expert_bias.dtype)
            m.tokens_per_expert.zero_()
            mean = float(c.mean())
            stats[i] = {"tokens": [float(v) for v in c.tolist()],
                        "imbalance": float(c.max()) / mean if mean > 0 else 0.0}
            if m.dispatcher is not None:  # expert parallelism: rows this rank sent to other ep ranks
                stats[i]["ep_sent"] = float(m.dispatcher.rows_sent_away)
                m.dispatcher.rows_sent_away = 0
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        gathered = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(gathered, stats, group=pp_group)
        stats = {i: s for part in gathered for i, s in part.items()}
    return stats


def moe_metrics(stats: dict[int, dict]) -> dict[str, float]:
    """balance_experts' stats as flat metric names: moe/layer{i}/imbalance, moe/layer{i}/tokens_e{j}
    (and moe/layer{i}/ep_sent under expert parallelism)."""
    out = {}
    for i in sorted(stats):
        out[f"moe/layer{i}/imbalance"] = stats[i]["imbalance"]
        if "ep_sent" in stats[i]:
            out[f"moe/layer{i}/ep_sent"] = stats[i]["ep_sent"]
        for j, t in enumerate(stats[i]["tokens"]):
            out[f"moe/layer{i}/tokens_e{j}"] = t
    return out
